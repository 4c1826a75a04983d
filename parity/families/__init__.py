"""Registry of families: each module exposes LEVELS {level: runner}, variants(), DEFAULT_VARIANTS, FAULTS."""

from __future__ import annotations

from types import ModuleType

from parity.errors import SetupError
from parity import vae_checks
from parity.families import cosmos3, seedvr2, wan

FAMILIES: dict[str, ModuleType] = {"cosmos3": cosmos3, "wan": wan, "cosmos3-sound": vae_checks, "seedvr2": seedvr2}


def get_family(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise SetupError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]
