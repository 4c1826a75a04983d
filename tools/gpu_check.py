"""All GPU checks in one call (for a lent accelerator): parity on CUDA, then benchmarks at larger sizes.

    python tools/gpu_check.py --out "$OUT"            # on the GPU machine, from the repo root
    python tools/gpu_check.py --device cpu --quick    # dry run of the same sequence on CPU

Each step is a subprocess with its own time limit; its output goes to OUT/<step>.log and a summary table
(step, exit code, seconds) is printed and written to OUT/summary.json. A failing step does not stop the rest.
Nothing here has run on a GPU yet (no device was lent to the session that wrote it): expect the first run to
surface device-placement bugs, which is its purpose.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def steps(device: str, quick: bool) -> list[tuple[str, list[str], int]]:
    py = sys.executable
    fv = [py, "-m", "parity.cli"]
    big = [] if quick else ["--hidden", "2048", "--layers", "8", "--text-len", "256", "--hw", "30", "40",
                            "--frames", "6", "--steps", "8"]
    return [
        ("c0_fp32", fv + ["run", "cosmos3", "--level", "C0", "--device", device, "--dtype", "fp32"], 600),
        ("c0_bf16", fv + ["run", "cosmos3", "--level", "C0", "--device", device, "--dtype", "bf16"], 600),
        ("c1_fp32", fv + ["run", "cosmos3", "--level", "C1", "--device", device, "--dtype", "fp32"], 900),
        ("c1_bf16", fv + ["run", "cosmos3", "--level", "C1", "--device", device, "--dtype", "bf16"], 900),
        ("wan_c0", fv + ["run", "wan", "--level", "C0", "--device", device], 600),
        ("bench_loop", [py, "tools/bench_loop.py", "--device", device, "--dtype", "bf16" if device != "cpu"
                        else "fp32", *big], 900),
        ("bench_vae", [py, "tools/bench_vae.py", "--device", device] + ([] if quick else
                                                                         ["--variant", "wan2.2", "--frames", "6",
                                                                          "--hw", "16", "16"]), 900),
        # captured step bodies: C1 with CUDA graphs (replay vs eager is bitwise; vs reference at the C1 tolerance),
        # the real-capture unit tests, and the compiled path
        ("c1_graph_cuda", fv + ["run", "cosmos3", "--level", "C1", "--device", device, "--dtype", "fp32",
                                "--graph", "cuda" if device != "cpu" else "eager"], 900),
        ("c1_graph_compile", fv + ["run", "cosmos3", "--level", "C1", "--device", device, "--dtype", "fp32",
                                   "--graph", "compile"], 900),
        ("wan_c1_graph_cuda", fv + ["run", "wan", "--level", "C1", "--device", device, "--variant", "tiny-2.1-t2v",
                                    "--graph", "cuda" if device != "cpu" else "eager"], 900),
        ("capture_tests", [py, "-m", "pytest", "-q", "-p", "no:xdist", "tests/test_compile.py", "-m", "gpu or not slow"],
         600),
        # the peer at released sizes, random weights (upstream extra): Cosmos3-Nano 720p, Wan2.1 VAE 480p 81 frames
        ("bench_vs_diffusers", [py, "tools/bench_vs_diffusers.py", "--device", device, "--repeats", "3",
                                "--threads", "16", "--graph", "eager", "compile", "cuda"] +
         (["--dtype", "bf16", "--released"] if not quick else ["--hidden", "128", "--layers", "2", "--height", "64",
                                                               "--width", "64", "--steps", "2"])
         if device != "cpu" else [py, "tools/bench_vs_diffusers.py", "--graph", "eager", "--hidden", "128",
                                  "--layers", "2", "--height", "64", "--width", "64", "--steps", "2", "--repeats",
                                  "1", "--vae-frames", "2", "--vae-hw", "8", "8"], 1500),
        ("mfu", [py, "tools/gpu_check.py", "--mfu", "--device", device] + (["--quick"] if quick else []), 900),
    ]


# H200 SXM dense bf16 tensor-core peak (NVIDIA datasheet: 1,979 TFLOPS with sparsity, half that dense)
H200_DENSE_BF16_FLOPS = 989e12


def step_flops(cfg, tokens: int, text: int, batch: int) -> float:
    """Matmul FLOPs of one cosmos3 gen-stream forward (projections, MLP, attention; the und stream cached)."""
    D, H, K, d, I, L = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                        cfg.num_layers)
    mlp_in = 2 * I if cfg.hidden_act == "silu" else I
    proj = 2 * tokens * D * ((H + 2 * K) * d + H * d + mlp_in) + 2 * tokens * I * D
    attn = 4 * tokens * (tokens + text) * H * d
    return batch * L * (proj + attn)


def mfu(device: str, quick: bool) -> None:
    """MFU per denoise step of the engine (Cosmos3-Nano geometry, random weights, 720p 121 frames, CFG batched,
    bf16) in each graph mode, against the H200's dense bf16 peak."""
    import torch
    from manifests.cosmos3 import load_variant
    from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig
    from optimized import Engine

    cfg = load_variant("tiny" if quick else "nano")
    T, H, W = (2, 4, 6) if quick else (31, 45, 80)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    for mode in (["eager", "compile"] + (["cuda"] if device != "cpu" else [])):
        eng = Engine.from_variant("tiny" if quick else "nano", device=device, dtype=dtype)
        eng.model.configure_graph(mode, cfg_policy="batched")
        g = torch.Generator().manual_seed(0)
        req = Cosmos3GenerateRequest(text_ids=torch.randint(0, cfg.vocab_size, (256,), generator=g),
                                     negative_text_ids=torch.randint(0, cfg.vocab_size, (64,), generator=g),
                                     latent_frames=T, latent_height=H, latent_width=W, num_steps=4,
                                     guidance_scale=5.0, seed=0, scheduler=UniPCConfig(flow_shift=10.0))
        h = eng.submit(req)
        eng.run_until_idle()
        steps = [e.data for e in h.events if e.kind == "trace.step"][1:]  # step 0: und stream + build/compile
        tokens = T * -(-H // cfg.patch_size) * -(-W // cfg.patch_size)
        flops = step_flops(cfg, tokens, 256, 2)
        for s in steps:
            rate = flops / s["seconds"]
            print(f"mfu {mode:8s} step {s['step']} {s['seconds'] * 1e3:9.1f} ms  {rate / 1e12:8.1f} TFLOP/s  "
                  f"MFU {rate / H200_DENSE_BF16_FLOPS:6.1%}  ({s.get('graph')}, {s.get('bucket')}, "
                  f"{s.get('graph_cache')})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a CPU dry run)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these steps")
    ap.add_argument("--mfu", action="store_true", help="(internal step) print MFU per denoise step and exit")
    args = ap.parse_args()
    if args.mfu:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        mfu(args.device, args.quick)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for name, cmd, limit in steps(args.device, args.quick):
        if args.only and name not in args.only:
            continue
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            rc, text, verdict = proc.returncode, proc.stdout + proc.stderr, proc.stdout or proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = 124, f"timed out after {limit} s\n{e.stdout or ''}{e.stderr or ''}"
            verdict = text
        seconds = time.monotonic() - t0
        (args.out / f"{name}.log").write_text(text)
        last = [line for line in verdict.strip().splitlines() if line.strip()][-1:] or [""]
        summary.append({"step": name, "rc": rc, "seconds": round(seconds, 1), "last_line": last[0][:160]})
        print(f"{name:12s} rc={rc:<4d} {seconds:7.1f}s  {last[0][:120]}", flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
