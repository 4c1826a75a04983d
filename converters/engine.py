"""The conversion engine: upstream checkpoint + CheckpointManifest -> canonical checkpoint directory.

    convert("cosmos3", "diffusers", SRC, OUT)                  -> ConversionReport (writes OUT)
    convert_to_state_dict("cosmos3", "framework", SRC, variant="nano")  -> (config, {canonical key: tensor})
    convert_diffusers_dir_to_canonical_state_dict(SRC)         -> the same, for cosmos3/diffusers

A canonical checkpoint directory holds:
    model.safetensors                     (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
    config.json                           the family config (`Cosmos3Config.to_dict()`)
    manifest.json                         the resolved CheckpointManifest used (+ how it was applied, the
                                          canonical parts it holds: a format filling only some parts, e.g.
                                          the transformers reasoner, gives a *partial* checkpoint)
    conversion_report.json                what was renamed/split/fused/dropped, dtypes, shapes, parts, sidecars,
                                          sha256 of inputs and outputs, parity
    <sidecar>/model.safetensors           only with keep_sidecars: non-canonical tensors a manifest routes
                                          to a sidecar (e.g. the Qwen3-VL vision encoder), in source layout

Memory: tensors are read, transformed and written one canonical tensor at a time (a fuse holds its parts,
a split keeps its one source), so peak memory is about the largest tensor (twice it when casting), not the
checkpoint. Every refusal is a ConversionError naming the file and key. OUT is written in a temporary
directory beside it and put into place at the very end (converters/staging.py); a failed or interrupted run
leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from converters.errors import ConversionError, ParityCheckFailed, name_some
from converters.families import Family, get_family
from converters.manifest import CheckpointManifest, Rule, load_manifest
from converters.readers import (ST_TO_TORCH, TensorInfo, WeightReader, hash_files, open_weights, torch_dtype,
                                weight_kind_of)
from converters.staging import check_output, make_dir, staged_output, staging_name
from converters.writer import (INDEX_NAME, OutTensor, json_bytes, plan_shards, shard_names, write_bytes,
                               write_safetensors)
from manifests.checkpoint import weights_version_of
from manifests.layouts import bare_variant
from manifests.errors import ManifestError

ENGINE_VERSION = 2
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
REPORT_NAME = "conversion_report.json"
CONFIG_NAME = "config.json"
MANIFEST_NAME = "manifest.json"
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "f32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16"}
FINITE_CHUNK = 1 << 24           # elements per isfinite() pass: bounds the check's scratch memory
PLACEHOLDER_SEED = 0

PostCheck = Callable[[Path], dict]
Progress = Callable[[str], None]
ProgressUpdate = Callable[[dict], None]


def normalize_dtype(dtype: str | torch.dtype | None) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_ALIASES:
        raise ConversionError(f"unsupported output dtype {dtype!r}; use float32, bfloat16 or float16")
    return DTYPE_ALIASES[name]


# ---------------------------------------------------------------------------------------------
# source resolution + config


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


# ---------------------------------------------------------------------------------------------
# planning: every check that needs only headers happens here, before a byte is written


@dataclass(frozen=True)
class SourceRef:
    key: str                      # the key as stored in the source
    file: Path
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PlanEntry:
    target: str
    op: str                        # rename | transpose | reshape | split | fuse
    rule: str
    sources: tuple[SourceRef, ...]
    shape: tuple[int, ...]         # canonical (output) shape
    out_dtype: str
    part: str = ""
    dim: int | None = None
    dims: tuple[int, ...] | None = None
    offset: int | None = None      # split: start along dim

    @property
    def source_key(self) -> str:
        return self.sources[0].key

    @property
    def file(self) -> Path:
        return self.sources[0].file

    @property
    def src_dtype(self) -> str:
        return self.sources[0].dtype


@dataclass(frozen=True)
class SidecarEntry:
    sidecar: str
    key: str                       # key inside the sidecar
    source: SourceRef
    rule: str


@dataclass
class Plan:
    cfg: Any
    entries: list[PlanEntry]                       # canonical key order
    dropped: list[dict]
    truncated: dict | None
    num_source_keys: int
    sidecars: list[SidecarEntry] = field(default_factory=list)
    normalized: list[dict] = field(default_factory=list)
    parts: dict = field(default_factory=dict)      # {"filled": [...], "unfilled": [...], "complete": bool}


def _format_hint(family: Family, manifest: CheckpointManifest, keys: list[str]) -> str:
    """' (these keys look like format X: --from X)' when another manifest of the family matches them all."""
    best = None
    for fmt in family.formats():
        if fmt == manifest.format:
            continue
        try:
            other = load_manifest(family.name, fmt)
        except ConversionError:
            continue
        n = sum(other.match(k)[0] is not None for k in keys)
        if n == len(keys) and (best is None or n > best[1]):
            best = (fmt, n)
    return f"; these keys look like format {best[0]!r} (--from {best[0]})" if best else ""


def plan_conversion(family: Family, manifest: CheckpointManifest, cfg: Any, infos: dict[str, TensorInfo], *,
                    dtype: str | None = None, allow_truncate: bool = False, where: str | None = None) -> Plan:
    """Normalise every source key, map it through the manifest rules and check the result against the
    family's canonical key set for `cfg`, restricted to the parts the format fills (missing, unexpected,
    shapes, dtypes, conflicts, truncation). Headers only."""
    def src_of(key: str) -> SourceRef:
        inf = infos[key]
        return SourceRef(key, inf.file, inf.dtype, tuple(inf.shape))

    # 1. normalisation, collision-checked
    norm: dict[str, str] = {}              # normalised -> source key
    normalized: list[dict] = []
    for key, inf in infos.items():
        nk = manifest.normalize_key(key)
        if nk in norm:
            other = norm[nk]
            raise ConversionError(f"{inf.file}: keys {other!r} and {key!r} both normalise to {nk!r} "
                                  f"(two sources onto one key; manifest {manifest.id} normalize)")
        norm[nk] = key
        if nk != key:
            normalized.append({"from": key, "to": nk})

    # 2. rules
    producers: dict[str, tuple[str, Rule, dict]] = {}    # target -> (source key, rule, extra)
    fuse_groups: dict[str, tuple[Rule, dict[str, str]]] = {}
    sidecar_keys: dict[tuple[str, str], str] = {}
    sidecars: list[SidecarEntry] = []
    dropped: list[dict] = []
    unexpected: list[str] = []

    def claim(target: str, key: str) -> None:
        other = producers[target][0] if target in producers else None
        if other is None and target in fuse_groups:
            other = next(iter(fuse_groups[target][1].values()))
        if other is not None:
            raise ConversionError(f"{infos[key].file}: keys {other!r} and {key!r} both map to canonical key {target!r} "
                                  f"(two sources onto one target)")

    fields = family.config_to_dict(cfg)       # what `let` / `where` expressions of the rules may read
    for nk, key in norm.items():
        rule, targets = manifest.rule_for(nk, fields)
        if rule is None:
            unexpected.append(key)
        elif rule.op == "drop":
            dropped.append({"key": key, "file": str(infos[key].file), "reason": rule.reason,
                            **({"equals": rule.equals} if rule.equals else {})})
        elif rule.op == "sidecar":
            sk = (rule.sidecar, targets[0])
            if sk in sidecar_keys:
                raise ConversionError(f"{infos[key].file}: keys {sidecar_keys[sk]!r} and {key!r} both map to "
                                      f"{targets[0]!r} of sidecar {rule.sidecar!r} (two sources onto one target)")
            sidecar_keys[sk] = key
            sidecars.append(SidecarEntry(rule.sidecar, targets[0], src_of(key), rule.label))
        elif rule.op == "fuse":
            t = targets[0]
            part = rule.part_of(nk)
            if part not in rule.parts:
                raise ConversionError(f"{infos[key].file}: key {key!r} is part {part!r} of fuse target {t!r}, but rule "
                                      f"{rule.label!r} of manifest {manifest.id} fuses only parts {list(rule.parts)}")
            if t in producers:
                claim(t, key)
            grp = fuse_groups.setdefault(t, (rule, {}))
            if grp[0] is not rule:
                raise ConversionError(f"{infos[key].file}: key {key!r} maps to fuse target {t!r} through rule "
                                      f"{rule.label!r}, which another rule also fills (two sources onto one target)")
            if part in grp[1]:
                raise ConversionError(f"{infos[key].file}: keys {grp[1][part]!r} and {key!r} are both part {part!r} of "
                                      f"canonical key {t!r} (two sources onto one target)")
            grp[1][part] = key
        else:
            for i, t in enumerate(targets):
                claim(t, key)
                producers[t] = (key, rule, {"index": i, "targets": targets} if rule.op == "split" else {})
    if unexpected:
        k = unexpected[0]
        raise ConversionError(f"{infos[k].file}: unexpected key {k!r}: no rule of manifest {manifest.id} matches it"
                              + (f" ({len(unexpected)} unexpected keys: {name_some(unexpected)})" if len(unexpected) > 1 else "")
                              + _format_hint(family, manifest, unexpected))

    produced = set(producers) | set(fuse_groups)

    def first_source(t: str) -> str:
        return producers[t][0] if t in producers else next(iter(fuse_groups[t][1].values()))

    # 3. which canonical keys: the parts this format fills
    def expected_for(c) -> tuple[dict, dict]:
        parts = family.part_keys(c)
        fills = manifest.fills or tuple(parts)
        keep = {k for p, ks in parts.items() if p in fills for k in ks}
        shapes = {k: s for k, s in family.key_shapes(c).items() if k in keep}
        return shapes, {"filled": [p for p in parts if p in fills], "unfilled": [p for p in parts if p not in fills]}

    expected, parts = expected_for(cfg)
    all_canonical = family.key_shapes(cfg)
    not_canonical = [t for t in produced if t not in expected]
    if not_canonical:
        t = not_canonical[0]
        k = first_source(t)
        m = family.layer_key.match(t)
        if m and int(m.group(1)) >= family.num_layers(cfg):
            why = f"the config has only {family.num_layers(cfg)} layers"
        elif t in all_canonical:
            why = f"part {family.part_of(t)!r}, which format {manifest.id} does not fill"
        else:
            why = "the config in the source does not have this tensor"
        raise ConversionError(f"{infos[k].file}: unexpected key {k!r} (-> canonical {t!r}): {why}"
                              + (f" ({len(not_canonical)} such keys)" if len(not_canonical) > 1 else ""))

    truncated = None
    missing = [t for t in expected if t not in produced]
    if missing:
        n_cfg = family.num_layers(cfg)
        present_layers = sorted({int(m.group(1)) for t in produced if (m := family.layer_key.match(t))})
        n_have = 0
        while n_have in present_layers:
            n_have += 1
        complete_prefix = False
        cfg_t = exp_t = parts_t = None
        if 0 < n_have < n_cfg:
            try:
                cfg_t = family.with_num_layers(cfg, n_have)
            except ManifestError:
                cfg_t = None
            if cfg_t is not None:
                exp_t, parts_t = expected_for(cfg_t)
                complete_prefix = set(exp_t) == produced
        where = where or (str(next(iter(infos.values())).file) if infos else "source")
        if complete_prefix and allow_truncate:
            truncated = {"config_num_layers": n_cfg, "converted_num_layers": n_have, "absent_keys": len(missing)}
            cfg, expected, parts = cfg_t, exp_t, parts_t
        else:
            hint = ""
            if complete_prefix:
                hint = (f"; the checkpoint holds layers 0..{n_have - 1} of the {n_cfg} its config declares "
                        f"(pass --allow-truncate / allow_truncate=True to convert only those)")
            fuse_missing = [t for t in missing if t in fuse_groups]
            if fuse_missing:
                t = fuse_missing[0]
                rule, got = fuse_groups[t]
                raise ConversionError(f"{where}: canonical key {t!r} (fuse of {list(rule.parts)}) lacks part(s) "
                                      f"{[p for p in rule.parts if p not in got]}; present: {sorted(got.values())}")
            more = f" ({len(missing)} missing: {name_some(missing)})" if len(missing) > 1 else ""
            raise ConversionError(f"{where}: missing key: no source tensor maps to canonical {missing[0]!r}{more}{hint}")
    # a fuse group present but incomplete (and its target expected)
    for t, (rule, got) in fuse_groups.items():
        lack = [p for p in rule.parts if p not in got]
        if lack:
            k = next(iter(got.values()))
            raise ConversionError(f"{infos[k].file}: canonical key {t!r} (fuse of {list(rule.parts)}) lacks part(s) "
                                  f"{lack}; present: {sorted(got.values())}")

    # 4. shapes, dtypes, per canonical key
    allowed = set(manifest.dtype_policy.allowed_source_dtypes)
    fp32 = set(family.fp32_keys(cfg))

    def check_dtype(s: SourceRef) -> None:
        if s.dtype not in allowed:
            raise ConversionError(f"{s.file}: key {s.key!r} has dtype {s.dtype}; manifest {manifest.id} accepts "
                                  f"{', '.join(sorted(allowed))}")

    def bad_shape(s: SourceRef, t: str, detail: str) -> ConversionError:
        return ConversionError(f"{s.file}: key {s.key!r} (-> {t!r}) has shape {list(s.shape)}, {detail}")

    entries: list[PlanEntry] = []
    for t, want in expected.items():
        want = tuple(want)
        kw: dict[str, Any] = {}
        if t in fuse_groups:
            rule, got = fuse_groups[t]
            srcs = tuple(src_of(got[p]) for p in rule.parts)
            d = rule.dim
            for s in srcs:
                check_dtype(s)
                if len(s.shape) != len(want) or d >= len(want) or any(
                        a != b for i, (a, b) in enumerate(zip(s.shape, want)) if i != d):
                    raise bad_shape(s, t, f"which cannot be a dim-{d} part of the canonical {list(want)}")
            if sum(s.shape[d] for s in srcs) != want[d]:
                raise ConversionError(f"{srcs[0].file}: keys {[s.key for s in srcs]} (-> {t!r}) concatenate along dim {d} "
                                      f"to {sum(s.shape[d] for s in srcs)}, the config needs {want[d]}")
            if len({s.dtype for s in srcs}) > 1:
                raise ConversionError(f"{srcs[0].file}: keys {[s.key for s in srcs]} (-> {t!r}) have different dtypes "
                                      f"{[s.dtype for s in srcs]}; a fuse needs one")
            kw["dim"] = d
            op = "fuse"
        else:
            k, rule, extra = producers[t]
            s = src_of(k)
            srcs = (s,)
            check_dtype(s)
            op = rule.op
            if op == "rename":
                if s.shape != want:
                    raise bad_shape(s, t, f"the config needs {list(want)}")
            elif op == "transpose":
                if len(s.shape) != len(rule.dims) or tuple(s.shape[i] for i in rule.dims) != want:
                    raise bad_shape(s, t, f"which transposed by {list(rule.dims)} is not the {list(want)} the config needs")
                kw["dims"] = tuple(rule.dims)
            elif op == "reshape":
                if math.prod(s.shape) != math.prod(want):
                    raise bad_shape(s, t, f"{math.prod(s.shape)} elements; the config needs {list(want)} "
                                          f"({math.prod(want)} elements)")
            elif op == "split":
                d, tgts = rule.dim, extra["targets"]
                wants = [tuple(expected.get(x, all_canonical.get(x, ()))) for x in tgts]
                for x, w in zip(tgts, wants):
                    if len(w) != len(s.shape) or d >= len(w) or any(
                            a != b for i, (a, b) in enumerate(zip(s.shape, w)) if i != d):
                        raise bad_shape(s, x, f"which cannot split along dim {d} into {x!r} {list(w)}")
                if sum(w[d] for w in wants) != s.shape[d]:
                    raise bad_shape(s, t, f"but its split targets {list(tgts)} need {sum(w[d] for w in wants)} "
                                          f"along dim {d}")
                kw["dim"] = d
                kw["offset"] = sum(w[d] for w in wants[:extra["index"]])
        if t in fp32:   # the canonical model's fp32 keys (family fp32_keys), whatever the target dtype
            out = "float32"
        elif dtype is not None:
            out = dtype
        elif manifest.dtype_policy.default != "source":
            out = manifest.dtype_policy.default
        else:
            out = srcs[0].dtype
        entries.append(PlanEntry(t, op, rule.label, srcs, want, out, family.part_of(t), **kw))

    storable = {str(v).removeprefix("torch.") for v in ST_TO_TORCH.values()}
    for sc in sidecars:
        if sc.source.dtype not in storable:
            raise ConversionError(f"{sc.source.file}: key {sc.source.key!r} has dtype {sc.source.dtype}, which the "
                                  f"sidecar writer cannot store")
    parts = {**parts, "complete": not parts["unfilled"]}
    return Plan(cfg=cfg, entries=entries, dropped=dropped, truncated=truncated, num_source_keys=len(infos),
                sidecars=sidecars, normalized=normalized, parts=parts)


# ---------------------------------------------------------------------------------------------
# tensor fetch with finiteness checks


_EXP_MASK = {  # float dtype -> (same-width int view, exponent mask): all exponent bits set = Inf or NaN
    torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000),
    torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
}


def has_nonfinite(x: torch.Tensor) -> bool:
    """Any NaN/Inf? A bit test on the exponent field, in chunks (fast, little scratch memory)."""
    if not x.is_floating_point() or x.numel() == 0:
        return False
    spec = _EXP_MASK.get(x.dtype)
    if spec is None:
        return not bool(torch.isfinite(x).all())
    if not x.is_contiguous():
        x = x.contiguous()
    a = x.view(-1).view(spec[0]).numpy()
    m = a.dtype.type(spec[1])
    for i in range(0, a.size, FINITE_CHUNK):
        c = a[i:i + FINITE_CHUNK]
        if ((c & m) == m).any():
            return True
    return False


def count_nonfinite(x: torch.Tensor) -> int:
    """NaN/Inf count (exact; only on the rare path where has_nonfinite says there are some)."""
    if not has_nonfinite(x):
        return 0
    flat = x.contiguous().view(-1)
    return sum(int((~torch.isfinite(flat[i:i + FINITE_CHUNK])).sum()) for i in range(0, flat.numel(), FINITE_CHUNK))


class _SourceCache:
    """Reads each source once per use; a split's source stays cached across its targets. Tells the reader
    when a source is done so memory-mapped pages can be returned."""

    def __init__(self, reader: WeightReader):
        self.reader = reader
        self.key: str | None = None
        self.tensor: torch.Tensor | None = None

    def get(self, s: SourceRef, keep: bool) -> torch.Tensor:
        if self.key == s.key:
            return self.tensor
        self.drop()
        x = self.reader.get(s.key)
        if tuple(x.shape) != s.shape:
            raise ConversionError(f"{s.file}: key {s.key!r}: tensor data has shape {list(x.shape)}, "
                                  f"header said {list(s.shape)}")
        if keep:
            self.key, self.tensor = s.key, x
        return x

    def done(self, s: SourceRef) -> None:
        if self.key != s.key:
            self.reader.release(s.key)

    def drop(self) -> None:
        if self.key is not None:
            self.reader.release(self.key)
        self.key, self.tensor = None, None


def _fetch(cache: _SourceCache, e: PlanEntry, allow_nonfinite: bool, nonfinite: list[dict]) -> torch.Tensor:
    out_dtype = torch_dtype(e.out_dtype)
    pieces = []
    for s in e.sources:
        x = cache.get(s, keep=e.op == "split")
        if e.op == "split":
            x = x.narrow(e.dim, e.offset, e.shape[e.dim])
        bad = has_nonfinite(x)
        if bad:
            what = f"holds {int(torch.isnan(x).sum())} NaN and {int(torch.isinf(x).sum())} Inf values"
            if not allow_nonfinite:
                raise ConversionError(f"{s.file}: key {s.key!r} (-> {e.target!r}) {what}; "
                                      f"refusing (pass --allow-nonfinite / allow_nonfinite=True to keep them)")
            nonfinite.append({"key": e.target, "source_key": s.key, "detail": what})
        y = x.to(out_dtype)
        if y is not x and not bad and has_nonfinite(y):
            over = count_nonfinite(y)
            if over:
                what = f"finite {s.dtype} values overflow {e.out_dtype} ({over} become Inf)"
                if not allow_nonfinite:
                    raise ConversionError(f"{s.file}: key {s.key!r} (-> {e.target!r}) {what}; "
                                          f"refusing (pass --allow-nonfinite / allow_nonfinite=True to keep them)")
                nonfinite.append({"key": e.target, "source_key": s.key, "detail": what})
        pieces.append(y)
    if e.op == "fuse":
        y = torch.cat(pieces, dim=e.dim)
    else:
        y = pieces[0]
        if e.op == "transpose":
            y = y.permute(*e.dims)
        elif e.op == "reshape":
            y = y.reshape(e.shape)
    return y


def _fetch_sidecar(cache: _SourceCache, sc: SidecarEntry) -> torch.Tensor:
    return cache.get(sc.source, keep=False)


# ---------------------------------------------------------------------------------------------
# report


@dataclass
class ConversionReport:
    family: str
    format: str
    src: str
    out: str | None
    engine_version: int
    conversion_version: int
    manifest: dict
    source: dict
    config: dict
    config_source: dict
    dtype_requested: str | None
    variant: dict | None
    num_source_keys: int
    num_output_keys: int
    parts: dict
    components: dict
    renamed: list[dict]
    normalized: list[dict]
    dropped: list[dict]
    sidecars: dict
    unexpected: list[str]
    missing: list[str]
    truncated: dict | None
    dtypes: dict
    shapes: dict
    nonfinite: list[dict]
    inputs: list[dict]
    outputs: list[dict] = field(default_factory=list)
    weights_version: str | None = None     # "sha256:<hex>" over the canonical weight files' + config.json's sha256
    component: str | None = None           # the component kind converted (wan: transformer | text_encoder | vae)
    parity: dict = field(default_factory=lambda: {"status": "skipped"})
    elapsed_s: float = 0.0
    throughput: dict = field(default_factory=dict)
    created_utc: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def ok(self) -> bool:
        return not self.unexpected and not self.missing


def _summaries(plan: Plan, family: Family) -> tuple[dict, dict]:
    src = Counter(e.src_dtype for e in plan.entries)
    out = Counter(e.out_dtype for e in plan.entries)
    cast = sum(e.src_dtype != e.out_dtype for e in plan.entries)
    fp32 = set(family.fp32_keys(plan.cfg))
    kept = [e.target for e in plan.entries if e.out_dtype == "float32" and e.target in fp32]
    sizes = [OutTensor(e.target, e.out_dtype, e.shape) for e in plan.entries]
    largest = max(sizes, key=lambda t: t.nbytes) if sizes else None
    dtypes = {"source": dict(src), "output": dict(out), "cast": cast, "kept_fp32": kept}
    shapes = {"num_params": sum(math.prod(e.shape) for e in plan.entries),
              "output_bytes": sum(t.nbytes for t in sizes),
              "largest": {"key": largest.key, "shape": list(largest.shape), "bytes": largest.nbytes} if largest else None}
    return dtypes, shapes


def _components(plan: Plan) -> dict:
    comp: dict[str, dict] = {}
    for e in plan.entries:
        c = comp.setdefault(e.part, {"keys": 0, "params": 0, "ops": Counter()})
        c["keys"] += 1
        c["params"] += math.prod(e.shape)
        c["ops"][e.op] += 1
    return {p: {**c, "ops": dict(c["ops"])} for p, c in comp.items()}


def _renamed(plan: Plan) -> list[dict]:
    out = []
    for e in plan.entries:
        d = {"from": e.source_key if len(e.sources) == 1 else [s.key for s in e.sources], "to": e.target,
             "file": str(e.file), "rule": e.rule, "op": e.op, "part": e.part}
        out.append(d)
    return out


# ---------------------------------------------------------------------------------------------
# the public entry points


def _prepare(family_name: str, fmt, src, config, dtype, allow_truncate, variant):
    manifest = _manifest_of(family_name, fmt)
    family = get_family(family_name, manifest.component)
    variant = _bare_variant(family_name, variant)
    if variant is not None and variant not in family.list_variants():
        raise ConversionError(f"unknown variant {variant!r} for {family_name}; known: {', '.join(family.list_variants())}")
    res = resolve_source(manifest, src, config, variant)
    cfg, config_source = read_source_config(family, manifest, res.config_path, variant)
    reader = open_weights(res.weights_kind, res.weights_path)
    try:
        plan = plan_conversion(family, manifest, cfg, reader.infos(), dtype=normalize_dtype(dtype),
                               allow_truncate=allow_truncate, where=str(res.weights_path))
        check_tied_copies(reader, plan, manifest)
        variant_info = None
        if variant is not None:
            if config_source["kind"] == "variant":
                variant_info = {"name": variant, "status": "config taken from the variant"}
            elif "completed_from_variant" in config_source:
                variant_info = {"name": variant, "status": "match",
                                "note": "fields the source config does not determine were taken from the variant"}
            else:
                want = _load_variant(family, variant)
                if want != plan.cfg:
                    a, b = family.config_to_dict(plan.cfg), family.config_to_dict(want)
                    diffs = [f"{k}={a.get(k)!r} (variant: {b.get(k)!r})" for k in b if a.get(k) != b.get(k)]
                    raise ConversionError(f"{res.config_path}: the converted config is not variant {variant!r}: "
                                          + "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else ""))
                variant_info = {"name": variant, "status": "match"}
    except BaseException:
        reader.close()
        raise
    return family, manifest, res, reader, plan, variant_info, config_source


def check_tied_copies(reader: WeightReader, plan: Plan, manifest: CheckpointManifest) -> None:
    """A dropped tied copy (drop rule with `equals`) must equal the tensor it is tied to, bit for bit: a source
    whose copies differ is not the tied model the canonical layout stores once."""
    infos = reader.infos()
    by_norm = {manifest.normalize_key(k): k for k in infos}
    for d in plan.dropped:
        if "equals" not in d:
            continue
        other = by_norm.get(d["equals"])
        if other is None:
            raise ConversionError(f"{d['file']}: key {d['key']!r} is a tied copy of {d['equals']!r}, which the "
                                  f"source does not hold")
        a, b = reader.get(d["key"]), reader.get(other)
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        reader.release(d["key"])
        reader.release(other)
        if not same:
            raise ConversionError(f"{d['file']}: key {d['key']!r} should be tied to {other!r} (the canonical layout "
                                  f"stores it once) but differs from it; refusing")
        d["verified_equal"] = True


def convert_to_state_dict(family: str, fmt: str | CheckpointManifest, src: str | Path, *,
                          config: str | Path | None = None, dtype: str | torch.dtype | None = None,
                          allow_truncate: bool = False, allow_nonfinite: bool = False,
                          variant: str | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """Convert in memory: (family config, {canonical key: tensor}) in canonical key order. Same checks as
    `convert`, nothing written. A format that fills only some parts returns only their keys."""
    _fam, _m, _res, reader, plan, _v, _c = _prepare(family, fmt, src, config, dtype, allow_truncate, variant)
    try:
        nonfinite: list[dict] = []
        cache = _SourceCache(reader)
        sd = {}
        for e in plan.entries:
            y = _fetch(cache, e, allow_nonfinite, nonfinite).contiguous()
            if reader.kind == "torch":  # never hand out views of a memory-mapped pickle
                mapped = {reader.get(s.key).untyped_storage().data_ptr() for s in e.sources}
                if y.untyped_storage().data_ptr() in mapped:
                    y = y.clone()
            sd[e.target] = y
        return plan.cfg, sd
    finally:
        reader.close()


def convert_diffusers_dir_to_canonical_state_dict(src: str | Path, **kw) -> tuple[Any, dict[str, torch.Tensor]]:
    """cosmos3 diffusers transformer folder (or weights file) -> (Cosmos3Config, canonical state dict)."""
    return convert_to_state_dict("cosmos3", "diffusers", src, **kw)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _write_weights(dirpath: Path, tensors: list[OutTensor], fetch, max_shard_bytes: int, meta: dict,
                   on_tensor=None) -> tuple[list[dict], list[str]]:
    shards = plan_shards(tensors, max_shard_bytes)
    names = shard_names(len(shards))
    outputs = [write_safetensors(dirpath / name, shard, fetch, metadata=meta, on_tensor=on_tensor)
               for shard, name in zip(shards, names)]
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.key: n for s, n in zip(shards, names) for t in s}}
        outputs.append(write_bytes(dirpath / INDEX_NAME, json_bytes(index)))
    return outputs, names + ([INDEX_NAME] if len(shards) > 1 else [])


def _completed_copy(tmp: Path, check_dir: Path, fam: Family, plan: Plan, weight_names: list[str],
                    resolved: dict) -> list[str]:
    """A complete canonical checkpoint in check_dir: OUT's weight files (hard-linked) + seeded placeholders for
    the keys of the unfilled parts. Returns the placeholder keys."""
    filled_shards = [n for n in weight_names if n != INDEX_NAME]
    n = len(filled_shards) + 1
    new_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    if len(filled_shards) == 1:
        weight_map.update({e.target: new_names[0] for e in plan.entries})
    else:
        old_map = json.loads((tmp / INDEX_NAME).read_text())["weight_map"]
        rename = dict(zip(filled_shards, new_names))
        weight_map.update({k: rename[v] for k, v in old_map.items()})
    for old, new in zip(filled_shards, new_names):
        try:
            os.link(tmp / old, check_dir / new)
        except OSError:
            shutil.copyfile(tmp / old, check_dir / new)
    shapes = fam.key_shapes(plan.cfg)
    parts = fam.part_keys(plan.cfg)
    missing = [k for p in plan.parts["unfilled"] for k in parts[p]]
    fp32 = set(fam.fp32_keys(plan.cfg))
    dt = plan.entries[0].out_dtype if plan.entries else "float32"
    todo = [OutTensor(k, "float32" if k in fp32 else dt, tuple(shapes[k])) for k in missing]
    g = torch.Generator().manual_seed(PLACEHOLDER_SEED)
    write_safetensors(check_dir / new_names[-1], todo,
                      lambda t: fam.placeholder(t.key, t.shape, g).to(torch_dtype(t.dtype)),
                      metadata={"format": "pt", "placeholders": "seeded, for a parity check only"})
    weight_map.update({t.key: new_names[-1] for t in todo})
    write_bytes(check_dir / INDEX_NAME, json_bytes({"metadata": {}, "weight_map": weight_map}))
    write_bytes(check_dir / CONFIG_NAME, (tmp / CONFIG_NAME).read_bytes())
    full = {**resolved, "parts": {"filled": list(parts), "unfilled": [], "complete": True,
                                  "placeholders": list(plan.parts["unfilled"])}}
    write_bytes(check_dir / MANIFEST_NAME, json_bytes(full))
    return missing

def convert(family: str, fmt: str | CheckpointManifest, src: str | Path, out: str | Path, *,
            config: str | Path | None = None, variant: str | None = None, dtype: str | torch.dtype | None = None,
            force: bool = False, allow_truncate: bool = False, allow_nonfinite: bool = False,
            keep_sidecars: bool = False, post_check: PostCheck | None = None, skip_parity: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: Progress | None = None,
            progress_every: int | None = None, progress_update: ProgressUpdate | None = None,
            missing_post_check: str = "skipped") -> ConversionReport:
    """Convert the `fmt` checkpoint of `family` at SRC into a canonical checkpoint directory OUT.

    `fmt` is a format name (`fvconvert formats`), a path to a manifest JSON, or a CheckpointManifest.
    post_check(tmp_dir) -> dict runs on the finished, not yet renamed directory (weights, config.json,
    manifest.json present); its result (must hold "status") is stored as report.parity. A status of
    "fail"/"error", or an exception, fails the conversion and leaves nothing. For a partial checkpoint whose
    manifest says `parity.unfilled_parts: "placeholders"`, the check runs on a temporary copy completed with
    seeded placeholder weights (removed afterwards). Without a post_check (or with skip_parity) parity is
    {"status": "skipped", "reason": ...} (`missing_post_check` names the status when no post_check is given:
    the CLI says "not run" for a component whose check parity does not wire yet).
    """
    t0 = time.time()
    say = progress or (lambda _m: None)
    src, out = Path(src), Path(out)
    if max_shard_bytes <= 0:
        raise ConversionError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    check_output(src, out, force)
    prepared = _prepare(family, fmt, src, config, dtype, allow_truncate, variant)
    reader = prepared[3]
    try:
        res = prepared[2]  # every file the conversion reads: OUT may not replace any of them
        check_output(src, out, force, [*reader.files, *([res.config_path] if res.config_path else [])])
        with staged_output(out) as tmp:
            report = write_component(tmp, out, prepared, src=src, dtype=dtype, allow_truncate=allow_truncate,
                                     allow_nonfinite=allow_nonfinite, keep_sidecars=keep_sidecars,
                                     post_check=post_check, skip_parity=skip_parity, max_shard_bytes=max_shard_bytes,
                                     say=say, progress_every=progress_every, progress_update=progress_update, t0=t0,
                                     missing_post_check=missing_post_check)
    finally:
        reader.close()
    gbs = report.throughput.get("gb_per_s")
    say(f"done: {out} ({report.num_output_keys} tensors, {_gib(report.shapes['output_bytes'])}, {report.elapsed_s:.1f}s"
        + (f", {gbs:.2f} GB/s writing" if gbs else "") + ")")
    return report


def write_component(tmp: Path, out: Path, prepared: tuple, *, src: Path, dtype, allow_truncate: bool,
                    allow_nonfinite: bool, keep_sidecars: bool, post_check: PostCheck | None, skip_parity: bool,
                    max_shard_bytes: int, say: Progress, progress_every: int | None,
                    progress_update: ProgressUpdate | None, t0: float,
                    missing_post_check: str = "skipped") -> ConversionReport:
    """Write one canonical component directory into the (existing, empty) directory `tmp` from a `_prepare`d
    conversion: weights, config.json, manifest.json, sidecars, the post-check, conversion_report.json. `out` is
    where it will be published (for messages and the report)."""
    fam, manifest, res, reader, plan, variant_info, config_source = prepared
    check_dir: Path | None = None
    hashing: ThreadPoolExecutor | None = None
    stop_hashing = threading.Event()
    try:
        in_paths = ([res.config_path.resolve()] if res.config_path else []) + [p.resolve() for p in reader.files]
        in_paths += [p.resolve() for p, _ in res.expected if p.resolve() not in in_paths]
        say(f"hashing {len(in_paths)} input file(s) (in the background)")
        # sha256 of the inputs runs on another core while the conversion reads/writes (hashlib and file reads
        # release the GIL); it is checked before anything is published
        hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fvconvert-sha256")
        hashed = hashing.submit(hash_files, in_paths, stop=stop_hashing)

        out_tensors = [OutTensor(e.target, e.out_dtype, e.shape) for e in plan.entries]
        by_target = {e.target: e for e in plan.entries}
        total = len(out_tensors)
        every = progress_every or max(1, total // 20)
        min_gap_s = 0.0 if progress_every else 1.0   # auto mode: at most one line a second
        total_bytes = sum(t.nbytes for t in out_tensors)
        done = 0
        done_bytes = 0
        last_say = time.time()
        t_write = time.time()
        nonfinite: list[dict] = []
        # no source-format stamp in the weights: the same weights give byte-identical canonical files from any
        # upstream format (manifest.json and the report say where they came from)
        meta = {"format": "pt", "family": fam.name, "producer": f"fvconvert engine {ENGINE_VERSION}"}
        cache = _SourceCache(reader)

        def fetch(t: OutTensor) -> torch.Tensor:
            return _fetch(cache, by_target[t.key], allow_nonfinite, nonfinite)

        def tick(t: OutTensor) -> None:
            nonlocal done, done_bytes, last_say
            for s in by_target[t.key].sources:
                cache.done(s)
            done += 1
            done_bytes += t.nbytes
            now = time.time()
            if progress_update is not None:
                progress_update({"done": done, "total": total, "done_bytes": done_bytes, "total_bytes": total_bytes,
                                 "elapsed_s": now - t_write, "key": t.key})
            if progress_update is None and (done == total or (done % every == 0 and now - last_say >= min_gap_s)):
                last_say = now
                say(f"[{done}/{total}] tensors written ({_gib(done_bytes)} of {_gib(total_bytes)})")

        n_shards = len(plan_shards(out_tensors, max_shard_bytes))
        say(f"converting {plan.num_source_keys} source tensors -> {total} canonical tensors "
            f"({n_shards} output shard{'s' if n_shards > 1 else ''})")
        outputs, weight_names = _write_weights(tmp, out_tensors, fetch, max_shard_bytes, meta, on_tensor=tick)
        cache.drop()
        write_s = time.time() - t_write
        if not hashed.done():
            say("waiting for the input sha256")
        inputs = hashed.result()
        by_path = {i["path"]: i for i in inputs}
        if res.weights_sha256 and by_path[str(res.weights_path.resolve())]["sha256"] != res.weights_sha256:
            raise ConversionError(f"{res.weights_path}: sha256 {by_path[str(res.weights_path.resolve())]['sha256']} "
                                  f"differs from the {res.weights_sha256} manifest {manifest.id} expects")
        for p, e in res.expected:
            got = by_path[str(p.resolve())]["sha256"]
            if e.sha256 and got != e.sha256:
                raise ConversionError(f"{p}: sha256 {got} differs from the {e.sha256} manifest {manifest.id} expects")

        sidecar_info: dict[str, dict] = {}
        by_sidecar: dict[str, list] = {}
        for sc in plan.sidecars:
            by_sidecar.setdefault(sc.sidecar, []).append(sc)
        for name, scs in by_sidecar.items():
            info = {"keys": len(scs), "bytes": sum(math.prod(s.source.shape) * torch_dtype(s.source.dtype).itemsize
                                                   for s in scs), "rule": scs[0].rule, "kept": keep_sidecars}
            if keep_sidecars:
                say(f"writing sidecar {name}/ ({len(scs)} tensors)")
                (tmp / name).mkdir()
                by_key = {s.key: s for s in scs}
                tens = [OutTensor(s.key, s.source.dtype, s.source.shape) for s in scs]
                outs, names = _write_weights(tmp / name, tens, lambda t: _fetch_sidecar(cache, by_key[t.key]),
                                             max_shard_bytes, {**meta, "sidecar": name},
                                             on_tensor=lambda t: reader.release(by_key[t.key].source.key))
                outputs += [{**o, "path": f"{name}/{o['path']}"} for o in outs]
                info["files"] = [f"{name}/{n}" for n in names]
            else:
                info["reason"] = next(r.reason for r in manifest.rules if r.label == scs[0].rule)
            sidecar_info[name] = info
        reader.close()

        dtype_req = normalize_dtype(dtype)
        outputs.append(write_bytes(tmp / CONFIG_NAME, json_bytes(fam.config_to_dict(plan.cfg))))
        # the canonical weights + config (not sidecars, manifest or report): what caches key numerics on
        version = weights_version_of((o["path"], o["sha256"]) for o in outputs if "/" not in o["path"])
        resolved = {
            "family": fam.name, "component": fam.component, "format": manifest.format,
            "weights_version": version, "manifest_file": manifest.origin,
            "manifest_sha256": manifest.sha256, "engine_version": ENGINE_VERSION,
            "parts": plan.parts,
            "manifest": manifest.to_dict(),
            "resolved": {"source_kind": res.weights_kind, "source_weights": str(res.weights_path.resolve()),
                         "source_config": str(res.config_path.resolve()) if res.config_path else None,
                         "config_source": config_source,
                         "dtype": dtype_req or manifest.dtype_policy.default,
                         "allow_truncate": allow_truncate, "allow_nonfinite": allow_nonfinite,
                         "truncated": plan.truncated, "weights": weight_names,
                         "sidecars": {k: v.get("files", []) for k, v in sidecar_info.items() if v["kept"]}},
        }
        outputs.append(write_bytes(tmp / MANIFEST_NAME, json_bytes(resolved)))

        dtypes, shapes = _summaries(plan, fam)
        report = ConversionReport(
            family=fam.name, format=manifest.format, src=str(src.resolve()), out=str(out.resolve()),
            engine_version=ENGINE_VERSION,
            conversion_version=manifest.conversion_version,
            manifest={"id": manifest.id, "file": manifest.origin, "sha256": manifest.sha256,
                      "upstream": manifest.upstream, "required_parity": manifest.parity.to_dict()},
            source={"kind": res.weights_kind, "weights": str(res.weights_path.resolve()),
                    "config": str(res.config_path.resolve()) if res.config_path else None},
            config=fam.config_to_dict(plan.cfg), config_source=config_source, dtype_requested=dtype_req,
            variant=variant_info, num_source_keys=plan.num_source_keys, num_output_keys=total,
            parts={**plan.parts, "descriptions": {p: d for p, d in fam.part_descriptions().items()
                                                  if p in plan.parts["filled"] + plan.parts["unfilled"]}},
            components=_components(plan), renamed=_renamed(plan), normalized=plan.normalized,
            dropped=plan.dropped, sidecars=sidecar_info, unexpected=[], missing=[], truncated=plan.truncated,
            dtypes=dtypes, shapes=shapes, nonfinite=nonfinite, inputs=inputs, outputs=outputs,
            weights_version=version, component=fam.component,
        )
        report.throughput = {"write_s": round(write_s, 3), "bytes": total_bytes,
                             "gb_per_s": round(total_bytes / 1e9 / write_s, 3) if write_s > 0 else None}

        if skip_parity:
            report.parity = {"status": "skipped", "reason": "skipped on request (--skip-parity)"}
        elif post_check is None:
            report.parity = {"status": missing_post_check,
                             "reason": f"no parity post-check is wired for {manifest.post_check_name}"}
        elif not plan.parts["complete"] and manifest.parity.unfilled_parts != "placeholders":
            report.parity = {"status": "skipped",
                             "reason": f"partial checkpoint (parts {', '.join(plan.parts['filled'])}); manifest "
                                       f"{manifest.id} declares no check for a partial checkpoint"}
        else:
            target = tmp
            scope = None
            if not plan.parts["complete"]:
                check_dir = make_dir(tmp.parent / staging_name(out, "check").name)
                placeholders = _completed_copy(tmp, check_dir, fam, plan, weight_names, resolved)
                target = check_dir
                scope = {"checked_parts": plan.parts["filled"], "placeholder_parts": plan.parts["unfilled"],
                         "placeholder_keys": len(placeholders), "placeholder_seed": PLACEHOLDER_SEED,
                         "note": "run on a temporary copy completed with seeded placeholder weights for the "
                                 "parts this format does not fill; the placeholders are not in OUT"}
                say(f"running the parity post-check on the converted parts ({', '.join(plan.parts['filled'])}) "
                    f"with placeholders for {', '.join(plan.parts['unfilled'])}")
            else:
                say("running the parity post-check on the converted checkpoint")
            try:
                result = post_check(target)
            except ConversionError:
                raise
            except Exception as e:
                raise ConversionError(f"{out}: parity post-check raised {type(e).__name__}: {e}") from None
            finally:
                if check_dir is not None:
                    shutil.rmtree(check_dir, ignore_errors=True)
                    check_dir = None
            if not isinstance(result, dict) or "status" not in result:
                raise ConversionError(f"{out}: parity post-check must return a dict with a 'status', got {result!r:.200}")
            report.parity = {**result, **({"scope": scope} if scope else {})}
            if str(result["status"]).lower() in ("fail", "failed", "error"):
                detail = result.get("summary") or result.get("message") or result.get("detail") or ""
                raise ParityCheckFailed(f"{out}: parity post-check on the converted weights says "
                                      f"{result['status']!r}{': ' + str(detail) if detail else ''}; nothing written")
        report.parity.setdefault("required_level", manifest.parity.level)

        report.elapsed_s = round(time.time() - t0, 3)
        report.created_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_bytes(tmp / REPORT_NAME, json_bytes(report.to_dict()))
        return report

    finally:
        if hashing is not None:
            stop_hashing.set()
            hashing.shutdown(wait=True)
        if check_dir is not None:
            shutil.rmtree(check_dir, ignore_errors=True)


__all__ = ["check_output", "staged_output", "write_component", "ConversionReport", "Plan", "PlanEntry", "SourceRef", "SidecarEntry", "convert", "convert_to_state_dict",
           "convert_diffusers_dir_to_canonical_state_dict", "normalize_dtype", "plan_conversion", "resolve_source",
           "read_source_config", "count_nonfinite", "has_nonfinite"]
