"""Every model family the optimized side serves, found by walking `optimized.models`: each subpackage exports one
`FAMILY` (`optimized.runtime.family.FamilyEntry`). Adding a family is adding a folder; nothing is registered by hand."""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

import optimized.models
from manifests.layouts import VARIANT_SEP, LayoutError
from manifests.layouts import split_variant as _split
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


def split_variant(variant: str, family_name: str | None = None) -> tuple[str | None, str]:
    """'wan:tiny-2.1-t2v' -> ('wan', 'tiny-2.1-t2v'); a bare name -> (family_name, name). Variants are per family:
    a qualifier naming another family than `family_name` is an UnknownFamily."""
    try:
        return _split(variant, family_name)
    except LayoutError as e:
        raise UnknownFamily(str(e)) from None


def family_of_variant(variant: str, family_name: str | None = None) -> FamilyEntry:
    """The family of `variant`: qualified ('wan:tiny-2.1-t2v') or picked by `family_name`, else the one family whose
    variants include the bare name (several: an error naming each qualified name)."""
    qual, bare = split_variant(variant, family_name)
    if qual is not None:
        entry = family(qual)
        if bare not in entry.list_variants():
            raise UnknownFamily(f"family {qual!r} has no variant {bare!r}; its variants: "
                                f"{', '.join(entry.list_variants())}")
        return entry
    owners = [f for f in families().values() if bare in f.list_variants()]
    if not owners:
        listing = "; ".join(f"{f.name}: {', '.join(f.list_variants())}" for f in families().values())
        raise UnknownFamily(f"no family has a variant {bare!r} (variants by family: {listing})")
    if len(owners) > 1:
        raise UnknownFamily(f"variant {bare!r} is ambiguous: families {', '.join(f.name for f in owners)} all have "
                            f"it; name one: {', '.join(f'{f.name}{VARIANT_SEP}{bare}' for f in owners)} "
                            f"(or pass family=<one of them>)")
    return owners[0]


def family_of_config(cfg: object) -> FamilyEntry:
    owners = [f for f in families().values() if isinstance(cfg, f.config_class)]
    if len(owners) != 1:
        raise UnknownFamily(f"{len(owners)} families take a {type(cfg).__name__} config "
                            f"(known: {', '.join(f'{f.name}={f.config_class.__name__}' for f in families().values())})")
    return owners[0]
