"""seedvr2's planted faults (negative controls): each breaks the optimized side in one known place; C0 must FAIL
and name the layer (`FAULTS_INFO`), C1 fails on the restoration.

One mechanism: a context manager that patches a function / method at a declared seam and restores it on exit;
production code carries no fault flags. Seams (all in optimized/models/seedvr2/):
`windows.build_geometry` (the window geometry the plan cache builds), `windows.PlanCache.key` (the plan cache
key), `model.FastNaDiT.window_text_sum` (the per-sample text sum before the mean over windows) and
`model.FastNaDiT.ensure_layout` (the layout transition into a layer). Planted around a freshly loaded model, in
the process that runs it (each spawned SP rank plants its own): the model's plan cache is emptied on entry and
exit so no plan built under a fault outlives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

from parity.errors import SetupError
from parity.patching import patched as _patched

# fault name -> (what it breaks, the canonical name the harness must report); planted at any level
FAULTS_INFO = {
    "cyclic-shift": ("shifted windows made cyclic (torch.roll) instead of clipped", "blocks.1"),
    "token-weighted-text": ("text mean over windows weighted by window token counts", "blocks.0"),
    "plan-cache-ignores-world-size": ("plan cache key without the SP world size", "blocks.0"),
    "skipped-transition": ("the layout transition into layer 1 skipped", "blocks.1"),
}
FAULTS = tuple(FAULTS_INFO)
SKIPPED_TRANSITION_LAYER = 1


def check_fault(fault: str | None) -> None:
    if fault is not None and fault not in FAULTS_INFO:
        raise SetupError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")


def _cyclic_shift():
    """The shifted layout as the regular windows of a grid rolled by half a window (Swin's torch.roll), not
    upstream's clipped half-window cuts."""
    from optimized.models.seedvr2 import windows

    def rolled(original):
        def build_geometry(grids, num_windows, method):
            if method != "shifted":
                return original(grids, num_windows, method)
            g = original(grids, num_windows, "regular")
            perm, offset = [], 0
            for grid in grids:
                kt, kh, kw = windows.window_extent(grid, num_windows)
                canon = torch.arange(grid[0] * grid[1] * grid[2]).view(grid)
                perm.append(torch.roll(canon, shifts=(kt // 2, kh // 2, kw // 2), dims=(0, 1, 2)).reshape(-1) + offset)
                offset += canon.numel()
            return dataclasses.replace(g, method="shifted", token_ids=torch.cat(perm)[g.token_ids])
        return build_geometry
    return _patched(windows, "build_geometry", rolled)


def _token_weighted_text():
    """Each window's text output weighted by its share of the sample's video tokens (times the window count, so
    equal windows give the plain mean): the token-weighted mean instead of upstream's plain mean."""
    from optimized.models.seedvr2.model import FastNaDiT

    def weighted(original):
        def window_text_sum(self, txt_out, layout, sample, window_tokens):
            g = layout.plan.geometry
            tokens = sum(n for (s, _), n in zip(g.boxes, g.window_tokens) if s == sample)
            w = window_tokens / float(tokens) * float(layout.windows_per_sample[sample])
            return original(self, txt_out, layout, sample, window_tokens) * w
        return window_text_sum
    return _patched(FastNaDiT, "window_text_sum", weighted)


def _plan_cache_ignores_world_size():
    """The plan cache key built without the SP world size: a plan made for one degree is reused for another."""
    from optimized.models.seedvr2.windows import PlanCache

    def without_world_size(original):
        def key(self, grids, num_windows, method, world_size):
            return original(self, grids, num_windows, method, 0)
        return key
    return _patched(PlanCache, "key", without_world_size)


def _skipped_transition():
    """The re-shard into layer 1's layout skipped: layer 1 runs on rows laid out for layer 0."""
    from optimized.models.seedvr2.model import FastNaDiT

    def skipping(original):
        def ensure_layout(self, x, req, current, required, group, layer):
            if layer == SKIPPED_TRANSITION_LAYER and current != required:
                self.stats.transitions += 1
                return x
            return original(self, x, req, current, required, group, layer)
        return ensure_layout
    return _patched(FastNaDiT, "ensure_layout", skipping)


PLANTERS = {"cyclic-shift": _cyclic_shift, "token-weighted-text": _token_weighted_text,
            "plan-cache-ignores-world-size": _plan_cache_ignores_world_size,
            "skipped-transition": _skipped_transition}


@contextlib.contextmanager
def planted(fault: str | None, fast=None) -> Iterator[None]:
    """Run the body with `fault` planted (None: nothing). `fast`: the model the body runs, whose plan cache is
    emptied on entry and exit."""
    check_fault(fault)
    if fault is None:
        yield
        return
    if fast is not None:
        fast.plan_cache.store.clear()
    try:
        with PLANTERS[fault]():
            yield
    finally:
        if fast is not None:
            fast.plan_cache.store.clear()
