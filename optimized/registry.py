"""Every model family the optimized side serves, found by walking `optimized.models`: each subpackage exports one
`FAMILY` (`optimized.runtime.family.FamilyEntry`). Adding a family is adding a folder; nothing is registered by hand."""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

import optimized.models
from optimized.runtime.family import FamilyEntry


class UnknownFamily(LookupError):
    """No family (or no unique family) matches; the message lists what exists."""


@lru_cache(maxsize=None)
def families() -> dict[str, FamilyEntry]:
    found: dict[str, FamilyEntry] = {}
    for info in sorted(pkgutil.iter_modules(optimized.models.__path__), key=lambda i: i.name):
        if not info.ispkg:
            continue
        module = importlib.import_module(f"{optimized.models.__name__}.{info.name}")
        entry = getattr(module, "FAMILY", None)
        if not isinstance(entry, FamilyEntry):
            raise TypeError(f"{module.__name__} must export FAMILY = FamilyEntry(...), found {type(entry).__name__}")
        if entry.name != info.name:
            raise TypeError(f"{module.__name__}.FAMILY is named {entry.name!r}; a family is named after its folder")
        found[entry.name] = entry.validate()
    return found


def family(name: str) -> FamilyEntry:
    fams = families()
    if name not in fams:
        raise UnknownFamily(f"unknown family {name!r}; known: {', '.join(sorted(fams))}")
    return fams[name]


def family_of_variant(variant: str, family_name: str | None = None) -> FamilyEntry:
    """The one family whose variants include `variant` (`family_name` picks among several)."""
    if family_name is not None:
        entry = family(family_name)
        if variant not in entry.list_variants():
            raise UnknownFamily(f"family {family_name!r} has no variant {variant!r}; its variants: "
                                f"{', '.join(entry.list_variants())}")
        return entry
    owners = [f for f in families().values() if variant in f.list_variants()]
    if not owners:
        listing = "; ".join(f"{f.name}: {', '.join(f.list_variants())}" for f in families().values())
        raise UnknownFamily(f"no family has a variant {variant!r} (variants by family: {listing})")
    if len(owners) > 1:
        raise UnknownFamily(f"variant {variant!r} is ambiguous: families {', '.join(f.name for f in owners)} all have "
                            f"it; pass family=<one of them>")
    return owners[0]


def family_of_config(cfg: object) -> FamilyEntry:
    owners = [f for f in families().values() if isinstance(cfg, f.config_class)]
    if len(owners) != 1:
        raise UnknownFamily(f"{len(owners)} families take a {type(cfg).__name__} config "
                            f"(known: {', '.join(f'{f.name}={f.config_class.__name__}' for f in families().values())})")
    return owners[0]
