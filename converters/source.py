"""Where a conversion reads from: the source weights and config resolved against a CheckpointManifest, and the
family config built from them (a full config, a partial one completed from --variant, or the variant itself).
Part of the conversion engine (converters/engine.py re-exports these names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converters.errors import ConversionError
from converters.families import Family, get_family
from converters.manifest import CheckpointManifest, load_manifest
from converters.readers import weight_kind_of
from manifests.errors import ManifestError
from manifests.layouts import bare_variant


@dataclass(frozen=True)
class ResolvedSource:
    src: Path
    config_path: Path | None
    weights_kind: str
    weights_path: Path
    expected: tuple[tuple[Path, Any], ...] = ()   # (path, ExpectedFile) present in SRC
    weights_sha256: str | None = None


def _manifest_of(family: str, fmt: str | CheckpointManifest) -> CheckpointManifest:
    if isinstance(fmt, CheckpointManifest):
        from converters.manifest import check_against_family
        return check_against_family(fmt, get_family(family, fmt.component))
    return load_manifest(family, fmt)


def resolve_source(manifest: CheckpointManifest, src: str | Path, config: str | Path | None = None,
                   variant: str | None = None) -> ResolvedSource:
    """SRC is a directory holding one of the manifest's weight layouts (+ its config, unless the format has
    none), or a weights file (`.safetensors`, `*.safetensors.index.json`, `.pt/.pth/.bin`) with the config
    beside it or given explicitly. Without a config file, `variant` names the architecture."""
    src = Path(src)
    if not src.exists():
        raise ConversionError(f"{src}: source not found")
    wsha = None
    expected: list = []
    if src.is_dir():
        present = [w for w in manifest.weight_files if (src / w.path).is_file()]
        if not present:
            hint = ""
            if (src / "model_index.json").is_file() and (src / "transformer").is_dir():
                hint = f"; this looks like a diffusers pipeline folder, pass {src / 'transformer'}"
            elif (src / "model.safetensors").is_file() or (src / "model.safetensors.index.json").is_file():
                hint = "; model.safetensors suggests a canonical (already converted) or other-format checkpoint"
            hint += " (`fvconvert inspect SRC` guesses the format)"
            found = sorted(p.name for p in src.iterdir())[:8]
            raise ConversionError(
                f"{src}: no {manifest.id} weights found; expected one of "
                f"{', '.join(w.path for w in manifest.weight_files)} (found: {', '.join(found) or 'nothing'}){hint}")
        if len(present) > 1:
            raise ConversionError(f"{src}: ambiguous weights, both {present[0].path} and {present[1].path} are present; "
                                  f"pass the weights file itself as SRC")
        spec = present[0]
        kind, wpath, wsha = spec.kind, src / spec.path, spec.sha256
        cname = spec.config or manifest.config_file
        cpath = Path(config) if config is not None else (src / cname if cname else None)
        for e in manifest.expected_files:
            p = src / e.path
            if not p.is_file():
                if e.required:
                    raise ConversionError(f"{p}: file expected by manifest {manifest.id} is missing")
                continue
            if e.bytes is not None and p.stat().st_size != e.bytes:
                raise ConversionError(f"{p}: size {p.stat().st_size} bytes, manifest {manifest.id} expects {e.bytes}")
            expected.append((p, e))
    else:
        kind = weight_kind_of(src)
        if kind is None:
            raise ConversionError(f"{src}: unknown checkpoint file type; expected .safetensors, "
                                  f"*.safetensors.index.json, .pt, .pth or .bin (or a directory)")
        wpath = src
        for w in manifest.weight_files:
            if w.path.split("/")[-1] == src.name and w.sha256:
                wsha = w.sha256
        cname = manifest.config_file
        cpath = Path(config) if config is not None else (src.parent / cname if cname else None)
    if cpath is not None and not cpath.is_file():
        if config is None and variant is not None:
            cpath = None          # no config beside the weights: the named variant gives the architecture
        else:
            raise ConversionError(f"{cpath}: config file not found (the {manifest.id} format needs "
                                  f"{cpath.name}; give one with --config, or name the architecture with --variant)")
    if cpath is None and variant is None:
        raise ConversionError(f"{src}: the {manifest.id} format carries no config file the converter can read; give "
                              f"the architecture with --variant NAME (e.g. nano) or --config PATH (a diffusers "
                              f"transformer config.json)")
    return ResolvedSource(src=src, config_path=cpath, weights_kind=kind, weights_path=wpath,
                          expected=tuple(expected), weights_sha256=wsha)


def _bare_variant(family_name: str, variant: str | None) -> str | None:
    """'wan:tiny-2.1' -> 'tiny-2.1' (variants are per family; another family's qualified name is an error)."""
    try:
        return None if variant is None else bare_variant(family_name, variant)
    except ManifestError as e:
        raise ConversionError(str(e)) from None


def _load_variant(family: Family, variant: str) -> Any:
    try:
        return family.load_variant(variant)
    except ManifestError as e:
        raise ConversionError(str(e)) from None


def read_source_config(family: Family, manifest: CheckpointManifest, path: Path | None,
                       variant: str | None = None) -> tuple[Any, dict]:
    """(config, how it was obtained). A mapping that determines only some fields (a reasoner config) is
    completed from `variant` (its determined fields must agree with it), else from the family defaults."""
    if path is None:
        cfg = _load_variant(family, variant)
        return cfg, {"kind": "variant", "variant": variant, "undetermined_fields": []}
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    want = manifest.upstream_class_name
    got = raw.get("_class_name")
    if want and got is not None and got != want:
        raise ConversionError(f"{path}: _class_name is {got!r}, but the {manifest.id} format expects {want!r}")
    types = manifest.upstream.get("model_types")
    if want and got is None and raw.get("model_type") is not None and not types:
        raise ConversionError(f"{path}: a transformers config (model_type {raw['model_type']!r}), not the "
                              f"{want} config the {manifest.id} format expects (a reasoner checkpoint converts "
                              f"with --from transformers)")
    if types and raw.get("model_type") not in types:
        raise ConversionError(f"{path}: model_type is {raw.get('model_type')!r}, but the {manifest.id} format "
                              f"expects one of {types}")
    try:
        mapped = family.config_mappings[manifest.config_mapping](raw)
    except ManifestError as e:
        raise ConversionError(f"{path}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ConversionError(f"{path}: cannot map onto a {family.name} config ({type(e).__name__}: {e})") from None
    if not isinstance(mapped, dict):
        return mapped, {"kind": "file", "path": str(path.resolve()), "undetermined_fields": []}
    # a partial config: complete it
    base: dict = {}
    if variant is not None:
        vd = family.config_to_dict(_load_variant(family, variant))
        diffs = [f"{k}={_jsonish(mapped[k])!r} (variant: {vd.get(k)!r})" for k in mapped
                 if _jsonish(mapped[k]) != vd.get(k)]
        if diffs:
            raise ConversionError(f"{path}: the source config is not variant {variant!r}: " + "; ".join(diffs[:6])
                                  + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else ""))
        base = vd
    try:
        cfg = family.config_from_dict({**base, **{k: _jsonish(v) for k, v in mapped.items()}})
    except ManifestError as e:
        raise ConversionError(f"{path}: {e}") from None
    undetermined = [k for k in family.config_to_dict(cfg) if k not in mapped]
    src = {"kind": "file", "path": str(path.resolve()), "undetermined_fields": undetermined}
    if variant is not None:
        src["completed_from_variant"] = variant
    return cfg, src


def _jsonish(v):
    return list(v) if isinstance(v, tuple) else v
