"""Negative controls of the captured / compiled step path (issue 13), shared by every family whose step body runs
through `optimized.runtime.compile.CompileCache`. Each is a context manager that patches one declared seam and
restores it on exit; production code carries no fault flags.

    stale-static-buffer   `optimized.runtime.compile.copy_in` skips the copy: a captured step replays on the
                          previous call's inputs (what forgetting the copy-in of a CUDA graph does)
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator
from parity.patching import patched  # noqa: F401 (re-exported: the one planting helper)


@contextlib.contextmanager
def stale_static_buffer(graph_owners: Iterable) -> Iterator[None]:
    """Replay without copying new inputs into the static buffers. The fault lives in the capture path, so every
    owner (a model with `graph_cache`, `graph_mode`, `device`) that is not already capturing CUDA graphs on a CUDA
    device runs its step body through an emulated graph for the duration (`CompileCache(emulate_capture=True)`:
    CUDA-graph replay semantics on CPU); its own cache and mode are restored on exit."""
    from optimized.runtime import compile as graph

    saved = []
    for owner in graph_owners:
        saved.append((owner, owner.graph_cache, owner.graph_mode))
        if not (owner.graph_mode == "cuda" and str(owner.device).startswith("cuda")):
            owner.graph_cache, owner.graph_mode = graph.CompileCache(emulate_capture=True), "cuda"
    try:
        with patched(graph, "copy_in", lambda original: lambda static, inputs: None):
            yield
    finally:
        for owner, cache, mode in saved:
            owner.graph_cache, owner.graph_mode = cache, mode
