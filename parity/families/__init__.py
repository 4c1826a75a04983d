"""The family registry: every module or package directly under parity/families/ exports one `FAMILY`
(a `parity.family.ParityFamily`); nothing here names a family. Discovery is lazy (on first use), so a family
module may import another family's module without going through this registry."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from parity.errors import SetupError
from parity.family import FamilyError, GoldenProbe, ParityFamily, PostCheck

_CACHE: dict[str, ParityFamily] | None = None


def discover(package: ModuleType | None = None) -> dict[str, ParityFamily]:
    """{family name: entry} from every public module of `package` (default: this one), validated. Raises
    FamilyError for a module without a FAMILY, a FAMILY of the wrong type, an invalid entry, duplicate family
    names or a golden probe name claimed by two families."""
    package = package or importlib.import_module(__name__)
    found: dict[str, ParityFamily] = {}
    probes: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        fam = getattr(module, "FAMILY", None)
        if not isinstance(fam, ParityFamily):
            raise FamilyError(f"{module.__name__} is a parity family module but exports no FAMILY = ParityFamily(...)"
                              if fam is None else f"{module.__name__}.FAMILY is a {type(fam).__name__}, "
                                                  f"not a ParityFamily")
        fam.validate()
        if (fam.check_converted is not None or fam.component_post_checks) and info.name != fam.name:
            # fvconvert looks a post-check up as parity.families.<family> (converters/hooks.py)
            raise FamilyError(f"{module.__name__}: family {fam.name!r} declares fvconvert post-checks, so its module "
                              f"must be named {fam.name!r} (fvconvert finds it as {package.__name__}.{fam.name})")
        if fam.name in found:
            raise FamilyError(f"family name {fam.name!r} is exported twice (second: {module.__name__})")
        for probe in fam.golden_probes:
            if probe in probes:
                raise FamilyError(f"golden probe {probe!r} is claimed by {probes[probe]} and {fam.name}")
            probes[probe] = fam.name
        found[fam.name] = fam
    return found


def families() -> dict[str, ParityFamily]:
    global _CACHE
    if _CACHE is None:
        _CACHE = discover()
    return _CACHE


def get_family(name: str) -> ParityFamily:
    known = families()
    if name not in known:
        raise SetupError(f"unknown family {name!r}; known: {', '.join(known)}")
    return known[name]


def golden_probes() -> dict[str, GoldenProbe]:
    """The golden probe table (case.json "probe" -> probe), derived from the entries."""
    return {probe: fn for fam in families().values() for probe, fn in fam.golden_probes.items()}


def post_checks() -> dict[str, PostCheck]:
    """Every fvconvert post-check the entries declare: "<family>" (check_converted) and "<family>.<component>"
    (component_post_checks) -> check. fvconvert finds each at run time in `parity.families.<family>`.FAMILY
    (converters/hooks.py), so a family's folder is all it takes: no entry point, no reinstall."""
    out: dict[str, PostCheck] = {}
    for name, fam in families().items():
        if fam.check_converted is not None:
            out[name] = fam.check_converted
        out.update(fam.component_post_checks)  # one per component a family's manifests name
    return out


def __getattr__(name: str):
    if name == "FAMILIES":  # the registry as a mapping (older callers)
        return families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
