"""All GPU checks in one call (for a lent accelerator), most important first, inside a wall-clock budget.

    python3 tools/gpu_check.py --out "$OUT" --budget-s 500 --wheels wheels   # on the GPU machine, repo root
    python tools/gpu_check.py --device cpu --quick --out /tmp/gc              # dry run of the same sequence on CPU

The device tool gives one command at most 10 minutes, 15 minutes of device time in all, and brings back at most 8
files from $OUT, so: steps run in priority order (the environment, the capture interleave check, C1 with CUDA
graphs, the capture tests, bf16 parity, the peer at released sizes, MFU, then the rest); a step starts only while
--budget-s leaves it at least --min-step-s, and is cut at what is left; all output goes to ONE log
(OUT/gpu_check.log, a header per step) and OUT/summary.json is rewritten after every step, so a run cut short
still brings back what finished. A failing step does not stop the rest. The device image has torch but not
diffusers: `pip download diffusers==0.42.1 --no-deps -d wheels` here (wheels/ is git-ignored; carry it), and
--wheels installs it there first (no index, no deps).
Nothing here has run on a GPU yet (no device was lent to the sessions that wrote it): expect the first run to
surface device-placement bugs, which is its purpose.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path


def steps(device: str, quick: bool, wheels: Path | None = None,
          out: Path = Path("gpu_check_out")) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in s), in the order they run: what the open issue needs from a GPU first."""
    py = sys.executable
    fv = [py, "-m", "parity.cli"]
    big = [] if quick else ["--hidden", "2048", "--layers", "8", "--text-len", "256", "--hw", "30", "40",
                            "--frames", "6", "--steps", "8"]
    graph = "cuda" if device != "cpu" else "eager"
    env = [py, "-c", "import torch, sys; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), "
                     "torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'python', sys.version)"]
    if wheels is not None:  # the device image lacks the upstream extra: install the carried wheels, then report
        env = ["sh", "-c", f"{shlex.quote(py)} -m pip install -q --no-index --no-deps {shlex.quote(str(wheels))}/*.whl"
                           f" && {shlex.join(env)}"]
    return [
        ("env", env, 120),
        # issue 22: two callers' replays of one bucket interleaved through real CUDA graphs (a toy body, each
        # planted capture fault must fail it); C1 below runs the same check on every family step body that captures
        ("capture_interleave", [py, "-m", "pytest", "-q", "-p", "no:xdist", "tests/test_capture_interleave.py"],
         300),
        # captured step bodies: C1 with CUDA graphs (replay vs eager is bitwise; vs reference at the C1 tolerance),
        # the real-capture unit tests, wan's captured DiT steps
        ("c1_graph_cuda", fv + ["run", "cosmos3", "--level", "C1", "--device", device, "--dtype", "fp32",
                                "--graph", graph], 900),
        ("capture_tests", [py, "-m", "pytest", "-q", "-p", "no:xdist", "tests/test_compile.py", "-m", "gpu or not slow"],
         600),
        ("wan_c1_graph_cuda", fv + ["run", "wan", "--level", "C1", "--device", device, "--variant", "tiny-2.1-t2v",
                                    "--graph", graph], 900),
        # bf16 on CUDA: the contract's bf16 tolerances were measured on CPU only
        ("c0_bf16", fv + ["run", "cosmos3", "--level", "C0", "--device", device, "--dtype", "bf16"], 600),
        ("c1_bf16", fv + ["run", "cosmos3", "--level", "C1", "--device", device, "--dtype", "bf16"], 900),
        # the peer at released sizes, random weights (upstream extra): Cosmos3-Nano 720p, Wan2.1 VAE 480p 81 frames
        ("bench_vs_diffusers", [py, "tools/bench_vs_diffusers.py", "--device", device, "--repeats", "3",
                                "--threads", "16", "--graph", "eager", "compile", "cuda"] +
         (["--dtype", "bf16", "--released", "--concurrent", "2"] if not quick else
          ["--hidden", "128", "--layers", "2", "--height", "64", "--width", "64", "--steps", "2"])
         if device != "cpu" else [py, "tools/bench_vs_diffusers.py", "--graph", "eager", "--hidden", "128",
                                  "--layers", "2", "--height", "64", "--width", "64", "--steps", "2", "--repeats",
                                  "1", "--concurrent", "2", "--vae-frames", "2", "--vae-hw", "8", "8"], 1500),
        # issue 21 (unmeasured so far): sparse attention kernel speed, FlexAttention sta vs dense SDPA at Wan2.1
        # 1.3B 480p, the flex output checked against the dense boolean mask (exit 1 on mismatch)
        ("sparse_kernel", [py, "tools/gpu_sparse_check.py", "--device", device, "--out", str(out / "sparse")]
         + (["--quick"] if quick else []), 600),
        ("mfu", [py, "tools/gpu_check.py", "--mfu", "--device", device] + (["--quick"] if quick else []), 900),
        ("c1_graph_compile", fv + ["run", "cosmos3", "--level", "C1", "--device", device, "--dtype", "fp32",
                                   "--graph", "compile"], 900),
        ("c0_fp32", fv + ["run", "cosmos3", "--level", "C0", "--device", device, "--dtype", "fp32"], 600),
        ("c1_fp32", fv + ["run", "cosmos3", "--level", "C1", "--device", device, "--dtype", "fp32"], 900),
        ("wan_c0", fv + ["run", "wan", "--level", "C0", "--device", device], 600),
        ("bench_loop", [py, "tools/bench_loop.py", "--device", device, "--dtype", "bf16" if device != "cpu"
                        else "fp32", *big], 900),
        ("bench_vae", [py, "tools/bench_vae.py", "--device", device] + ([] if quick else
                                                                         ["--variant", "wan2.2", "--frames", "6",
                                                                          "--hw", "16", "16"]), 900),
        # issue 25 (memory plane; unmeasured on CUDA so far): torch.cuda.max_memory_allocated per offload mode,
        # pinned-host prefetch on a side stream, bitwise equal to the resident run (exit 1 when not)
        ("bench_memory", [py, "tools/bench_memory.py", "--device", device] +
         ([] if quick else ["--layers", "16", "--size", "128x128", "--frames", "9", "--steps", "4"]), 600),
    ]


