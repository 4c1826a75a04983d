"""Checks that a step body really ran the graph mode asked for (`--graph`), from the engine's `trace.step` events,
shared by every family's C1 (one process and under a plan); and the capture interleave check (issue 22), which
replays two recorded callers of one bucket through a fresh captured step, interleaved, whatever `--graph` is.

`kinds`: (graph, bucket, graph_cache) of every traced step. Compiled bodies also report what dynamo compiled in this
process (`dynamo_counts`): a compile that silently ran eager would show no graph; under a plan the graph breaks are
the plan's collectives, which run eagerly between compiled regions (optimized/parallel/group.py `AxisGroup._run`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import torch

from parity.report import CheckResult

WANT = {"eager": "eager", "compile": "compiled", "cuda": "replayed"}


def dynamo_counts() -> tuple[int, int]:
    """(graphs dynamo compiled, graph breaks) in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def graph_kinds_check(name: str, graph: str, kinds: list, dynamo: tuple[int, int] | None = None) -> CheckResult:
    """Every step ran `graph` (eager / compiled / replayed); with `dynamo` given for a compiled run, at least one
    graph was compiled."""
    want = WANT[graph]
    ok = bool(kinds) and all(k[0] == want for k in kinds)
    detail = "; ".join(sorted({f"{k}@{b} {c}" for k, b, c in kinds}))
    if dynamo is not None:
        ok = ok and (graph != "compile" or dynamo[0] > 0)
        detail += f"; dynamo: {dynamo[0]} graphs compiled, {dynamo[1]} graph breaks (collectives run eagerly)"
    return CheckResult(name, ok, detail=detail)


# ------------------------------------------------------------------------------------------------
# Capture interleave (issue 22): two callers' replays of one captured bucket, interleaved
# ------------------------------------------------------------------------------------------------

# captured replay vs the eager body on the same inputs: bitwise under emulation, the same kernels on a real graph;
# a stale or overwritten buffer is off by the difference between two callers' answers (required to be 10x this)
REPLAY_REL_TOL = 1e-4
DISTINCT_REL = 1e-3


@dataclass
class RecordedCall:
    """One call of a step body through a model's CompileCache: its key, the body, and private copies of its inputs."""
    key: Any
    body: Callable
    inputs: tuple


@dataclass
class CaptureCalls:
    """The first two calls with different inputs of each GraphKey (up to `max_keys` keys) a run made."""
    enabled: bool = True
    max_keys: int = 4
    calls: dict = field(default_factory=dict)     # GraphKey -> [RecordedCall, ...] (at most 2)

    def record(self, key, body, inputs: tuple) -> None:
        """Keep a key's first call, and as its second the call differing from the first in the most input tensors
        (another request's call over another step of the same request: a copy-in that skips "constant" inputs, such
        as the prompt's, shows only between two callers)."""
        got = self.calls.get(key)
        if got is None:
            if len(self.calls) >= self.max_keys:
                return
            got = self.calls[key] = []
        if not got:
            got.append(RecordedCall(key, body, tuple(t.detach().clone() for t in inputs)))
            return
        differ = _tensors_differing(got[0].inputs, inputs)
        if differ and (len(got) == 1 or differ > _tensors_differing(got[0].inputs, got[1].inputs)):
            got[1:] = [RecordedCall(key, body, tuple(t.detach().clone() for t in inputs))]

    def pairs(self) -> list[tuple[RecordedCall, RecordedCall]]:
        return [(a, b) for a, b in (c for c in self.calls.values() if len(c) == 2)]


class _RecordingRunner:
    def __init__(self, runner, key, body, calls: CaptureCalls) -> None:
        self.runner, self.key, self.body, self.calls, self.kind = runner, key, body, calls, runner.kind

    def __call__(self, *inputs):
        self.calls.record(self.key, self.body, inputs)
        return self.runner(*inputs)


class _RecordingCache:
    """A model's CompileCache, unchanged, with every call of every runner it hands out recorded."""

    def __init__(self, inner, calls: CaptureCalls) -> None:
        self.inner, self.calls = inner, calls

    def step(self, key, body, example):
        runner, info = self.inner.step(key, body, example)
        return _RecordingRunner(runner, key, body, self.calls), info

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.contextmanager
def recording_calls(graph_owners: Iterable, enabled: bool = True) -> Iterator[CaptureCalls]:
    """Record the step-body calls of every owner (a model with `graph_cache`) for the duration; each owner's cache
    (whatever it is at entry, e.g. a planted fault's) is put back on exit. `enabled=False`: records nothing."""
    calls = CaptureCalls(enabled=enabled)
    owners = list(graph_owners) if enabled else []
    saved = [(o, o.graph_cache) for o in owners]
    for o, cache in saved:
        o.graph_cache = _RecordingCache(cache, calls)
    try:
        yield calls
    finally:
        for o, cache in saved:
            o.graph_cache = cache


def _same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)


def _same_tensors(xs, ys) -> bool:
    return len(xs) == len(ys) and all(_same_tensor(x, y) for x, y in zip(xs, ys))


def _tensors_differing(xs, ys) -> int:
    return sum(not _same_tensor(x, y) for x, y in zip(xs, ys))


