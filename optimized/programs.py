"""Programs: several loops of one resident model instance composed into one user-level request.

`reason_then_generate`: AR reasoning through the und pathway (e.g. to enrich the prompt), then denoising
with the reasoning's text as the generation prompt, on the same ModelInstance. The reasoning hands its
und-stream K/V to the generator's cache (the CacheKey is the text's content hash, so the generator hits it
exactly when its prompt is that text).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from manifests.cosmos3.reasoning import ReasonRequest
from manifests.cosmos3.sampling import Cosmos3GenerateRequest

if TYPE_CHECKING:
    from optimized.engine import Engine, RequestHandle


@dataclass
class ProgramHandle:
    engine: "Engine"
    reasoning: "RequestHandle"
    generation_template: Cosmos3GenerateRequest
    generation: "RequestHandle | None" = None

    def _on_event(self, ev) -> None:
        if ev.request_id == self.reasoning.request_id and ev.kind == "request.completed" and self.generation is None:
            text = self.reasoning.record.result["text_ids"]
            req = replace(self.generation_template, text_ids=text)
            self.generation = self.engine.submit(req)

    def cancel(self) -> None:
        self.reasoning.cancel()
        if self.generation is not None:
            self.generation.cancel()

    def result(self) -> dict:
        reasoning = self.reasoning.result()
        self.engine.scheduler.run_until(lambda: self.generation is not None)
        if self.generation is None:
            raise RuntimeError("reasoning finished but the generation was never submitted")
        return {"reasoning": reasoning, "generation": self.generation.result()}


def reason_then_generate(engine: "Engine", reasoning: ReasonRequest,
                         generation: Cosmos3GenerateRequest) -> ProgramHandle:
    """`generation.text_ids` is replaced by the reasoning's prompt + generated text (a final EOS dropped)."""
    handle = ProgramHandle(engine, engine.submit_reasoning(reasoning, export_und_kv=True), generation)
    engine.subscribe(handle._on_event, prefix="request.completed")
    return handle
