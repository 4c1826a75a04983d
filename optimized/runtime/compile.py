"""Compiled and graph-captured step bodies, cached per shape bucket (gpt-fast: speed from compiling the step).

A family's step body is a pure tensor function `body(*inputs) -> tuple of tensors` whose inputs all have static
shapes per **shape bucket** (pad to the bucket, mask the pad) and whose host-side tables (indices, position ids,
masks) were built once per layout and cached on the device. `CompileCache.step(key, body, example)` returns a
`StepRunner` for that key:

  * "eager":    the body as written;
  * "compile":  `torch.compile(body, dynamic=False)` (CPU and CUDA; one specialisation per bucket);
  * "cuda":     CUDA graph capture of the (compiled or eager) body: static input buffers per bucket, copy-in,
                replay, copy-out (`CapturedStep`).

Keys (`GraphKey`) carry every field that can change the numbers or the captured shapes, like every cache key of the
runtime: family, variant, weights version, dtype, device, shape bucket, batch size, CFG policy, parallel plan hash,
attention backend, graph mode. Each call reports `kind` (eager / compiled / replayed) and whether the runner was a
cache hit, for the step's `trace.step` event.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

GRAPH_MODES = ("eager", "compile", "cuda")
Body = Callable[..., tuple[torch.Tensor, ...]]


# ----------------------------------------------------------------------------------------------------------------
# Shape buckets
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShapeBuckets:
    """Per-axis bucket sizes of a family: an axis length n is padded to the smallest declared edge >= n, or past the
    last edge to the next multiple of `multiple[axis]` (1 = exact, no padding)."""
    edges: dict[str, tuple[int, ...]] = field(default_factory=dict)
    multiple: dict[str, int] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.edges.items())), tuple(sorted(self.multiple.items()))))

    def pad(self, axis: str, n: int) -> int:
        for e in self.edges.get(axis, ()):
            if n <= e:
                return e
        m = self.multiple.get(axis, 1)
        return max(m, math.ceil(n / m) * m)

    @staticmethod
    def exact() -> "ShapeBuckets":
        return ShapeBuckets()

    def signature(self) -> str:
        return ";".join(f"{a}:{self.edges.get(a, ())}+{self.multiple.get(a, 1)}"
                        for a in sorted(set(self.edges) | set(self.multiple))) or "exact"


# ----------------------------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GraphKey:
    family: str
    variant: str                 # config hash when there is no variant name
    weights_version: str
    dtype: str
    device: str
    bucket: str                  # e.g. "B=4;text=32;gen=960"
    batch_size: int
    cfg_policy: str
    attention: str               # optimized/attention.py backend
    mode: str                    # eager | compile | cuda
    parallel_plan_hash: str = "single"

    def __post_init__(self) -> None:
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"graph mode must be one of {GRAPH_MODES}, got {self.mode!r}")
        for name in ("family", "variant", "weights_version", "dtype", "device", "bucket", "cfg_policy", "attention"):
            if not getattr(self, name):
                raise ValueError(f"GraphKey.{name} must be non-empty")

    def short(self) -> str:
        return f"{self.family}/{self.mode}/{self.bucket}"


# ----------------------------------------------------------------------------------------------------------------
# Runners
# ----------------------------------------------------------------------------------------------------------------

class EmulatedGraph:
    """Replay semantics of a CUDA graph without a GPU (for CPU tests of the capture logic): `capture` records the
    body; `replay` re-runs it on the SAME static input buffers and writes into the SAME static output tensors, so a
    caller that forgets to copy new inputs in gets the stale answer exactly as a real graph would."""

    def __init__(self) -> None:
        self._fn: Callable[[], tuple[torch.Tensor, ...]] | None = None
        self._outs: tuple[torch.Tensor, ...] = ()

    @contextlib.contextmanager
    def capture(self, fn: Callable[[], tuple[torch.Tensor, ...]]):
        self._fn = fn
        self._outs = fn()
        yield self._outs

    def replay(self) -> None:
        for out, new in zip(self._outs, self._fn()):
            out.copy_(new)


class CudaGraph:
    """A real CUDA graph: warm-up on a side stream (lazy init, autotuning), then capture."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def capture(self, fn: Callable[[], tuple[torch.Tensor, ...]]):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
            outs = fn()
        yield outs

    def replay(self) -> None:
        self.graph.replay()


# The three declared seams of a captured step (parity/graph_faults.py plants one negative control in each; the
# capture interleave check in parity/graph_checks.py must fail for every one of them).

