"""GPU check for sparse attention: FlexAttention sliding-tile kernel vs dense SDPA at a released Wan size.

    python3 tools/gpu_sparse_check.py --out "$OUT"                       # on the GPU machine: Wan2.1 1.3B, 480p
    python tools/gpu_sparse_check.py --device cpu --quick --out /tmp/sc  # dry run of the same code on CPU

UNMEASURED: no GPU has been lent to the session that wrote this; expect the first run to surface device bugs.
The step tools/gpu_check.py should run (it is shared; the request is in the sparse work's report):
    ("sparse_kernel", [py, "tools/gpu_sparse_check.py", "--device", device, "--out", str(out)]
                      + (["--quick"] if quick else []), 600)

Size: Wan2.1 T2V 1.3B (12 heads, head_dim 128), 81 frames at 480 x 832: latent 21 x 60 x 104, post-patch grid
21 x 30 x 52 = 32760 tokens, bf16, batch 1; the `sta` kind's default knobs (tile 6 x 8 x 8, window 1 per axis: the
published STA tile and a 3 x 3 x 3 kernel; partial last tiles on this grid). Timed: dense SDPA (PyTorch's choice of
kernel, flash on an H200) and the engine's sta flex backend compiled (torch.compile(flex_attention), the fused
kernel that skips the BlockMask's empty blocks); median of --repeats after a warm-up, CUDA-synchronised. Checked:
the flex output against the sdpa backend's dense boolean mask on --check-heads heads (max |diff| <= 2e-2 in bf16,
exit 1 otherwise). Writes OUT/sparse_check.json; exit 0 ok, 1 mismatch, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RELEASED = {"grid": (21, 30, 52), "heads": 12, "head_dim": 128, "accel": "sta"}   # Wan2.1 T2V 1.3B, 81 x 480 x 832
QUICK = {"grid": (4, 16, 16), "heads": 2, "head_dim": 32,          # the default tile would cover this grid whole
         "accel": "sta:tile_t=1,tile_h=8,tile_w=8,window_t=1,window_h=0,window_w=0"}
BF16_TOLERANCE = 2e-2


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_seconds(fn, repeats: int, device: str) -> tuple[float, float]:
    """(median of `repeats` timed calls, the warm-up call's time)."""
    t = time.perf_counter()
    fn()
    _sync(device)
    warm = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), warm


def sparse_kernel_check(device: str = "cuda", *, quick: bool = False, dtype: torch.dtype = torch.bfloat16,
                        repeats: int = 5, check_heads: int = 1, accel: str | None = None) -> dict:
    """Time dense SDPA vs the sta flex kernel at the released size (or QUICK) and check the flex output."""
    from manifests.accel import make_spec, parse_accel
    from manifests.accel.sparse import StaParams
    from optimized.accel import sparse as engine

    size = QUICK if quick else RELEASED
    grid, heads, head_dim = size["grid"], size["heads"], size["head_dim"]
    base = parse_accel(accel or size["accel"])
    flex = make_spec(base.name, dict(base.knobs, backend="flex"))
    sdpa = make_spec(base.name, dict(base.knobs, backend="sdpa"))
    compile_flex = device.startswith("cuda")          # eager on the CPU dry run (compiling costs ~30 s there)
    S = math.prod(grid)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, S, heads, head_dim, generator=g).to(device, dtype) for _ in range(3))

    def dense():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

    with torch.no_grad():
        dense_s, dense_warm = _median_seconds(dense, repeats, device)
        flex_s, flex_warm = _median_seconds(
            lambda: engine.sparse_self_attention(q, k, v, grid, flex, compile_flex=compile_flex), repeats, device)
        out, removed = engine.sparse_self_attention(q, k, v, grid, flex, compile_flex=compile_flex)
        h = max(1, min(check_heads, heads))
        want, _ = engine.sparse_self_attention(q[:, :, :h].contiguous(), k[:, :, :h].contiguous(),
                                               v[:, :, :h].contiguous(), grid, sdpa)
        max_abs = (out[:, :, :h].float() - want.float()).abs().max().item()
    stats = engine.flex_block_stats(grid, flex, q.device)
    tol = BF16_TOLERANCE if dtype == torch.bfloat16 else 1e-5
    return {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else device,
        "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "grid": list(grid), "tokens": S,
        "heads": heads, "head_dim": head_dim, "accel": flex.label(),
        "params": {"tile": list(StaParams.from_spec(flex).tile), "window": list(StaParams.from_spec(flex).window)},
        "flex_compiled": compile_flex,
        "dense_ms": dense_s * 1e3, "flex_ms": flex_s * 1e3, "dense_over_flex": dense_s / flex_s,
        "dense_warmup_s": dense_warm, "flex_warmup_s": flex_warm,
        "pairs_removed_fraction": removed / (S * S * heads),
        "blocks_skipped_fraction": stats["blocks_skipped"] / stats["blocks"],
        "pairs_skipped_by_kernel_fraction": stats["pairs_skipped_by_kernel"] / (S * S),
        "check_heads": h, "max_abs_flex_vs_sdpa_mask": max_abs, "tolerance": tol, "passed": max_abs <= tol,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True, help="folder for sparse_check.json")
    ap.add_argument("--quick", action="store_true", help="a small grid (the CPU dry run)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--check-heads", type=int, default=1, help="heads checked against the dense boolean mask")
    ap.add_argument("--accel", help="sta[:knob=value,...] (backend is set per row; default: the size's own)")
    args = ap.parse_args(argv)
    from manifests.accel import AccelSpecError
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("error: --repeats must be >= 1", file=sys.stderr)
        return 2
    try:
        result = sparse_kernel_check(args.device, quick=args.quick, repeats=args.repeats,
                                     dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype],
                                     check_heads=args.check_heads, accel=args.accel)
    except AccelSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse_check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"sparse kernel check {result['device']} {result['dtype']}: grid {tuple(result['grid'])} "
          f"({result['tokens']} tokens), {result['accel']}")
    print(f"  dense SDPA {result['dense_ms']:.2f} ms, sta flex{' (compiled)' if result['flex_compiled'] else ''} "
          f"{result['flex_ms']:.2f} ms: dense / flex {result['dense_over_flex']:.2f}x; mask removes "
          f"{result['pairs_removed_fraction']:.1%}, kernel skips {result['pairs_skipped_by_kernel_fraction']:.1%}")
    print(f"  flex vs dense-mask sdpa on {result['check_heads']} head(s): max |diff| "
          f"{result['max_abs_flex_vs_sdpa_mask']:.2e} (tolerance {result['tolerance']:g}) "
          f"{'ok' if result['passed'] else 'MISMATCH'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
