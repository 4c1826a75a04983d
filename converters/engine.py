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

By concern: converters/source.py (source + config resolution), converters/plan.py (the header-only plan),
converters/fetch.py (streaming tensor reads, finiteness), converters/report.py (ConversionReport); this module
holds the entry points (prepare, write, verify with the post-check) and re-exports the others' public names.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from converters.errors import ConversionError, ParityCheckFailed
from converters.families import Family, get_family
from converters.fetch import FINITE_CHUNK, _fetch, _fetch_sidecar, _SourceCache, count_nonfinite, has_nonfinite
from converters.manifest import CheckpointManifest
from converters.plan import Plan, PlanEntry, SidecarEntry, SourceRef, plan_conversion
from converters.readers import WeightReader, hash_files, open_weights, torch_dtype
from converters.report import ConversionReport, _components, _renamed, _summaries
from converters.source import (ResolvedSource, _bare_variant, _load_variant, _manifest_of, read_source_config,
                               resolve_source)
from converters.staging import check_output, make_dir, staged_output, staging_name
from converters.writer import (INDEX_NAME, OutTensor, json_bytes, plan_shards, shard_names, write_bytes,
                               write_safetensors)
from manifests.checkpoint import weights_version_of

ENGINE_VERSION = 2
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
REPORT_NAME = "conversion_report.json"
CONFIG_NAME = "config.json"
MANIFEST_NAME = "manifest.json"
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "f32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16"}
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


# the split modules' public names, importable from here as before the split (tests, pipeline, inspect, canonical)
__all__ = ["CONFIG_NAME", "ConversionReport", "DEFAULT_MAX_SHARD_BYTES", "DTYPE_ALIASES", "ENGINE_VERSION",
           "FINITE_CHUNK", "MANIFEST_NAME", "PLACEHOLDER_SEED", "Plan", "PlanEntry", "PostCheck", "Progress",
           "ProgressUpdate", "REPORT_NAME", "ResolvedSource", "SidecarEntry", "SourceRef", "check_output",
           "check_tied_copies", "convert", "convert_diffusers_dir_to_canonical_state_dict", "convert_to_state_dict",
           "count_nonfinite", "has_nonfinite", "normalize_dtype", "plan_conversion", "read_source_config",
           "resolve_source", "staged_output", "write_component"]
