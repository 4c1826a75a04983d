"""Conversion planning: every check that needs only the safetensors / pickle headers (rule matching, key set, shapes,
dtypes, truncation, sidecars) happens here, before a byte is written; the result is a typed Plan. Part of the
conversion engine (converters/engine.py re-exports these names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from converters.errors import ConversionError, name_some
from converters.families import Family
from converters.manifest import CheckpointManifest, load_manifest, Rule
from converters.readers import ST_TO_TORCH, TensorInfo
from manifests.errors import ManifestError


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
