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
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a CPU dry run)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these steps")
    args = ap.parse_args()
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
