"""Parity post-check hooks: how a C0 run on freshly converted weights gets wired into `fvconvert`.

The post-check a manifest names (`parity.post_check`, default the family name; "wan.transformer" for a component)
is found at run time, by module name, in the family's parity entry: `parity.families.<family>` exports
`FAMILY = ParityFamily(...)` whose `check_converted` (the family's default component) or
`component_post_checks["<family>.<component>"]` is the check. converters/ may not import parity/ statically (the
import rule), so the lookup is `importlib.import_module` at run time: a new family's folder is enough, no
registration or reinstall. A manifest naming a check that no entry declares is an error (fvconvert exits 2),
never a silent "not run"; `--skip-parity` converts without it, explicitly.

In-process overrides (tests, notebooks) still take precedence:

    from converters.hooks import register_post_check
    register_post_check("cosmos3", my_check)      # my_check(tmp_out_dir: Path) -> {"status": "pass"|"fail", ...}
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from converters.errors import ConversionError

PARITY_FAMILIES = "parity.families"          # the package whose `<family>` module holds a family's parity entry
_REGISTRY: dict[str, Callable[[Path], dict]] = {}


class MissingPostCheck(ConversionError):
    """The manifest asks for a post-check that no parity entry declares (fvconvert exits 2)."""


def register_post_check(family: str, fn: Callable[[Path], dict] | None) -> None:
    """Register (or with None, remove) the post-check `fvconvert FAMILY` runs unless --skip-parity. The name
    looked up is the manifest's `parity.post_check`, which defaults to the family name."""
    if fn is None:
        _REGISTRY.pop(family, None)
    else:
        _REGISTRY[family] = fn


def _parity_entry(family: str, name: str) -> Any:
    module_name = f"{PARITY_FAMILIES}.{family}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):   # the family's parity module itself is absent
            raise MissingPostCheck(f"no parity post-check {name!r}: there is no parity family module {module_name} "
                                   f"(parity/families/{family}/ exporting FAMILY = ParityFamily(..., "
                                   f"check_converted=...)); pass --skip-parity to convert without it") from None
        raise ConversionError(f"parity post-check {name!r}: {module_name} cannot be imported "
                              f"(ModuleNotFoundError: {e}); pass --skip-parity to convert without it") from None
    except Exception as e:  # noqa: BLE001 - a broken parity module: say which, keep the CLI's one-line contract
        raise ConversionError(f"parity post-check {name!r}: {module_name} cannot be imported "
                              f"({type(e).__name__}: {e}); pass --skip-parity to convert without it") from None
    entry = getattr(module, "FAMILY", None)
    if entry is None:
        raise MissingPostCheck(f"no parity post-check {name!r}: {module_name} exports no FAMILY; pass --skip-parity "
                               f"to convert without it")
    return entry


def get_post_check(name: str) -> Callable[[Path], dict]:
    """The post-check named `name` ("<family>" or "<family>.<component>"); raises MissingPostCheck (with the fix in
    the message) when no parity entry declares it."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    family, dot, _ = name.partition(".")
    entry = _parity_entry(family, name)
    if dot:
        fn = dict(getattr(entry, "component_post_checks", {}) or {}).get(name)
        where = f"component_post_checks[{name!r}]"
    else:
        fn = getattr(entry, "check_converted", None)
        where = "check_converted"
    if fn is None:
        raise MissingPostCheck(f"no parity post-check {name!r}: {PARITY_FAMILIES}.{family}.FAMILY declares no "
                               f"{where} (a C0 run on the converted weights); pass --skip-parity to convert without "
                               f"it")
    if not callable(fn):
        raise ConversionError(f"parity post-check {name!r}: {PARITY_FAMILIES}.{family}.FAMILY.{where} is a "
                              f"{type(fn).__name__}, not a callable")
    return fn
