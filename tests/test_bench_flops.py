"""bench_vs_diffusers' ceiling counts attention FLOPs on CPU, which torch's FlopCounterMode does not know: the count
it registers for the CPU flash-SDPA kernel must equal the count of the same attention written as explicit matmuls
(counted by torch itself), GQA included. Negative control: without the registration the SDPA call counts nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_cpu_sdpa_counts_as_its_matmuls_with_gqa_and_pad_keys():
    q, k, v = torch.randn(2, 8, 40, 16), torch.randn(2, 4, 56, 16), torch.randn(2, 4, 56, 16)
    mask = torch.ones(2, 1, 40, 56, dtype=torch.bool)
    mask[1, ..., 50:] = False  # pad keys: executed, so counted

    def explicit():
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        p = torch.softmax((q @ kk.transpose(-1, -2) / 4.0).masked_fill(~mask, float("-inf")), -1)  # 1/sqrt(16)
        return p @ vv

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    from torch.utils.flop_counter import flop_registry
    registered = flop_registry.pop(op, None)   # a fresh process state whatever ran before
    try:
        assert _count(sdpa) == 0                 # the control: torch alone does not count this kernel
        import bench_vs_diffusers as bench
        assert bench.counted_flops(sdpa) == _count(explicit) > 0
        assert torch.allclose(sdpa(), explicit(), atol=1e-5)   # the two really are the same attention
    finally:
        flop_registry.pop(op, None)
        if registered is not None:
            flop_registry[op] = registered
