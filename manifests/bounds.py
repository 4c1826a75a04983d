"""Per-family bounds on a generation request's numeric fields: data both sides (and the server) may read.

Each family's request contract (`manifests/<family>/sampling.py`) states one `RequestBounds` as `BOUNDS` and checks
every numeric field against it in `validate()`. The bounds are what a request may ask for at all; whether it fits
in memory is the engine's admission (peak bytes from the request's fields, against its memory budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from manifests.errors import RequestFieldError


@dataclass(frozen=True)
class RequestBounds:
    max_steps: int = 1000                 # denoising steps (upstream schedulers train 1000 timesteps)
    max_abs_guidance: float = 1e4         # |guidance_scale|: larger overflows the CFG combine in bf16 / fp16
    max_prompt_tokens: int = 512          # token ids per prompt (cond and negative)
    max_fps: float = 1000.0

    def check_steps(self, who: str, value: object, field: str = "num_steps") -> None:
        if not (_is_int(value) and 1 <= value <= self.max_steps):
            raise RequestFieldError(f"{who}: {field} must be an int in [1, {self.max_steps}], got {value!r}", field)

    def check_guidance(self, who: str, value: object, field: str = "guidance_scale") -> None:
        if not (_is_number(value) and math.isfinite(value) and abs(value) <= self.max_abs_guidance):
            raise RequestFieldError(f"{who}: {field} must be finite with |{field}| <= {self.max_abs_guidance:g}, "
                                    f"got {value!r}", field)

    def check_prompt(self, who: str, numel: int, field: str, limit: int | None = None) -> None:
        limit = min(self.max_prompt_tokens, limit) if limit is not None else self.max_prompt_tokens
        if not 1 <= numel <= limit:
            raise RequestFieldError(f"{who}: {field} must hold 1..{limit} token ids, got {numel}", field)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


__all__ = ["RequestBounds", "RequestFieldError"]
