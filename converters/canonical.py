"""Read a canonical checkpoint directory back: a thin wrapper over manifests/checkpoint.py (the one reader that
reference/, optimized/ and parity/ use) that returns the typed config and raises ConversionError.

A checkpoint converted from a format that fills only some canonical parts (e.g. the transformers reasoner
release: the `und` part) is *partial*: its manifest.json says which parts it holds. Loading the full model
from it is refused; `load_canonical(path, parts=["und"])` loads the parts it does hold. A whole-model
directory (model_index.json, e.g. a converted wan pipeline) loads one component at a time: `component=`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch

from converters.engine import normalize_dtype
from converters.errors import ConversionError
from converters.readers import torch_dtype
from manifests.checkpoint import CheckpointError, load_state, read_checkpoint

DEFAULT_FAMILY = "cosmos3"


def read_resolved_manifest(path: str | Path) -> dict | None:
    """The manifest.json a conversion wrote into a canonical dir (None if there is none)."""
    import json

    m = Path(path) / "manifest.json"
    if not m.is_file():
        return None
    try:
        data = json.loads(m.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{m}: unreadable manifest ({e})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{m}: expected a JSON object")
    return data


def canonical_family(path: str | Path) -> str:
    """The family recorded in a canonical dir (manifest.json or model_index.json; cosmos3 when there is none)."""
    try:
        return read_checkpoint(path).family
    except CheckpointError as e:
        raise ConversionError(str(e)) from None


def canonical_parts(path: str | Path, family=None, cfg=None, component: str | None = None) -> dict:
    """{"filled": [...], "unfilled": [...], "complete": bool} of a canonical dir (or one component of a model dir)."""
    try:
        comp = read_checkpoint(path).component(component)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    return {"filled": list(comp.parts_filled), "unfilled": list(comp.parts_unfilled), "complete": not comp.partial}


def load_canonical(path: str | Path, *, family: str | None = None, dtype: str | torch.dtype | None = None,
                   check_finite: bool = False, parts: Iterable[str] | None = None,
                   component: str | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, {canonical key: tensor}) from a canonical checkpoint directory (`component` of a model dir).

    Strict: the key set must equal the family's canonical key set for that config (or, with `parts`, the
    keys of those parts; a partial checkpoint loads only with `parts` it holds), shapes must match, tensors
    must be floating point. `dtype` casts every tensor except the family's fp32 keys.
    """
    cast = torch_dtype(normalize_dtype(dtype)) if dtype is not None else None
    try:
        ckpt = read_checkpoint(path, family=family)
        comp = ckpt.component(component)
        cfg = comp.typed_config()
        return cfg, load_state(ckpt, component=comp.name, parts=parts, dtype=cast, check_finite=check_finite)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
