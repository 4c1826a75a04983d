"""Checks that a step body really ran the graph mode asked for (`--graph`), from the engine's `trace.step` events,
shared by every family's C1 (one process and under a plan).

`kinds`: (graph, bucket, graph_cache) of every traced step. Compiled bodies also report what dynamo compiled in this
process (`dynamo_counts`): a compile that silently ran eager would show no graph; under a plan the graph breaks are
the plan's collectives, which run eagerly between compiled regions (optimized/parallel/group.py `AxisGroup._run`).
"""

from __future__ import annotations

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
