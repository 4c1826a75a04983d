"""Planted faults in the parallel runtime (negative controls), by one mechanism: a context manager that replaces a
function / method at a seam the production module declares, and restores it on exit. Nothing in optimized/ knows
about faults; a spawned rank applies the named patch itself (in its worker function, or for torchrun launches
through this module's entry point, which patches and then runs the launcher in the same process):

    python -m torch.distributed.run --nproc-per-node 2 -m parity.parallel_faults rank-exit:1 \\
        optimized.parallel.launch --variant tiny-2.1-t2v --plan cfgp2 ...

Seams and faults:
    optimized.parallel.sp.split_head_groups     ulysses-heads-permuted   head group d sent to rank d + 1 (forward
                                                                          all-to-all only; the inverse is right)
    optimized.parallel.sp.sequence_to_heads     ulysses-heads-interleaved  the inverse all-to-all lays the heads out
                                                                          interleaved (head j of group g at j * n + g,
                                                                          not g * H / n + j): invisible at one head
                                                                          per rank
    optimized.parallel.sp.attention_lse         ring-no-max-shift        ring partials as raw exp sums (no max)
    CFGParallel.branch_rows                     cfg-branches-swapped     rank r runs rank n-1-r's rows
    CFGParallel.run                             cfg-rows-halved          the gathered predictions split in half (cond
                                                                          = the first half), not by branch: right
                                                                          only while every row of the batch is guided
    optimized.parallel.tp.column_shard          tp-column-wrong-slice    column shards from rank r + 1's slice
    AxisGroup.broadcast_object                  rank-exit:R / rank-hang:R / rank-raise:R   rank R dies / hangs /
                                                                          raises when the requests are broadcast
Family-specific parallel faults live with the family and plant through `patched` here (wan's tp-wrong-slice at
parallelize.tp_slice, pad-keys-not-masked at transformer.key_mask_shard: parity/families/wan/faults.py).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
from typing import Callable
from parity.patching import patched  # noqa: F401 (re-exported: the one planting helper)


def _heads_permuted():
    from optimized.parallel import sp
    return patched(sp, "split_head_groups", lambda original: lambda x, n: original(x, n).roll(1, dims=0))


def _heads_interleaved():
    from optimized.parallel import sp

    def make(original):
        def interleaved(y, group):
            out = original(y, group)
            n = group.world_size
            B, S, H, D = out.shape
            return out.reshape(B, S, n, H // n, D).transpose(2, 3).reshape(B, S, H, D)
        return interleaved
    return patched(sp, "sequence_to_heads", make)


def _ring_no_max_shift():
    import torch

    from optimized.parallel import sp

    def make(original):
        def raw_exp_sums(q, k, v, key_mask, scale):
            """Partial attention from raw exp sums: exp(s) overflows at large logits (no running max)."""
            H = q.shape[2]
            kh = k.repeat_interleave(H // k.shape[2], 2).transpose(1, 2).float()
            vh = v.repeat_interleave(H // v.shape[2], 2).transpose(1, 2).float()
            p = torch.exp((q.transpose(1, 2).float() @ kh.transpose(-1, -2)) * scale)
            if key_mask is not None:
                p = p.masked_fill(~key_mask[:, None, None, :], 0.0)
            den = p.sum(-1, keepdim=True)
            return ((p @ vh) / den).to(q.dtype).transpose(1, 2), den.log().squeeze(-1)
        return raw_exp_sums
    return patched(sp, "attention_lse", make)


def _cfg_branches_swapped():
    from optimized.parallel.cfg_parallel import CFGParallel, split_rows

    def make(original):
        def swapped(self, n_rows):
            n = self.group.world_size
            return split_rows(n_rows, n)[n - 1 - self.group.rank]
        return swapped
    return patched(CFGParallel, "branch_rows", make)


def _cfg_rows_halved():
    from optimized.parallel.cfg_parallel import CFGParallel

    def make(original):
        def halved(self, forward_batch, cond, uncond):
            got_cond, got_uncond = original(self, forward_batch, cond, uncond)
            if self.group.world_size == 1 or len(cond) + len(uncond) < self.group.world_size:
                return got_cond, got_uncond   # the replicated path (BatchedCFG) is left right
            preds = got_cond + got_uncond
            return preds[: len(preds) // 2], preds[len(preds) // 2:]
        return halved
    return patched(CFGParallel, "run", make)


def _tp_column_wrong_slice():
    from optimized.parallel import tp

    def make(original):
        def wrong(w, group):
            n = group.world_size
            return w.narrow(0, (group.rank + 1) % n * (w.shape[0] // n), w.shape[0] // n)
        return wrong
    return patched(tp, "column_shard", make)


def _rank_failure(kind: str, who: int):
    import torch.distributed as dist

    from optimized.parallel.group import AxisGroup

    def make(original):
        def broadcast_object(self, obj, src=0):
            if dist.is_initialized() and dist.get_rank() == who:
                if kind == "exit":      # a crash: no goodbye in the store
                    os._exit(3)
                if kind == "hang":      # alive (heartbeats continue) but never reaches the collective
                    time.sleep(10_000)
                raise RuntimeError(f"planted failure on rank {who}")
            return original(self, obj, src)
        return broadcast_object
    return patched(AxisGroup, "broadcast_object", make)


FAULTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "ulysses-heads-permuted": _heads_permuted,
    "ulysses-heads-interleaved": _heads_interleaved,
    "ring-no-max-shift": _ring_no_max_shift,
    "cfg-branches-swapped": _cfg_branches_swapped,
    "cfg-rows-halved": _cfg_rows_halved,
    "tp-column-wrong-slice": _tp_column_wrong_slice,
}
RANK_FAULTS = ("rank-exit", "rank-hang", "rank-raise")


def planted(name: str | None) -> contextlib.AbstractContextManager:
    """The named fault's patch (`rank-exit:1` style for the rank faults); a no-op for None / ""."""
    if not name:
        return contextlib.nullcontext()
    kind, _, who = name.partition(":")
    if kind in RANK_FAULTS and who.isdigit():
        return _rank_failure(kind.removeprefix("rank-"), int(who))
    if name not in FAULTS:
        raise KeyError(f"unknown parallel fault {name!r}; known: {', '.join(FAULTS)}, "
                       f"{', '.join(k + ':RANK' for k in RANK_FAULTS)}")
    return FAULTS[name]()


def main(argv: list[str]) -> int:
    """FAULT MODULE [ARGS...]: run `python -m MODULE ARGS` in this process with FAULT planted."""
    if len(argv) < 2:
        print("usage: python -m parity.parallel_faults FAULT MODULE [ARGS...]", file=sys.stderr)
        return 2
    fault, module, rest = argv[0], argv[1], argv[2:]
    sys.argv = [module] + rest
    with planted(fault):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
