"""What the engine said while a C1 case ran, as checks: the scheduler reruns a batch whose step raised request by
request from the members' pre-step states (a failing request fails alone), so a batched step that cannot run (e.g.
CFG-parallel returning too few predictions once an unguided row joins) leaves every latent right. Its one
`trace.batch_failed` event is what shows it: `<case>/no_batch_failed` fails when any batched step raised."""

from __future__ import annotations

import contextlib
from typing import Iterator

from parity.report import CheckResult


@contextlib.contextmanager
def batch_failures(engine) -> Iterator[list[dict]]:
    """The data of every `trace.batch_failed` event the engine emits inside the block (error, batch, loop, steps)."""
    seen: list[dict] = []
    unsubscribe = engine.subscribe(lambda ev: seen.append(dict(ev.data)), prefix="trace.batch_failed")
    try:
        yield seen
    finally:
        unsubscribe()


def no_batch_failed_check(prefix: str, failures: list[dict]) -> CheckResult:
    """`<prefix>/no_batch_failed`: no batched step raised (each failure named: loop, steps, members, error)."""
    if not failures:
        return CheckResult(f"{prefix}/no_batch_failed", True, detail="no batched step raised")
    named = "; ".join(f"{f.get('loop')} steps {f.get('steps')} of {', '.join(f.get('batch', []))}: {f.get('error')}"
                      for f in failures[:3])
    more = f" (+{len(failures) - 3} more)" if len(failures) > 3 else ""
    return CheckResult(f"{prefix}/no_batch_failed", False,
                       detail=f"{len(failures)} batched step(s) raised and were rerun request by request: "
                              f"{named}{more}")
