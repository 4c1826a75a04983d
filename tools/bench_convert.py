"""Benchmark fvconvert on a synthetic multi-GB sharded checkpoint: peak memory vs the largest tensor, and GB/s.

    python tools/bench_convert.py                   # ~9.5 GB bf16 diffusers checkpoint (nano widths, 9 layers)
    python tools/bench_convert.py --layers 2        # smaller (~4 GB)
    python tools/bench_convert.py --tmp /scratch --keep

What it does, in one run:
  1. checks free space in --tmp for input + output (if both do not fit, it says so and lowers --layers to
     the largest size that fits);
  2. writes a diffusers-layout sharded checkpoint there, tensor by tensor (cosmos3 nano widths: hidden 4096,
     vocab 151936, so the largest tensor is the 1.16 GiB bf16 embedding, as in the real release), plus its
     config.json;
  3. converts it with `python -m converters cosmos3 --from diffusers ... --skip-parity` in a child process
     (the C0 post-check is skipped: a nano-width model does not run on this CPU in reasonable time);
  4. reports the child's peak RSS (resource.getrusage(RUSAGE_CHILDREN).ru_maxrss) against the bound
     `2 x largest tensor + 1 GiB` (one source tensor, one cast copy, the interpreter + torch) and the
     throughput (checkpoint bytes / wall seconds of the whole conversion, including hashing every input);
  5. deletes everything it wrote (unless --keep).

The input was just written, so most of it is likely still in the page cache: the GB/s is the converter's
own speed, not cold-disk speed. Never run by the test suite (it writes > 8 GB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from converters.writer import OutTensor, write_safetensors  # noqa: E402
from manifests.cosmos3 import canonical_key_shapes, load_variant  # noqa: E402
from tests.test_converters import to_diffusers_key  # noqa: E402  (the documented inverse mapping)

GiB = 2**30


def diffusers_config_for(cfg) -> dict:
    """A diffusers Cosmos3OmniTransformer config.json for our config (inverse of Cosmos3Config.from_diffusers_config)."""
    return {
        "_class_name": "Cosmos3OmniTransformer", "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size, "attention_bias": cfg.attention_bias,
        "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": cfg.hidden_act, "qk_norm_for_text": cfg.qk_norm_for_text,
        "use_und_k_norm_for_gen": cfg.use_und_k_norm_for_gen, "rope_theta": cfg.rope_theta,
        "rope_axes_dim": list(cfg.rope_axes_dim), "latent_channel": cfg.latent_channels,
        "latent_patch_size": cfg.patch_size, "patch_latent_dim": cfg.patch_latent_dim,
        "sound_gen": cfg.has_sound, "sound_dim": cfg.sound_dim, "action_gen": cfg.has_action,
        "action_dim": cfg.action_dim, "num_embodiment_domains": cfg.num_embodiment_domains,
    }


def _mem_total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(layers: int, dtype: torch.dtype):
    import dataclasses

    cfg = dataclasses.replace(load_variant("nano"), num_layers=layers).validate()
    shapes = canonical_key_shapes(cfg)
    item = torch.empty((), dtype=dtype).element_size()
    sizes = {k: math.prod(s) * item for k, s in shapes.items()}
    return cfg, shapes, sizes


def write_source(src: Path, cfg, shapes, dtype: torch.dtype, shard_bytes: int) -> tuple[int, int]:
    """Sharded diffusers checkpoint, written tensor by tensor (values finite and cheap to make)."""
    src.mkdir(parents=True)
    tensors = [OutTensor(to_diffusers_key(k), str(dtype).removeprefix("torch."), tuple(s)) for k, s in shapes.items()]
    shards, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    shards.append(cur)
    n = len(shards)
    wm = {}
    for i, shard in enumerate(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{n:05d}.safetensors"
        write_safetensors(src / name, shard, lambda t: torch.full(t.shape, 0.0078125 * (1 + len(t.key) % 7), dtype=dtype))
        wm.update({t.key: name for t in shard})
        print(f"  wrote {name} ({sum(t.nbytes for t in shard) / 1e9:.2f} GB)", flush=True)
    total = sum(t.nbytes for t in tensors)
    (src / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wm}))
    (src / "config.json").write_text(json.dumps(diffusers_config_for(cfg)))
    return total, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=9, help="decoder layers at nano width (9 -> ~9.5 GB bf16)")
    ap.add_argument("--tmp", default="/tmp", help="where to write input and output (default /tmp)")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="input shard size in GB (default 2)")
    ap.add_argument("--dtype", default=None, help="conversion --dtype (default: keep bf16)")
    ap.add_argument("--keep", action="store_true", help="keep the files (default: delete them)")
    args = ap.parse_args(argv)

    dtype = torch.bfloat16
    cfg, shapes, sizes = plan(args.layers, dtype)
    total = sum(sizes.values())
    out_factor = 2 if args.dtype in ("float32", "fp32") else 1
    free = shutil.disk_usage(args.tmp).free
    need = total * (1 + out_factor) + GiB
    note = ""
    if need > free:
        layers = args.layers
        while layers > 1:
            layers -= 1
            _, shapes, sizes = plan(layers, dtype)
            if sum(sizes.values()) * (1 + out_factor) + GiB <= free:
                break
        note = (f"only {free / 1e9:.1f} GB free in {args.tmp}: input + output of {total / 1e9:.1f} GB do not fit; "
                f"measuring {layers} layers instead")
        print(note)
        cfg, shapes, sizes = plan(layers, dtype)
        total = sum(sizes.values())
    largest_key = max(sizes, key=sizes.get)
    largest = sizes[largest_key]
    bound = 2 * largest + GiB

    work = Path(tempfile.mkdtemp(prefix="fvconvert-bench-", dir=args.tmp))
    try:
        src, out = work / "src", work / "out"
        print(f"writing a {total / 1e9:.2f} GB synthetic cosmos3 diffusers checkpoint ({cfg.num_layers} layers at nano "
              f"width, {len(shapes)} tensors) to {src}", flush=True)
        t0 = time.time()
        total, n_shards = write_source(src, cfg, shapes, dtype, int(args.shard_gb * 1e9))
        print(f"  {time.time() - t0:.1f}s", flush=True)
        cmd = [sys.executable, "-m", "converters", "cosmos3", "--from", "diffusers", str(src), str(out),
               "--skip-parity", "-q"] + (["--dtype", args.dtype] if args.dtype else [])
        print("converting: " + " ".join(cmd), flush=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        load0 = os.getloadavg()[0]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.time() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024   # Linux: KiB
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr)
            print(f"conversion failed (exit {proc.returncode})")
            return 1
        report = json.loads((out / "conversion_report.json").read_text())
        out_bytes = report["shapes"]["output_bytes"]
        ok = peak <= bound
        rows = [
            ("date (UTC)", time.strftime("%Y-%m-%d %H:%M", time.gmtime())),
            ("machine", f"{platform.machine()}, {os.cpu_count()} cores, {_mem_total() / GiB:.1f} GiB RAM, "
                        f"{platform.python_implementation()} {platform.python_version()}, torch {torch.__version__}; "
                        f"load average {load0:.1f} before / {os.getloadavg()[0]:.1f} after the conversion"),
            ("checkpoint", f"{total / 1e9:.2f} GB bf16 in {n_shards} shards, {len(shapes)} tensors "
                           f"({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size})"),
            ("output", f"{out_bytes / 1e9:.2f} GB in "
                       f"{sum(o['path'].endswith('.safetensors') for o in report['outputs'])} safetensors file(s)"
                       + (f", cast to {args.dtype}" if args.dtype else "")),
            ("largest tensor", f"{largest_key} {list(shapes[largest_key])} = {largest / GiB:.2f} GiB"),
            ("peak RSS (child)", f"{peak / GiB:.2f} GiB = {peak / largest:.2f} x largest tensor "
                                 f"({peak / total * 100:.1f}% of the checkpoint)"),
            ("bound", f"2 x largest + 1 GiB = {bound / GiB:.2f} GiB: {'HOLDS' if ok else 'EXCEEDED'}"),
            ("wall", f"{wall:.1f}s for the whole conversion (start-up, sha256 of every input, read, write, fsync)"),
            ("throughput", f"{total / 1e9 / wall:.2f} GB/s end to end; writing phase "
                           f"{report['throughput']['gb_per_s']:.2f} GB/s ({report['throughput']['write_s']:.1f}s)"),
        ]
        if before:
            rows.append(("note", f"an earlier child had peak RSS {before * 1024 / GiB:.2f} GiB"))
        if note:
            rows.append(("note", note))
        w = max(len(r[0]) for r in rows)
        print("\nfvconvert memory/throughput benchmark")
        for k, v in rows:
            print(f"  {k:<{w}}  {v}")
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
