"""The engine API: one resident model instance, the WorkUnit scheduler, requests in, latents and events out.

    from optimized import Engine
    engine = Engine.from_variant("tiny", seed=0)
    result = engine.generate(request)                 # blocking
    handle = engine.submit(request); handle.cancel()  # streaming / cancellable
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from manifests.cosmos3 import Cosmos3Config, canonical_key_shapes, load_variant
from manifests import ManifestError
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, video_request
from manifests.cosmos3.reasoning import ReasonRequest
from optimized.models.cosmos3.loops import DenoiseJob, FlowDenoiseLoop
from optimized.models.cosmos3.reasoner import ARDecodeLoop, ReasonJob
from optimized.models.cosmos3.model import Cosmos3Fast
from optimized.runtime.events import Event, EventBus
from optimized.runtime.scheduler import RequestRecord, RequestRejected, WorkUnitScheduler

__all__ = ["Engine", "RequestHandle", "RequestRejected"]


@dataclass
class RequestHandle:
    engine: "Engine"
    record: RequestRecord

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def status(self) -> str:
        return self.record.status

    @property
    def events(self) -> list[Event]:
        return list(self.record.events)

    def cancel(self) -> None:
        self.engine.scheduler.cancel(self.request_id)

    def result(self) -> dict:
        """Drive the engine until this request ends; its result, or an error saying why there is none."""
        self.engine.scheduler.run_until(lambda: self.record.status in ("completed", "cancelled", "failed"))
        if self.record.status != "completed":
            raise RuntimeError(f"request {self.request_id} {self.record.status}"
                               + (f": {self.record.error}" if self.record.error else ""))
        return self.record.result


class Engine:
    def __init__(self, fast: Cosmos3Fast, cfg_policy: str = "batched", memory_budget_bytes: int = 8 << 30,
                 tick_budget_seconds: float = float("inf"), max_batch: int = 16, kv_blocks: int = 512,
                 kv_block_size: int = 16):
        self.model = fast
        self.bus = EventBus()
        self.scheduler = WorkUnitScheduler(memory_budget_bytes, tick_budget_seconds, max_batch, self.bus)
        self.denoise = FlowDenoiseLoop(fast, cfg_policy)
        self.reasoning = ARDecodeLoop(fast, kv_blocks, kv_block_size)  # same resident instance, same scheduler
        fast.und_cache.subscribe(lambda ev: self.bus.emit(Event(
            "trace.cache", None, self.scheduler.tick_count,
            {"store": ev.store, "op": ev.op, "key": ev.key.short(), "nbytes": ev.nbytes})))

    # ---- construction
    @classmethod
    def from_state_dict(cls, cfg: Cosmos3Config, state: dict[str, torch.Tensor], device: str = "cpu",
                        dtype: torch.dtype = torch.float32, weights_version: str | None = None, **kw) -> "Engine":
        return cls(Cosmos3Fast(cfg, state, device=device, dtype=dtype, weights_version=weights_version), **kw)

    @classmethod
    def from_variant(cls, variant: str, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                     **kw) -> "Engine":
        """Seeded random weights at a variant's shapes (benchmarks at released sizes; smoke runs)."""
        cfg = load_variant(variant)
        g = torch.Generator().manual_seed(seed)
        state = {k: (torch.randn(shape, generator=g) * 0.02 + (1.0 if k.endswith("norm.weight") else 0.0))
                 for k, shape in sorted(canonical_key_shapes(cfg).items())}
        return cls.from_state_dict(cfg, state, device, dtype, weights_version=f"random:{variant}:{seed}", **kw)

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        **kw) -> "Engine":
        """A canonical checkpoint directory written by fvconvert (config.json + model*.safetensors)."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg = Cosmos3Config.from_dict(json.loads((path / "config.json").read_text()))
        state: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("model*.safetensors")):
            state.update(load_file(str(f)))
        report = path / "conversion_report.json"
        version = json.loads(report.read_text()).get("outputs_sha256") if report.is_file() else None
        return cls.from_state_dict(cfg, state, device, dtype, weights_version=str(version) if version else None, **kw)

    # ---- requests
    def submit(self, request: Cosmos3GenerateRequest, record_trajectory: bool = False,
               request_id: str | None = None) -> RequestHandle:
        """Validate and queue; raises RequestRejected (one clear message) for an invalid or impossible request."""
        return RequestHandle(self, self.scheduler.submit(self.denoise, DenoiseJob(request, record_trajectory),
                                                         request_id))

    def submit_video(self, *, num_frames: int, height: int, width: int, **kw) -> RequestHandle:
        """Submit from pixel sizes (num_frames 4k + 1, height/width multiples of 16)."""
        try:
            request = video_request(self.model.cfg, num_frames=num_frames, height=height, width=width, **kw)
        except (ManifestError, TypeError) as e:
            raise RequestRejected(str(e)) from None
        return self.submit(request)

    def generate(self, request: Cosmos3GenerateRequest, record_trajectory: bool = False) -> dict:
        return self.submit(request, record_trajectory).result()

    def submit_reasoning(self, request: ReasonRequest, record_logits: bool = False, export_und_kv: bool = False,
                         request_id: str | None = None) -> RequestHandle:
        """Queue AR text decoding through the und pathway + lm_head; raises RequestRejected on bad input."""
        return RequestHandle(self, self.scheduler.submit(self.reasoning, ReasonJob(request, record_logits,
                                                                                   export_und_kv), request_id))

    def reason(self, request: ReasonRequest, record_logits: bool = False) -> dict:
        return self.submit_reasoning(request, record_logits).result()

    def reason_then_generate(self, reasoning: ReasonRequest, generation: Cosmos3GenerateRequest):
        """One program on this instance: reasoning, then denoising with the reasoned text as the prompt."""
        from optimized.programs import reason_then_generate
        return reason_then_generate(self, reasoning, generation)

    def subscribe(self, fn: Callable[[Event], Any], prefix: str = "") -> Callable[[], None]:
        return self.bus.subscribe(fn, prefix)

    def step(self) -> None:
        """One scheduler iteration (for callers that interleave their own work)."""
        self.scheduler.tick()

    def run_until_idle(self) -> None:
        self.scheduler.run_until_idle()