class InterleaveCases:
    """Which of a run's loop cases record their calls for the interleave check: the first (every bucket the run
    starts with) and the first with two or more requests (two real callers: other prompts, other latents)."""

    def __init__(self) -> None:
        self.seen_any = self.seen_many = False

    def wants(self, n_requests: int) -> bool:
        want = not self.seen_any or (n_requests > 1 and not self.seen_many)
        self.seen_any, self.seen_many = True, self.seen_many or (want and n_requests > 1)
        return want


def _rel_diff(got, want) -> float:
    """max |got - want| over max |want|, worst over the outputs."""
    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.detach().float(), w.detach().float()
        worst = max(worst, float((g - w).abs().max() / w.abs().max().clamp_min(1e-12)))
    return worst


def capture_interleave_check(name: str, first: RecordedCall, second: RecordedCall) -> CheckResult:
    """Two callers (two recorded calls of one bucket) through a fresh captured step, interleaved the way a serving
    engine interleaves requests: capture from caller A's own tensors (as the families do: the first call's inputs
    are the example), call A, call B, call A again. Fails when
      * A's output, held across B's replay, changed (the step handed back its static output buffers);
      * A's input tensors changed under B's call (the step kept the caller's tensors as its static buffers);
      * a replay's answer is not the eager body's on that call's inputs (a replay reads stale / aliased inputs);
      * A and B give the same answer (the check could not see a stale buffer: nothing was measured).
    Real CUDA graphs on a CUDA device, the emulated graph (the same replay semantics) elsewhere."""
    from optimized.runtime.compile import CompileCache

    key = first.key
    try:
        cache = CompileCache(emulate_capture=not key.device.startswith("cuda"),
                             parallel_plan_hash=key.parallel_plan_hash)
        caller_a = tuple(t.clone() for t in first.inputs)     # caller A's own tensors (the capture's example)
        caller_b = tuple(t.clone() for t in second.inputs)
        private = lambda call: tuple(t.clone() for t in call.inputs)   # noqa: E731 - eager's own copies
        with torch.inference_mode():
            want_a = first.body(*private(first))
            runner, _ = cache.step(replace(key, mode="cuda"), first.body, caller_a)
            got_a = runner(*caller_a)
            held_a = tuple(t.clone() for t in got_a)
            want_b = second.body(*private(second))
            got_b = tuple(t.clone() for t in runner(*caller_b))   # B is judged on its answer, A on holding its own
            held_kept = _same_tensors(got_a, held_a)          # judged now: A's next replay would refill them
            inputs_kept = _same_tensors(caller_a, first.inputs)
            want_a2 = first.body(*private(first))
            got_a2 = runner(*caller_a)
    except Exception as e:  # noqa: BLE001 - a step that cannot be captured or replayed fails this check
        return CheckResult(name, False, detail=f"{key.short()}: capture / replay raised {type(e).__name__}: {e}")
    problems: dict[str, str] = {}   # divergence tag -> what went wrong
    if not held_kept:
        problems["held output overwritten"] = ("caller A's output changed under caller B's replay (static output "
                                               "buffers handed back)")
    if not inputs_kept:
        problems["caller inputs overwritten"] = ("caller A's input tensors were overwritten by caller B's call "
                                                 "(static buffers alias the first call's inputs)")
    errs = {"A": _rel_diff(held_a, want_a), "B": _rel_diff(got_b, want_b), "A again": _rel_diff(got_a2, want_a2)}
    off = [f"{who} by {err:.3g}" for who, err in errs.items() if err > REPLAY_REL_TOL]
    if off:
        problems["replay off eager"] = f"replay off the eager body for {', '.join(off)} (stale or aliased inputs)"
    distinct = _rel_diff(want_b, want_a)
    if distinct <= DISTINCT_REL:
        problems["nothing measured"] = f"the two callers' answers differ by only {distinct:.3g}: nothing measured"
    detail = (f"{key.short()} ({'CUDA graph' if key.device.startswith('cuda') else 'emulated graph'}): capture "
              f"from A, replay A, B, A; replay vs eager {', '.join(f'{w} {e:.2g}' for w, e in errs.items())}; "
              f"A vs B {distinct:.2g}")
    return CheckResult(name, not problems, detail="; ".join([*problems.values(), detail]),
                       divergence=f"capture interleave: {', '.join(problems)}" if problems else None)


def capture_interleave_checks(prefix: str, calls: CaptureCalls) -> list[CheckResult]:
    """One interleave check per recorded bucket with two different calls; a run that recorded none fails (the step
    body never went through its CompileCache twice: the check would measure nothing)."""
    if not calls.enabled:
        return []
    pairs = calls.pairs()
    if not pairs:
        seen = ", ".join(f"{k.short()} x{len(v)}" for k, v in calls.calls.items()) or "no calls"
        return [CheckResult(f"{prefix}/capture_interleave", False,
                            detail=f"no bucket was called twice with different inputs ({seen})")]
    return [capture_interleave_check(f"{prefix}/capture_interleave[{a.key.bucket}]", a, b) for a, b in pairs]
