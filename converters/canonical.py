"""Read a canonical checkpoint directory back, strictly: config.json + model.safetensors (or shards).

A checkpoint converted from a format that fills only some canonical parts (e.g. the transformers reasoner
release: the `und` part) is *partial*: its manifest.json says which parts it holds. Loading the full model
from it is refused; `load_canonical(path, parts=["und"])` loads the parts it does hold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch

from converters.engine import CONFIG_NAME, MANIFEST_NAME, normalize_dtype
from converters.errors import ConversionError, name_some
from converters.families import family_names, get_family
from converters.readers import SafetensorsReader, torch_dtype
from converters.writer import INDEX_NAME, SINGLE_NAME
from manifests.errors import ManifestError

DEFAULT_FAMILY = "cosmos3"


def read_resolved_manifest(path: str | Path) -> dict | None:
    """The manifest.json a conversion wrote into a canonical dir (None if there is none)."""
    m = Path(path) / MANIFEST_NAME
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
    """The family recorded in a canonical dir's manifest.json (cosmos3 when there is none)."""
    data = read_resolved_manifest(path)
    if data is None:
        return DEFAULT_FAMILY
    fam = data.get("family")
    if fam not in family_names():
        raise ConversionError(f"{Path(path) / MANIFEST_NAME}: unknown family {fam!r}")
    return fam


def canonical_parts(path: str | Path, family=None, cfg=None) -> dict:
    """{"filled": [...], "unfilled": [...], "complete": bool} of a canonical dir (complete without a record)."""
    data = read_resolved_manifest(path)
    parts = (data or {}).get("parts")
    if parts is None:
        names = list(family.part_keys(cfg)) if family is not None and cfg is not None else []
        return {"filled": names, "unfilled": [], "complete": True}
    if not isinstance(parts, dict) or not isinstance(parts.get("filled"), list) or not isinstance(parts.get("unfilled"), list):
        raise ConversionError(f"{Path(path) / MANIFEST_NAME}: 'parts' must hold 'filled' and 'unfilled' lists")
    return {"filled": list(parts["filled"]), "unfilled": list(parts["unfilled"]), "complete": not parts["unfilled"]}


def load_canonical(path: str | Path, *, family: str | None = None, dtype: str | torch.dtype | None = None,
                   check_finite: bool = False, parts: Iterable[str] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, {canonical key: tensor}) from a canonical checkpoint directory.

    Strict: the key set must equal the family's canonical key set for that config (or, with `parts`, the
    keys of those parts; a partial checkpoint loads only with `parts` it holds), shapes must match, tensors
    must be floating point. `dtype` casts every tensor except the family's fp32 keys.
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

    held = canonical_parts(root, fam, cfg)
    by_part = fam.part_keys(cfg)
    unknown = [p for p in held["filled"] + held["unfilled"] if p not in fam.part_names]
    if unknown:
        raise ConversionError(f"{root / MANIFEST_NAME}: unknown {fam.name} part(s) {unknown}; parts: {', '.join(fam.part_names)}")
    if parts is None:
        if not held["complete"]:
            fmt = (read_resolved_manifest(root) or {}).get("format", "?")
            raise ConversionError(
                f"{root}: partial canonical checkpoint: it holds part(s) {', '.join(held['filled'])} only (converted "
                f"from {fam.name}/{fmt}) and lacks {', '.join(held['unfilled'])}, which the full model (e.g. the "
                f"generator) needs; load what it holds with load_canonical(path, parts={held['filled']!r})")
        want_parts = list(by_part)
    else:
        want_parts = list(dict.fromkeys(parts))
        bad = [p for p in want_parts if p not in fam.part_names]
        if bad:
            raise ConversionError(f"unknown {fam.name} part(s) {bad}; parts: {', '.join(fam.part_names)}")
        lacking = [p for p in want_parts if p in by_part and p not in held["filled"]]
        if lacking:
            raise ConversionError(f"{root}: does not hold part(s) {', '.join(lacking)} "
                                  f"(it holds {', '.join(held['filled'])})")
    allowed = {k for p in held["filled"] for k in by_part.get(p, [])}
    want_keys = {k for p in want_parts for k in by_part.get(p, [])}

    single, index = root / SINGLE_NAME, root / INDEX_NAME
    if single.is_file() and index.is_file():
        raise ConversionError(f"{root}: both {SINGLE_NAME} and {INDEX_NAME} are present; ambiguous")
    if not single.is_file() and not index.is_file():
        raise ConversionError(f"{root}: no {SINGLE_NAME} or {INDEX_NAME}")
    shapes = fam.key_shapes(cfg)
    fp32 = set(fam.fp32_keys(cfg))
    cast = torch_dtype(normalize_dtype(dtype)) if dtype is not None else None
    with SafetensorsReader(index if index.is_file() else single) as reader:
        infos = reader.infos()
        extra = [k for k in infos if k not in allowed]
        if extra:
            what = "this" if held["complete"] else f"the parts ({', '.join(held['filled'])}) of this partial"
            raise ConversionError(f"{infos[extra[0]].file}: unexpected key {extra[0]!r} for {what} {fam.name} config "
                                  f"({len(extra)} unexpected: {name_some(extra)})")
        missing = [k for k in shapes if k in allowed and k not in infos]
        if missing:
            raise ConversionError(f"{reader.path}: missing canonical key {missing[0]!r} "
                                  f"({len(missing)} missing: {name_some(missing)})")
        sd: dict[str, torch.Tensor] = {}
        for k, shape in shapes.items():
            if k not in want_keys:
                continue
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
