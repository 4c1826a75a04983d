"""Parity post-check hooks: how a C0 run on freshly converted weights gets wired into `fvconvert`.

converters/ must not import parity/, so the harness plugs itself in, either in-process:

    from converters.hooks import register_post_check
    register_post_check("cosmos3", my_check)      # my_check(tmp_out_dir: Path) -> {"status": "pass"|"fail", ...}

or, without any import from the CLI side, through an entry point in pyproject.toml:

    [project.entry-points."fvconvert.post_check"]
    cosmos3 = "parity.some_module:check_converted_cosmos3"
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Callable

from converters.errors import ConversionError

ENTRY_POINT_GROUP = "fvconvert.post_check"
_REGISTRY: dict[str, Callable[[Path], dict]] = {}


def register_post_check(family: str, fn: Callable[[Path], dict] | None) -> None:
    """Register (or with None, remove) the post-check `fvconvert FAMILY` runs unless --skip-parity. The name
    looked up is the manifest's `parity.post_check`, which defaults to the family name."""
    if fn is None:
        _REGISTRY.pop(family, None)
    else:
        _REGISTRY[family] = fn


def get_post_check(family: str) -> Callable[[Path], dict] | None:
    if family in _REGISTRY:
        return _REGISTRY[family]
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # pragma: no cover - broken environment metadata
        return None
    for ep in eps:
        if ep.name == family:
            try:
                return ep.load()
            except Exception as e:
                raise ConversionError(f"parity post-check entry point {ep.value!r} for {family} cannot be loaded "
                                      f"({type(e).__name__}: {e}); use --skip-parity to convert without it") from None
    return None