def static_buffers(example: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The captured step's own static input storage, allocated from the capture's example (the first call's
    inputs): a copy, never the caller's tensors (a graph reading the caller's tensors would have every later
    caller's copy-in overwrite them)."""
    return [x.clone() for x in example]


def copy_in(static: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    """Copy one call's inputs into the captured step's static buffers (the stale-static-buffer negative control
    patches it to skip the copy)."""
    for buf, x in zip(static, inputs):
        buf.copy_(x)


def copy_out(static: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """What a call hands back: copies of the static outputs (the next replay writes into the static outputs, so a
    caller holding them would see its result change under it)."""
    return tuple(o.clone() for o in static)


class CapturedStep:
    """Static input buffers for one bucket; `__call__` copies the new inputs in (shapes and dtypes must match the
    bucket exactly), replays, and copies the outputs out (a later replay must not change what a caller holds)."""

    kind = "replayed"

    def __init__(self, body: Body, example: Sequence[torch.Tensor], graph: EmulatedGraph | CudaGraph) -> None:
        self.static_in = static_buffers(example)
        self.graph = graph
        with graph.capture(lambda: tuple(body(*self.static_in))) as outs:
            self.static_out = outs

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.static_in):
            raise ValueError(f"captured step takes {len(self.static_in)} inputs, got {len(inputs)}")
        for i, (buf, x) in enumerate(zip(self.static_in, inputs)):
            if buf.shape != x.shape or buf.dtype != x.dtype:
                raise ValueError(f"input {i}: {tuple(x.shape)} {x.dtype} does not match the captured bucket "
                                 f"{tuple(buf.shape)} {buf.dtype}")
        copy_in(self.static_in, inputs)
        self.graph.replay()
        return copy_out(self.static_out)


@dataclass
class StepRunner:
    fn: Callable[..., tuple[torch.Tensor, ...]]
    kind: str                 # eager | compiled | replayed
    calls: int = 0

    def __call__(self, *inputs):
        self.calls += 1
        return self.fn(*inputs)


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    builds: dict[str, int] = field(default_factory=dict)  # kind -> runners built


@dataclass(frozen=True)
class StepInfo:
    """What one step ran, for `trace.step`: graph kind, bucket, and whether the runner came from the cache."""
    graph: str
    bucket: str
    graph_cache: str          # hit | miss

    def as_dict(self) -> dict[str, str]:
        return {"graph": self.graph, "bucket": self.bucket, "graph_cache": self.graph_cache}


class CompileCache:
    """GraphKey -> StepRunner, LRU-bounded by entry count (a captured bucket holds its static buffers).

    `parallel_plan_hash`: the layout of the model that owns this cache (set when a parallel plan is attached). Every
    key looked up names it: a key built without a plan ("single") is stamped with it, a key naming another layout
    is refused (one cache never serves two layouts)."""

    def __init__(self, max_entries: int = 32, emulate_capture: bool = False,
                 parallel_plan_hash: str = "single") -> None:
        self.max_entries = max_entries
        self.emulate_capture = emulate_capture   # CPU tests of the capture path
        self.parallel_plan_hash = parallel_plan_hash
        self._runners: OrderedDict[GraphKey, StepRunner] = OrderedDict()
        self.stats = CompileStats()

    def __len__(self) -> int:
        return len(self._runners)

    def keys(self) -> list[GraphKey]:
        return list(self._runners)

    def clear(self) -> None:
        self._runners.clear()

    def step(self, key: GraphKey, body: Body, example: Sequence[torch.Tensor]) -> tuple[StepRunner, StepInfo]:
        if key.parallel_plan_hash != self.parallel_plan_hash:
            if key.parallel_plan_hash != "single":
                raise ValueError(f"graph key for plan {key.parallel_plan_hash!r} looked up in the compile cache of "
                                 f"plan {self.parallel_plan_hash!r}")
            key = replace(key, parallel_plan_hash=self.parallel_plan_hash)
        runner = self._runners.get(key)
        status = "hit"
        if runner is None:
            status = "miss"
            self.stats.misses += 1
            runner = self._build(key, body, example)
            self._runners[key] = runner
            while len(self._runners) > self.max_entries:
                self._runners.popitem(last=False)
        else:
            self.stats.hits += 1
            self._runners.move_to_end(key)
        return runner, StepInfo(runner.kind, key.bucket, status)

    def _build(self, key: GraphKey, body: Body, example: Sequence[torch.Tensor]) -> StepRunner:
        if key.mode == "eager":
            runner = StepRunner(body, "eager")
        elif key.mode == "compile":
            # under a plan the body holds collectives: they run eagerly between compiled regions (graph breaks)
            runner = StepRunner(compile_body(body, fullgraph=key.parallel_plan_hash == "single"), "compiled")
        else:
            if not self.emulate_capture and not key.device.startswith("cuda"):
                raise ValueError(f"graph mode 'cuda' needs a CUDA device, got {key.device}")
            graph = EmulatedGraph() if self.emulate_capture else CudaGraph()
            runner = StepRunner(CapturedStep(body, example, graph), "replayed")
        self.stats.builds[runner.kind] = self.stats.builds.get(runner.kind, 0) + 1
        return runner


def compile_body(body: Body, fullgraph: bool = True) -> Body:
    """`torch.compile` with static shapes (one specialisation per bucket: the key already names the bucket);
    `fullgraph=False` lets the body break its graph (at a parallel plan's collectives, which then run eagerly with
    their byte counts and watchdog, between compiled regions)."""
    import torch._dynamo

    # every bucket is one specialisation of the same code object: allow as many as the cache holds (why: the
    # default limit of 8 would silently fall back to eager after the 8th bucket)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(body, dynamic=False, fullgraph=fullgraph)

