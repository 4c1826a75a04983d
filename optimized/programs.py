"""Programs: several loops of one resident model instance composed into one user-level request.

`chain(engine, first, then, ...)`: submit `first`; when it completes, submit `then(first's result)` on the same
engine (same instance, same scheduler). A family's programs (e.g. cosmos3's `reason_then_generate`: AR reasoning,
then denoising with the reasoned text as the prompt) are built from it and exposed through its entry's `programs`.
The chain's event subscription is removed as soon as the second request is submitted or the first ends without a
result, so an engine running many programs does not accumulate subscribers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from optimized.engine import Engine, RequestHandle


@dataclass
class ProgramHandle:
    engine: "Engine"
    first: "RequestHandle"
    then: Callable[[Any], Any]                       # first's result -> the second request
    then_options: dict = field(default_factory=dict)
    names: tuple[str, str] = ("first", "second")     # result keys (and attribute aliases)
    second: "RequestHandle | None" = None
    _unsubscribe: Callable[[], None] | None = None

    def _on_event(self, ev) -> None:
        if ev.request_id != self.first.request_id or ev.kind not in ("request.completed", "request.cancelled",
                                                                     "request.failed"):
            return
        self._detach()
        if ev.kind == "request.completed" and self.second is None:
            self.second = self.engine.submit(self.then(self.first.record.result), **self.then_options)

    def _detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def __getattr__(self, name: str):
        names = self.__dict__.get("names", ())
        if name in names:
            return self.first if name == names[0] else self.second
        raise AttributeError(name)

    def cancel(self) -> None:
        self.first.cancel()
        if self.second is not None:
            self.second.cancel()

    def result(self) -> dict:
        first = self.first.result()
        self.engine.scheduler.run_until(lambda: self.second is not None)
        if self.second is None:
            raise RuntimeError(f"{self.names[0]} finished but the {self.names[1]} was never submitted")
        return {self.names[0]: first, self.names[1]: self.second.result()}


def chain(engine: "Engine", first: Any, then: Callable[[Any], Any], *, first_options: dict | None = None,
          then_options: dict | None = None, names: tuple[str, str] = ("first", "second")) -> ProgramHandle:
    handle = ProgramHandle(engine, engine.submit(first, **(first_options or {})), then, dict(then_options or {}),
                           names)
    handle._unsubscribe = engine.subscribe(handle._on_event, prefix="request.")
    return handle
