"""The typed state of a realtime session (`optimized.serving.realtime`): what a session is (SessionState), what each of
its generations did (GenerationRecord), what it tells its clients (SessionEvent), and the errors its API raises."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from optimized.serving.families import ServingError

if TYPE_CHECKING:
    import torch

# conditioning a session carries into each generation (AsyncEngine.submit's plain fields, prompt and image aside)
CONDITIONING_TYPES: dict[str, tuple[type, ...]] = {
    "negative_prompt": (str,), "negative_prompt_ids": (list,), "num_frames": (int,), "height": (int,),
    "width": (int,), "num_steps": (int,), "guidance_scale": (int, float), "seed": (int,)}
SESSION_STATUSES = ("open", "generating", "closed")
CLOSE_REASONS = ("client", "idle_timeout", "shutdown")


class FieldError(ServingError):
    """A session input refused; `field` names it (the WebSocket error's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class UnknownSession(LookupError):
    """No open session with that id (never opened, closed, or timed out)."""


class SessionClosed(RuntimeError):
    """The session was closed; it takes no more input."""


class SessionLimit(RuntimeError):
    """`max_sessions` sessions are open already."""


class SessionLagged(RuntimeError):
    """A consumer fell `max_pending` events behind and was dropped; `last_seq` is the last event it was given."""

    def __init__(self, last_seq: int):
        super().__init__(f"the consumer fell behind after event {last_seq}; rejoin with after_seq={last_seq}")
        self.last_seq = last_seq


@dataclass
class GenerationRecord:
    """One generation of a session."""
    request_id: str
    prompt: str
    status: str                                    # queued | running | completed | failed | interrupted
    kind: str = "video"                            # video | reasoning
    started_at: float = 0.0                        # wall clock
    ended_at: float | None = None
    steps_run: int = 0                             # denoise steps that ran
    total_steps: int | None = None
    chunks: int = 0                                # decoded chunks streamed
    error: str | None = None


@dataclass
class SessionState:
    """What a session is, authoritatively (kept across leave / rejoin until the session closes)."""
    session_id: str
    prompt_parts: list[str] = field(default_factory=list)        # joined with one space into the prompt
    images: list["torch.Tensor"] = field(default_factory=list)   # [3, H, W] in [-1, 1]; the latest conditions
    conditioning: dict[str, Any] = field(default_factory=dict)   # CONDITIONING_TYPES fields
    active_generation: str | None = None                         # request id of the running generation
    history: list[GenerationRecord] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.time)
    status: str = "open"                                         # SESSION_STATUSES
    connected: bool = True                                       # a client is attached (False after leave)
    idle_timeout_s: float = 300.0
    closed_reason: str | None = None

    @property
    def prompt(self) -> str:
        return " ".join(p for p in self.prompt_parts if p)

    def to_json(self) -> dict:
        return {"session_id": self.session_id, "prompt": self.prompt, "prompt_parts": list(self.prompt_parts),
                "images": [list(im.shape) for im in self.images], "conditioning": dict(self.conditioning),
                "active_generation": self.active_generation, "history": [asdict(g) for g in self.history],
                "created_at": self.created_at, "last_active": self.last_active, "status": self.status,
                "connected": self.connected, "idle_timeout_s": self.idle_timeout_s,
                "closed_reason": self.closed_reason}


@dataclass(frozen=True)
class SessionEvent:
    seq: int                                       # 1, 2, ... per session (rejoin replays after a seq)
    kind: str
    session_id: str
    data: dict = field(default_factory=dict)
    frames: "torch.Tensor | None" = None           # media.video_chunk: uint8 [F, H, W, 3]
    wall_time: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return {"type": self.kind, "seq": self.seq, "session_id": self.session_id, "time": self.wall_time,
                **self.data}


__all__ = ["CLOSE_REASONS", "CONDITIONING_TYPES", "FieldError", "GenerationRecord", "SESSION_STATUSES", "SessionClosed",
           "SessionEvent", "SessionLagged", "SessionLimit", "SessionState", "UnknownSession"]
