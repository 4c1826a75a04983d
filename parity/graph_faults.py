"""Negative controls of the captured / compiled step path (issues 13 and 22), shared by every family whose step body
runs through `optimized.runtime.compile.CompileCache`. Each is a context manager that patches one declared seam of
the captured step and restores it on exit; production code carries no fault flags.

    stale-static-buffer      `copy_in` skips the copy: a captured step replays on the previous call's inputs (what
                             forgetting the copy-in of a CUDA graph does)
    static-output-handback   `copy_out` hands back the static output buffers themselves: the next replay (another
                             caller's) overwrites what an earlier caller holds
    aliased-static-inputs    `static_buffers` keeps the capture's example (the first call's own tensors) as the
                             static inputs: every later caller's copy-in writes into the first caller's tensors

Each fault also runs every owner's step body through an emulated graph for its duration (CUDA-graph replay
semantics on CPU), so the family's C1 parity sees the fault wherever one caller's steps run; the capture interleave
check (parity/graph_checks.py) sees all three whatever the graph mode.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

from parity.patching import patched

# fault name -> (seam in optimized.runtime.compile, make(original) -> the faulty seam)
GRAPH_FAULT_SEAMS: dict[str, tuple[str, Callable]] = {
    "stale-static-buffer": ("copy_in", lambda original: lambda static, inputs: None),
    "static-output-handback": ("copy_out", lambda original: lambda static: tuple(static)),
    "aliased-static-inputs": ("static_buffers", lambda original: lambda example: list(example)),
}
GRAPH_FAULTS = tuple(GRAPH_FAULT_SEAMS)


@contextlib.contextmanager
def planted_graph_fault(fault: str, graph_owners: Iterable) -> Iterator[None]:
    """Plant `fault` (one of GRAPH_FAULTS) in the capture path. Every owner (a model with `graph_cache`,
    `graph_mode`, `device`) that is not already capturing CUDA graphs on a CUDA device runs its step body through
    an emulated graph for the duration (`CompileCache(emulate_capture=True)`); its own cache and mode are restored
    on exit."""
    from optimized.runtime import compile as graph

    seam, make = GRAPH_FAULT_SEAMS[fault]
    saved = []
    for owner in graph_owners:
        saved.append((owner, owner.graph_cache, owner.graph_mode))
        if not (owner.graph_mode == "cuda" and str(owner.device).startswith("cuda")):
            owner.graph_cache, owner.graph_mode = graph.CompileCache(emulate_capture=True), "cuda"
    try:
        with patched(graph, seam, make):
            yield
    finally:
        for owner, cache, mode in saved:
            owner.graph_cache, owner.graph_mode = cache, mode


def stale_static_buffer(graph_owners: Iterable):
    """Replay without copying new inputs into the static buffers (the issue-13 control, kept by name)."""
    return planted_graph_fault("stale-static-buffer", graph_owners)
