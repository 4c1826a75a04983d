"""The model plane, minimal but real: ModelSpec / ComponentSpec / CacheContract / LoadTransform.

A ComponentSpec declares the canonical checkpoint keys (and shapes) a component consumes and the
load-time transforms that turn them into runtime tensors. `apply_load_transforms` applies exactly
those transforms and nothing else, after validating the canonical state dict strictly: every
canonical key must be consumed by exactly one transform, so an undeclared rewrite cannot happen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from optimized.runtime.cache import CacheKey

LOAD_OPS = ("fuse_rows", "cast", "drop")


class SpecError(ValueError):
    """A ModelSpec / ComponentSpec / CacheContract that fails validation."""


class CheckpointError(ValueError):
    """A canonical state dict that does not match its ComponentSpec. `.keys` names the offending keys."""

    def __init__(self, message: str, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = keys


class MissingKeyError(CheckpointError):
    pass


class UnexpectedKeyError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SpecError(f"unknown dtype name {name!r}")
    return dt


@dataclass(frozen=True)
class LoadTransform:
    """One declared load-time rewrite.

    op="fuse_rows": concatenate `sources` along dim 0 (in order) into `target`.
    op="cast":      exactly one source, renamed to `target`.
    op="drop":      exactly one source, checked and not loaded (a stored weight the component never reads, e.g.
                    the CLIP layer after the one the pipeline takes); `target` names why, as "<dropped>:<key>".
    dtype: None = the run dtype; a torch dtype name (e.g. "float32") pins it whatever the run dtype.
    """

    name: str
    sources: tuple[str, ...]
    target: str
    op: str
    dtype: str | None = None

    def validate(self) -> "LoadTransform":
        if self.op not in LOAD_OPS:
            raise SpecError(f"transform {self.name!r}: op must be one of {LOAD_OPS}, got {self.op!r}")
        if not self.sources or not self.target:
            raise SpecError(f"transform {self.name!r}: needs sources and a target")
        if self.op in ("cast", "drop") and len(self.sources) != 1:
            raise SpecError(f"transform {self.name!r}: {self.op} takes exactly one source, got {len(self.sources)}")
        if self.op == "fuse_rows" and len(self.sources) < 2:
            raise SpecError(f"transform {self.name!r}: fuse_rows needs >= 2 sources")
        if len(set(self.sources)) != len(self.sources):
            raise SpecError(f"transform {self.name!r}: duplicate sources {self.sources}")
        _dtype(self.dtype)
        return self


@dataclass(frozen=True)
class CacheContract:
    """What a cache holds and which CacheKey fields / events invalidate it."""

    cache_id: str
    component_id: str
    key_fields: tuple[str, ...]
    invalidated_by: tuple[str, ...]
    version: str = "1"
    description: str = ""

    def validate(self) -> "CacheContract":
        if not self.cache_id or not self.component_id:
            raise SpecError("CacheContract needs a cache_id and a component_id")
        unknown = sorted(set(self.key_fields) - set(CacheKey.field_names()))
        if unknown:
            raise SpecError(f"cache {self.cache_id!r}: key_fields {unknown} are not CacheKey fields")
        if not self.invalidated_by:
            raise SpecError(f"cache {self.cache_id!r}: declare what invalidates it")
        return self


@dataclass(frozen=True)
class ComponentSpec:
    component_id: str
    kind: str
    key_shapes: tuple[tuple[str, tuple[int, ...]], ...]   # canonical keys consumed, with shapes
    transforms: tuple[LoadTransform, ...]

    @property
    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.key_shapes)

    def target_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self.canonical_shapes
        out: dict[str, tuple[int, ...]] = {}
        for t in self.transforms:
            if t.op == "drop":
                continue
            src = [shapes[s] for s in t.sources]
            out[t.target] = src[0] if t.op == "cast" else (sum(s[0] for s in src), *src[0][1:])
        return out

    def validate(self) -> "ComponentSpec":
        if not self.component_id or not self.kind:
            raise SpecError("ComponentSpec needs a component_id and a kind")
        shapes = self.canonical_shapes
        if len(shapes) != len(self.key_shapes):
            raise SpecError(f"component {self.component_id!r}: duplicate canonical keys")
        consumed: dict[str, str] = {}
        targets: set[str] = set()
        for t in self.transforms:
            t.validate()
            if t.target in targets:
                raise SpecError(f"component {self.component_id!r}: two transforms write {t.target!r}")
            targets.add(t.target)
            for s in t.sources:
                if s not in shapes:
                    raise SpecError(f"transform {t.name!r} reads {s!r}, which is not a canonical key of "
                                    f"{self.component_id!r}")
                if s in consumed:
                    raise SpecError(f"canonical key {s!r} consumed by both {consumed[s]!r} and {t.name!r}")
                consumed[s] = t.name
            if t.op == "fuse_rows":
                tails = {shapes[s][1:] for s in t.sources}
                if len(tails) != 1:
                    raise SpecError(f"transform {t.name!r}: sources differ beyond dim 0: "
                                    f"{[shapes[s] for s in t.sources]}")
        unused = sorted(set(shapes) - set(consumed))
        if unused:
            raise SpecError(f"component {self.component_id!r}: canonical keys with no transform: {unused[:8]}")
        return self


@dataclass(frozen=True)
class ModelSpec:
    model_id: str
    family: str
    components: tuple[ComponentSpec, ...]
    caches: tuple[CacheContract, ...] = ()

    def component(self, component_id: str) -> ComponentSpec:
        for c in self.components:
            if c.component_id == component_id:
                return c
        raise SpecError(f"model {self.model_id!r} has no component {component_id!r}; "
                        f"known: {[c.component_id for c in self.components]}")

    def validate(self) -> "ModelSpec":
        if not self.model_id or not self.family:
            raise SpecError("ModelSpec needs a model_id and a family")
        ids = [c.component_id for c in self.components]
        if len(set(ids)) != len(ids):
            raise SpecError(f"model {self.model_id!r}: duplicate component ids {ids}")
        for c in self.components:
            c.validate()
        cache_ids = [c.cache_id for c in self.caches]
        if len(set(cache_ids)) != len(cache_ids):
            raise SpecError(f"model {self.model_id!r}: duplicate cache ids {cache_ids}")
        for cc in self.caches:
            cc.validate()
            if cc.component_id not in ids:
                raise SpecError(f"cache {cc.cache_id!r} refers to unknown component {cc.component_id!r}")
        return self


def check_state_dict(component: ComponentSpec, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Strict validation: missing, unexpected, non-tensor or mis-shaped keys raise, naming the keys."""
    shapes = component.canonical_shapes
    missing = sorted(set(shapes) - set(state_dict))
    if missing:
        raise MissingKeyError(f"{component.component_id}: missing canonical key(s) {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)", tuple(missing))
    unexpected = sorted(set(state_dict) - set(shapes))
    if unexpected:
        raise UnexpectedKeyError(f"{component.component_id}: unexpected key(s) {unexpected[:8]}"
                                 f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all)",
                                 tuple(unexpected))
    for k, shape in shapes.items():
        v = state_dict[k]
        if not isinstance(v, torch.Tensor):
            raise ShapeMismatchError(f"{component.component_id}: key {k!r} is a {type(v).__name__}, "
                                     f"not a tensor", (k,))
        if tuple(v.shape) != tuple(shape):
            raise ShapeMismatchError(f"{component.component_id}: key {k!r} has shape {list(v.shape)}, "
                                     f"expected {list(shape)}", (k,))
        if not v.is_floating_point():
            raise ShapeMismatchError(f"{component.component_id}: key {k!r} has dtype {v.dtype}, "
                                     f"expected a floating dtype", (k,))


def apply_load_transforms(component: ComponentSpec, state_dict: Mapping[str, torch.Tensor], *,
                          dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Validate `state_dict` against `component` and apply exactly its declared transforms."""
    component.validate()
    check_state_dict(component, state_dict)
    out: dict[str, torch.Tensor] = {}
    for t in component.transforms:
        target_dtype = _dtype(t.dtype) or dtype
        if t.op == "drop":
            continue
        if t.op == "cast":
            src = state_dict[t.sources[0]]
            x = src.to(device=device, dtype=target_dtype).contiguous()
            out[t.target] = x.clone() if x.data_ptr() == src.data_ptr() else x  # never alias the caller's dict
        else:  # fuse_rows
            out[t.target] = torch.cat([state_dict[s].to(device=device, dtype=target_dtype) for s in t.sources], 0)
    return out
