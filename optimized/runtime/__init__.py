"""Model-agnostic v2 runtime pieces: the model plane (specs, load transforms) and caches."""

from optimized.runtime.cache import CacheEvent, CacheKey, CacheStats, CacheStore, content_hash, state_dict_hash
from optimized.runtime.spec import (
    CacheContract,
    CheckpointError,
    ComponentSpec,
    LoadTransform,
    MissingKeyError,
    ModelSpec,
    ShapeMismatchError,
    SpecError,
    UnexpectedKeyError,
    apply_load_transforms,
)

__all__ = [
    "CacheContract", "CacheEvent", "CacheKey", "CacheStats", "CacheStore", "CheckpointError", "ComponentSpec",
    "LoadTransform", "MissingKeyError", "ModelSpec", "ShapeMismatchError", "SpecError", "UnexpectedKeyError",
    "apply_load_transforms", "content_hash", "state_dict_hash",
]
