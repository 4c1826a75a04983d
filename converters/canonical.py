"""Read a canonical checkpoint directory back, strictly: config.json + model.safetensors (or shards)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from converters.engine import CONFIG_NAME, MANIFEST_NAME, normalize_dtype
from converters.errors import ConversionError, name_some
from converters.families import family_names, get_family
from converters.readers import SafetensorsReader, torch_dtype
from converters.writer import INDEX_NAME, SINGLE_NAME
from manifests.errors import ManifestError

DEFAULT_FAMILY = "cosmos3"


def canonical_family(path: str | Path) -> str:
    """The family recorded in a canonical dir's manifest.json (cosmos3 when there is none)."""
    m = Path(path) / MANIFEST_NAME
    if not m.is_file():
        return DEFAULT_FAMILY
    try:
        fam = json.loads(m.read_text()).get("family")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ConversionError(f"{m}: unreadable manifest ({e})") from None
    if fam not in family_names():
        raise ConversionError(f"{m}: unknown family {fam!r}")
    return fam


def load_canonical(path: str | Path, *, family: str | None = None, dtype: str | torch.dtype | None = None,
                   check_finite: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, {canonical key: tensor}) from a canonical checkpoint directory.

    Strict: the key set must equal the family's canonical key set for that config, shapes must match,
    tensors must be floating point. `dtype` casts every tensor except the family's fp32 keys.
    """
    root = Path(path)
    if not root.is_dir():
        raise ConversionError(f"{root}: not a canonical checkpoint directory")
    fam = get_family(family or canonical_family(root))
    cpath = root / CONFIG_NAME
    try:
        raw = json.loads(cpath.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{cpath}: config file not found") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{cpath}: unreadable config ({e})") from None
    if not isinstance(raw, dict):
        raise ConversionError(f"{cpath}: expected a JSON object")
    try:
        cfg = fam.config_from_dict(raw)
    except ManifestError as e:
        raise ConversionError(f"{cpath}: {e}") from None

    single, index = root / SINGLE_NAME, root / INDEX_NAME
    if single.is_file() and index.is_file():
        raise ConversionError(f"{root}: both {SINGLE_NAME} and {INDEX_NAME} are present; ambiguous")
    if not single.is_file() and not index.is_file():
        raise ConversionError(f"{root}: no {SINGLE_NAME} or {INDEX_NAME}")
    want = fam.key_shapes(cfg)
    fp32 = set(fam.fp32_keys(cfg))
    cast = torch_dtype(normalize_dtype(dtype)) if dtype is not None else None
    with SafetensorsReader(index if index.is_file() else single) as reader:
        infos = reader.infos()
        extra = [k for k in infos if k not in want]
        if extra:
            raise ConversionError(f"{infos[extra[0]].file}: unexpected key {extra[0]!r} for this {fam.name} config "
                                  f"({len(extra)} unexpected: {name_some(extra)})")
        missing = [k for k in want if k not in infos]
        if missing:
            raise ConversionError(f"{reader.path}: missing canonical key {missing[0]!r} "
                                  f"({len(missing)} missing: {name_some(missing)})")
        sd: dict[str, torch.Tensor] = {}
        for k, shape in want.items():
            inf = infos[k]
            if tuple(inf.shape) != tuple(shape):
                raise ConversionError(f"{inf.file}: key {k!r} has shape {list(inf.shape)}, the config needs {list(shape)}")
            x = reader.get(k)
            if not x.is_floating_point():
                raise ConversionError(f"{inf.file}: key {k!r} has non-floating dtype {x.dtype}")
            if check_finite and not bool(torch.isfinite(x).all()):
                raise ConversionError(f"{inf.file}: key {k!r} holds NaN/Inf values")
            if cast is not None and k not in fp32:
                x = x.to(cast)
            sd[k] = x
    return cfg, sd