def run_steps(step_list: list[tuple[str, list[str], int]], out: Path, budget_s: float | None, min_step_s: float,
              clock=time.monotonic, runner=subprocess.run) -> list[dict]:
    """Run the steps in order within `budget_s` (None: no budget): a step starts only with `min_step_s` left and is
    cut at what is left. Every step's output is appended to out/gpu_check.log; out/summary.json is rewritten after
    each step (skipped steps included, with why), so whatever finished survives a run cut short."""
    out.mkdir(parents=True, exist_ok=True)
    log, summary = out / "gpu_check.log", []
    log.write_text("")
    t_start = clock()
    for name, cmd, limit in step_list:
        left = None if budget_s is None else budget_s - (clock() - t_start)
        if left is not None and left < min_step_s:
            summary.append({"step": name, "rc": None, "seconds": 0.0, "last_line": f"skipped: {left:.0f} s of the "
                            f"budget left (< {min_step_s:.0f})"})
            print(f"{name:18s} skipped (budget)", flush=True)
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            continue
        timeout = limit if left is None else max(1, min(limit, int(left)))
        t0 = clock()
        try:
            proc = runner(cmd, capture_output=True, text=True, timeout=timeout)
            rc, text, verdict = proc.returncode, proc.stdout + proc.stderr, proc.stdout or proc.stderr
        except subprocess.TimeoutExpired as e:
            partial = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                              for x in (e.stdout, e.stderr))
            rc, text = 124, f"{partial}\ntimed out after {timeout} s"
            verdict = text
        except OSError as e:  # a command that cannot start is this step's failure, not the run's
            rc, text = 127, f"cannot start {cmd[0]}: {e}"
            verdict = text
        seconds = clock() - t0
        with log.open("a") as f:
            f.write(f"===== {name}: rc={rc} {seconds:.1f}s  {' '.join(cmd)}\n{text}\n")
        last = [line for line in verdict.strip().splitlines() if line.strip()][-1:] or [""]
        summary.append({"step": name, "rc": rc, "seconds": round(seconds, 1), "last_line": last[0][:160]})
        print(f"{name:18s} rc={rc:<4d} {seconds:7.1f}s  {last[0][:120]}", flush=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


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
        eng = Engine.from_variant("cosmos3:tiny" if quick else "cosmos3:nano", device=device, dtype=dtype)
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
    ap.add_argument("--only", nargs="*", default=None, help="run only these steps (names as in the summary)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget for all steps (leave the device call's limit some slack)")
    ap.add_argument("--min-step-s", type=float, default=45.0, help="do not start a step with less than this left")
    ap.add_argument("--wheels", type=Path, default=None,
                    help="a folder of wheels to install first (no index, no deps): diffusers for the device image")
    ap.add_argument("--mfu", action="store_true", help="(internal step) print MFU per denoise step and exit")
    args = ap.parse_args()
    if args.mfu:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        mfu(args.device, args.quick)
        return
    wanted = [st for st in steps(args.device, args.quick, args.wheels, args.out) if not args.only or st[0] in args.only]
    unknown = set(args.only or ()) - {st[0] for st in steps(args.device, args.quick)}
    if unknown:
        print(f"gpu_check: unknown step(s) {', '.join(sorted(unknown))}; the steps are "
              f"{', '.join(st[0] for st in steps(args.device, args.quick))}", file=sys.stderr)
        sys.exit(2)
    if args.wheels is not None and not sorted(args.wheels.glob("*.whl")):
        print(f"gpu_check: --wheels {args.wheels}: no .whl files there", file=sys.stderr)
        sys.exit(2)
    summary = run_steps(wanted, args.out, args.budget_s, args.min_step_s)
    sys.exit(0 if all(r["rc"] in (0, None) for r in summary) else 1)


if __name__ == "__main__":
    main()
