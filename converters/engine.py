"""The conversion engine: upstream checkpoint + CheckpointManifest -> canonical checkpoint directory.

    convert("cosmos3", "diffusers", SRC, OUT)                  -> ConversionReport (writes OUT)
    convert_to_state_dict("cosmos3", "diffusers", SRC)         -> (config, {canonical key: tensor})
    convert_diffusers_dir_to_canonical_state_dict(SRC)         -> the same, for cosmos3/diffusers

A canonical checkpoint directory holds:
    model.safetensors                     (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
    config.json                           the family config (`Cosmos3Config.to_dict()`)
    manifest.json                         the resolved CheckpointManifest used (+ how it was applied)
    conversion_report.json                what was renamed/dropped, dtypes, shapes, sha256 of inputs/outputs, parity

Every refusal is a ConversionError naming the file and key. OUT is written in a temporary directory
beside it and renamed into place at the very end; a failed run leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from converters.errors import ConversionError, name_some
from converters.families import Family, get_family
from converters.manifest import CheckpointManifest, Rule, load_manifest
from converters.readers import TensorInfo, WeightReader, hash_files, open_weights, torch_dtype, weight_kind_of
from converters.writer import (INDEX_NAME, OutTensor, json_bytes, plan_shards, shard_names, write_bytes,
                               write_safetensors)
from manifests.errors import ManifestError

ENGINE_VERSION = 1
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
REPORT_NAME = "conversion_report.json"
CONFIG_NAME = "config.json"
MANIFEST_NAME = "manifest.json"
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "f32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16"}

PostCheck = Callable[[Path], dict]
Progress = Callable[[str], None]


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
    config_path: Path
    weights_kind: str
    weights_path: Path


def resolve_source(manifest: CheckpointManifest, src: str | Path, config: str | Path | None = None) -> ResolvedSource:
    """SRC is a directory holding the manifest's config + exactly one of its weight layouts, or a weights
    file (`.safetensors`, `*.safetensors.index.json`, `.pt/.pth/.bin`) with the config beside it or
    given explicitly."""
    src = Path(src)
    if not src.exists():
        raise ConversionError(f"{src}: source not found")
    if src.is_dir():
        present = [w for w in manifest.weight_files if (src / w.path).is_file()]
        if not present:
            hint = ""
            if (src / "model_index.json").is_file() and (src / "transformer").is_dir():
                hint = f"; this looks like a diffusers pipeline folder, pass {src / 'transformer'}"
            elif (src / "model.safetensors").is_file() or (src / "model.safetensors.index.json").is_file():
                hint = "; model.safetensors suggests a canonical (already converted) or other-format checkpoint"
            found = sorted(p.name for p in src.iterdir())[:8]
            raise ConversionError(
                f"{src}: no {manifest.id} weights found; expected one of "
                f"{', '.join(w.path for w in manifest.weight_files)} (found: {', '.join(found) or 'nothing'}){hint}")
        if len(present) > 1:
            raise ConversionError(f"{src}: ambiguous weights, both {present[0].path} and {present[1].path} are present; "
                                  f"pass the weights file itself as SRC")
        kind, wpath = present[0].kind, src / present[0].path
        cpath = Path(config) if config is not None else src / manifest.config_file
    else:
        kind = weight_kind_of(src)
        if kind is None:
            raise ConversionError(f"{src}: unknown checkpoint file type; expected .safetensors, "
                                  f"*.safetensors.index.json, .pt, .pth or .bin (or a directory)")
        wpath = src
        cpath = Path(config) if config is not None else src.parent / manifest.config_file
    if not cpath.is_file():
        raise ConversionError(f"{cpath}: config file not found (the {manifest.id} format needs "
                              f"{manifest.config_file}; give one with --config)")
    return ResolvedSource(src=src, config_path=cpath, weights_kind=kind, weights_path=wpath)


def read_source_config(family: Family, manifest: CheckpointManifest, path: Path) -> tuple[Any, dict]:
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
    try:
        cfg = family.config_mappings[manifest.config_mapping](raw)
    except ManifestError as e:
        raise ConversionError(f"{path}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ConversionError(f"{path}: cannot map onto a {family.name} config ({type(e).__name__}: {e})") from None
    return cfg, raw


# ---------------------------------------------------------------------------------------------
# planning: every check that needs only headers happens here, before a byte is written


@dataclass(frozen=True)
class PlanEntry:
    source_key: str
    file: Path
    target: str
    rule: str
    src_dtype: str
    out_dtype: str
    shape: tuple[int, ...]


@dataclass
class Plan:
    cfg: Any
    entries: list[PlanEntry]                       # canonical key order
    dropped: list[dict]
    truncated: dict | None
    num_source_keys: int


def _src_file(infos: dict[str, TensorInfo], key: str) -> str:
    return str(infos[key].file)


def plan_conversion(family: Family, manifest: CheckpointManifest, cfg: Any, infos: dict[str, TensorInfo], *,
                    dtype: str | None = None, allow_truncate: bool = False, where: str | None = None) -> Plan:
    """Map every source key through the manifest rules and check the result against the family's canonical
    key set for `cfg` (missing, unexpected, shapes, dtypes, conflicts, truncation). Headers only."""
    targets: dict[str, tuple[str, Rule]] = {}
    dropped: list[dict] = []
    unexpected: list[str] = []
    for key, inf in infos.items():
        rule, target = manifest.match(key)
        if rule is None:
            unexpected.append(key)
        elif rule.op == "drop":
            dropped.append({"key": key, "file": str(inf.file), "reason": rule.reason})
        else:
            if target in targets:
                other = targets[target][0]
                raise ConversionError(f"{inf.file}: keys {other!r} and {key!r} both map to canonical key {target!r} "
                                      f"(two sources onto one target)")
            targets[target] = (key, rule)
    if unexpected:
        k = unexpected[0]
        raise ConversionError(f"{_src_file(infos, k)}: unexpected key {k!r}: no rule of manifest {manifest.id} matches it"
                              + (f" ({len(unexpected)} unexpected keys: {name_some(unexpected)})" if len(unexpected) > 1 else ""))

    expected = family.key_shapes(cfg)
    not_canonical = [t for t in targets if t not in expected]
    if not_canonical:
        t = not_canonical[0]
        k = targets[t][0]
        m = family.layer_key.match(t)
        why = (f"the config has only {family.num_layers(cfg)} layers" if m and int(m.group(1)) >= family.num_layers(cfg)
               else "the config in the source does not have this tensor")
        raise ConversionError(f"{_src_file(infos, k)}: unexpected key {k!r} (-> canonical {t!r}): {why}"
                              + (f" ({len(not_canonical)} such keys)" if len(not_canonical) > 1 else ""))

    truncated = None
    missing = [t for t in expected if t not in targets]
    if missing:
        n_cfg = family.num_layers(cfg)
        present_layers = sorted({int(m.group(1)) for t in targets if (m := family.layer_key.match(t))})
        n_have = 0
        while n_have in present_layers:
            n_have += 1
        complete_prefix = False
        if 0 < n_have < n_cfg:
            try:
                cfg_t = family.with_num_layers(cfg, n_have)
            except ManifestError:
                cfg_t = None
            if cfg_t is not None:
                exp_t = family.key_shapes(cfg_t)
                complete_prefix = set(exp_t) == set(targets)
        where = where or (str(next(iter(infos.values())).file) if infos else "source")
        if complete_prefix and allow_truncate:
            truncated = {"config_num_layers": n_cfg, "converted_num_layers": n_have,
                         "absent_keys": len(missing)}
            cfg, expected = cfg_t, exp_t
        else:
            hint = ""
            if complete_prefix:
                hint = (f"; the checkpoint holds layers 0..{n_have - 1} of the {n_cfg} its config declares "
                        f"(pass --allow-truncate / allow_truncate=True to convert only those)")
            more = f" ({len(missing)} missing: {name_some(missing)})" if len(missing) > 1 else ""
            raise ConversionError(f"{where}: missing key: no source tensor maps to canonical {missing[0]!r}{more}{hint}")

    allowed = set(manifest.dtype_policy.allowed_source_dtypes)
    fp32 = set(family.fp32_keys(cfg))
    entries: list[PlanEntry] = []
    for t, want_shape in expected.items():
        k, rule = targets[t]
        inf = infos[k]
        if tuple(inf.shape) != tuple(want_shape):
            raise ConversionError(f"{inf.file}: key {k!r} (-> {t!r}) has shape {list(inf.shape)}, "
                                  f"the config needs {list(want_shape)}")
        if inf.dtype not in allowed:
            raise ConversionError(f"{inf.file}: key {k!r} has dtype {inf.dtype}; manifest {manifest.id} accepts "
                                  f"{', '.join(sorted(allowed))}")
        if t in fp32 or manifest.dtype_policy.keeps_fp32(t):
            out = "float32"
        elif dtype is not None:
            out = dtype
        elif manifest.dtype_policy.default != "source":
            out = manifest.dtype_policy.default
        else:
            out = inf.dtype
        entries.append(PlanEntry(k, inf.file, t, rule.label, inf.dtype, out, tuple(inf.shape)))
    return Plan(cfg=cfg, entries=entries, dropped=dropped, truncated=truncated, num_source_keys=len(infos))


# ---------------------------------------------------------------------------------------------
# tensor fetch with finiteness checks


def _fetch(reader: WeightReader, e: PlanEntry, allow_nonfinite: bool, nonfinite: list[dict]) -> torch.Tensor:
    x = reader.get(e.source_key)
    if tuple(x.shape) != e.shape:
        raise ConversionError(f"{e.file}: key {e.source_key!r}: tensor data has shape {list(x.shape)}, "
                              f"header said {list(e.shape)}")
    y = x.to(torch_dtype(e.out_dtype))
    if x.is_floating_point():
        fin = torch.isfinite(y)
        if not bool(fin.all()):
            src_fin = torch.isfinite(x) if y is not x else fin
            n_nan = int(torch.isnan(x).sum())
            n_inf = int(torch.isinf(x).sum())
            if bool(src_fin.all()):
                what = f"finite {e.src_dtype} values overflow {e.out_dtype} ({int((~fin).sum())} become Inf)"
            else:
                what = f"holds {n_nan} NaN and {n_inf} Inf values"
            if not allow_nonfinite:
                raise ConversionError(f"{e.file}: key {e.source_key!r} (-> {e.target!r}) {what}; "
                                      f"refusing (pass --allow-nonfinite / allow_nonfinite=True to keep them)")
            nonfinite.append({"key": e.target, "source_key": e.source_key, "detail": what})
    return y


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
    dtype_requested: str | None
    variant: dict | None
    num_source_keys: int
    num_output_keys: int
    renamed: list[dict]
    dropped: list[dict]
    unexpected: list[str]
    missing: list[str]
    truncated: dict | None
    dtypes: dict
    shapes: dict
    nonfinite: list[dict]
    inputs: list[dict]
    outputs: list[dict] = field(default_factory=list)
    parity: dict = field(default_factory=lambda: {"status": "skipped"})
    elapsed_s: float = 0.0
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
    kept = [e.target for e in plan.entries if e.out_dtype == "float32" and e.target in set(family.fp32_keys(plan.cfg))]
    sizes = [OutTensor(e.target, e.out_dtype, e.shape) for e in plan.entries]
    largest = max(sizes, key=lambda t: t.nbytes) if sizes else None
    dtypes = {"source": dict(src), "output": dict(out), "cast": cast, "kept_fp32": kept}
    shapes = {"num_params": sum(math.prod(e.shape) for e in plan.entries),
              "output_bytes": sum(t.nbytes for t in sizes),
              "largest": {"key": largest.key, "shape": list(largest.shape), "bytes": largest.nbytes} if largest else None}
    return dtypes, shapes


# ---------------------------------------------------------------------------------------------
# the public entry points


def _prepare(family_name: str, fmt: str, src, config, dtype, allow_truncate, variant):
    family = get_family(family_name)
    manifest = load_manifest(family_name, fmt)
    res = resolve_source(manifest, src, config)
    cfg, _raw = read_source_config(family, manifest, res.config_path)
    reader = open_weights(res.weights_kind, res.weights_path)
    try:
        plan = plan_conversion(family, manifest, cfg, reader.infos(), dtype=normalize_dtype(dtype),
                               allow_truncate=allow_truncate, where=str(res.weights_path))
        variant_info = None
        if variant is not None:
            try:
                want = family.load_variant(variant)
            except ManifestError as e:
                raise ConversionError(str(e)) from None
            if want != plan.cfg:
                a, b = family.config_to_dict(plan.cfg), family.config_to_dict(want)
                diffs = [f"{k}={a.get(k)!r} (variant: {b.get(k)!r})" for k in b if a.get(k) != b.get(k)]
                raise ConversionError(f"{res.config_path}: the converted config is not variant {variant!r}: "
                                      + "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else ""))
            variant_info = {"name": variant, "status": "match"}
    except BaseException:
        reader.close()
        raise
    return family, manifest, res, reader, plan, variant_info


def convert_to_state_dict(family: str, fmt: str, src: str | Path, *, config: str | Path | None = None,
                          dtype: str | torch.dtype | None = None, allow_truncate: bool = False,
                          allow_nonfinite: bool = False, variant: str | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """Convert in memory: (family config, {canonical key: tensor}) in canonical key order. Same checks as
    `convert`, nothing written."""
    _fam, _m, _res, reader, plan, _v = _prepare(family, fmt, src, config, dtype, allow_truncate, variant)
    try:
        nonfinite: list[dict] = []
        sd = {}
        for e in plan.entries:
            y = _fetch(reader, e, allow_nonfinite, nonfinite)
            sd[e.target] = y.clone() if reader.kind == "torch" else y
        return plan.cfg, sd
    finally:
        reader.close()


def convert_diffusers_dir_to_canonical_state_dict(src: str | Path, **kw) -> tuple[Any, dict[str, torch.Tensor]]:
    """cosmos3 diffusers transformer folder (or weights file) -> (Cosmos3Config, canonical state dict)."""
    return convert_to_state_dict("cosmos3", "diffusers", src, **kw)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _is_within(a: Path, b: Path) -> bool:
    try:
        a.resolve().relative_to(b.resolve())
        return True
    except ValueError:
        return False


def convert(family: str, fmt: str, src: str | Path, out: str | Path, *, config: str | Path | None = None,
            variant: str | None = None, dtype: str | torch.dtype | None = None, force: bool = False,
            allow_truncate: bool = False, allow_nonfinite: bool = False, post_check: PostCheck | None = None,
            skip_parity: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            progress: Progress | None = None, progress_every: int | None = None) -> ConversionReport:
    """Convert the `fmt` checkpoint of `family` at SRC into a canonical checkpoint directory OUT.

    post_check(tmp_dir) -> dict runs on the finished, not yet renamed directory (weights, config.json,
    manifest.json present); its result (must hold "status") is stored as report.parity. A status of
    "fail"/"error", or an exception, fails the conversion and leaves nothing. Without a post_check (or
    with skip_parity) parity is {"status": "skipped", "reason": ...}.
    """
    t0 = time.time()
    say = progress or (lambda _m: None)
    src, out = Path(src), Path(out)
    if max_shard_bytes <= 0:
        raise ConversionError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    if os.path.lexists(out):
        if not force:
            raise ConversionError(f"{out}: output already exists; refusing to overwrite (pass --force / force=True)")
        if src.exists() and (_is_within(src, out)):
            raise ConversionError(f"{out}: output is (or contains) the source {src}; refusing to overwrite it")
    if src.exists() and src.is_dir() and out.resolve() == src.resolve():
        raise ConversionError(f"{out}: output and source are the same directory")

    fam, manifest, res, reader, plan, variant_info = _prepare(family, fmt, src, config, dtype, allow_truncate, variant)
    created: list[Path] = []
    tmp: Path | None = None
    published = False
    try:
        parent = out.parent if str(out.parent) else Path(".")
        missing_parents = []
        p = parent
        while not p.exists():
            missing_parents.append(p)
            p = p.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            created = list(reversed(missing_parents))
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.fvconvert-", dir=parent))
        except OSError as e:
            raise ConversionError(f"{out}: cannot create the output directory ({e.strerror or e})") from None

        say(f"hashing {len(reader.files) + 1} input file(s)")
        inputs = hash_files([res.config_path.resolve()] + [p.resolve() for p in reader.files])

        out_tensors = [OutTensor(e.target, e.out_dtype, e.shape) for e in plan.entries]
        by_target = {e.target: e for e in plan.entries}
        shards = plan_shards(out_tensors, max_shard_bytes)
        names = shard_names(len(shards))
        total = len(out_tensors)
        every = progress_every or max(1, total // 20)
        min_gap_s = 0.0 if progress_every else 1.0   # auto mode: at most one line a second
        total_bytes = sum(t.nbytes for t in out_tensors)
        done = 0
        done_bytes = 0
        last_say = time.time()
        nonfinite: list[dict] = []
        outputs: list[dict] = []
        meta = {"format": "pt", "family": fam.name, "producer": f"fvconvert engine {ENGINE_VERSION}",
                "source_format": manifest.id}

        def tick(t: OutTensor) -> None:
            nonlocal done, done_bytes, last_say
            done += 1
            done_bytes += t.nbytes
            now = time.time()
            if done == total or (done % every == 0 and now - last_say >= min_gap_s):
                last_say = now
                say(f"[{done}/{total}] tensors written ({_gib(done_bytes)} of {_gib(total_bytes)})")

        say(f"converting {plan.num_source_keys} source tensors -> {total} canonical tensors "
            f"({len(shards)} output shard{'s' if len(shards) > 1 else ''})")
        for i, (shard, name) in enumerate(zip(shards, names)):
            if len(shards) > 1:
                say(f"shard {i + 1}/{len(shards)}: {name} ({len(shard)} tensors)")
            outputs.append(write_safetensors(
                tmp / name, shard, lambda t: _fetch(reader, by_target[t.key], allow_nonfinite, nonfinite),
                metadata=meta, on_tensor=tick))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in out_tensors)},
                     "weight_map": {t.key: n for s, n in zip(shards, names) for t in s}}
            outputs.append(write_bytes(tmp / INDEX_NAME, json_bytes(index)))
        reader.close()

        dtype_req = normalize_dtype(dtype)
        outputs.append(write_bytes(tmp / CONFIG_NAME, json_bytes(fam.config_to_dict(plan.cfg))))
        resolved = {
            "family": fam.name, "format": manifest.format, "manifest_file": manifest.origin,
            "manifest_sha256": manifest.sha256, "engine_version": ENGINE_VERSION,
            "manifest": manifest.to_dict(),
            "resolved": {"source_kind": res.weights_kind, "source_weights": str(res.weights_path.resolve()),
                         "source_config": str(res.config_path.resolve()), "dtype": dtype_req or manifest.dtype_policy.default,
                         "allow_truncate": allow_truncate, "allow_nonfinite": allow_nonfinite,
                         "truncated": plan.truncated, "weights": names + ([INDEX_NAME] if len(shards) > 1 else [])},
        }
        outputs.append(write_bytes(tmp / MANIFEST_NAME, json_bytes(resolved)))

        dtypes, shapes = _summaries(plan, fam)
        report = ConversionReport(
            family=fam.name, format=manifest.format, src=str(src.resolve()), out=str(out.resolve()),
            engine_version=ENGINE_VERSION,
            conversion_version=manifest.conversion_version,
            manifest={"id": manifest.id, "file": manifest.origin, "sha256": manifest.sha256,
                      "upstream": manifest.upstream},
            source={"kind": res.weights_kind, "weights": str(res.weights_path.resolve()),
                    "config": str(res.config_path.resolve())},
            config=fam.config_to_dict(plan.cfg), dtype_requested=dtype_req, variant=variant_info,
            num_source_keys=plan.num_source_keys, num_output_keys=total,
            renamed=[{"from": e.source_key, "to": e.target, "file": str(e.file), "rule": e.rule} for e in plan.entries],
            dropped=plan.dropped, unexpected=[], missing=[], truncated=plan.truncated,
            dtypes=dtypes, shapes=shapes, nonfinite=nonfinite, inputs=inputs, outputs=outputs,
        )

        if skip_parity:
            report.parity = {"status": "skipped", "reason": "skipped on request (--skip-parity)"}
        elif post_check is None:
            report.parity = {"status": "skipped", "reason": f"no parity post-check is wired for {fam.name}"}
        else:
            say("running the parity post-check on the converted checkpoint")
            try:
                result = post_check(tmp)
            except ConversionError:
                raise
            except Exception as e:
                raise ConversionError(f"{out}: parity post-check raised {type(e).__name__}: {e}") from None
            if not isinstance(result, dict) or "status" not in result:
                raise ConversionError(f"{out}: parity post-check must return a dict with a 'status', got {result!r:.200}")
            report.parity = result
            if str(result["status"]).lower() in ("fail", "failed", "error"):
                detail = result.get("summary") or result.get("message") or ""
                raise ConversionError(f"{out}: parity post-check on the converted weights says "
                                      f"{result['status']!r}{': ' + str(detail) if detail else ''}; nothing written")

        report.elapsed_s = round(time.time() - t0, 3)
        report.created_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_bytes(tmp / REPORT_NAME, json_bytes(report.to_dict()))

        # atomic publish
        if os.path.lexists(out):
            aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.fvconvert-old-", dir=parent))
            os.replace(out, aside / "old")
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(aside / "old", out)
                raise
            finally:
                shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, out)
        published = True
        say(f"done: {out} ({total} tensors, {report.elapsed_s:.1f}s)")
        return report
    except OSError as e:
        raise ConversionError(f"{getattr(e, 'filename', None) or out}: {e.strerror or e}") from None
    finally:
        reader.close()
        if not published:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:
                    pass
