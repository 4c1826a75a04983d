"""The cosmos3 reasoning (AR text decoding) request contract and the sampling rule both sides implement.

Sampling rule for one token, from fp32 logits over the vocabulary:
  temperature == 0  -> greedy: the first index of the maximum.
  otherwise         -> x = logits / temperature;
                       top_k > 0: entries below the k-th largest value become -inf (ties kept);
                       top_p < 1: sort the softmax of x descending (stable), drop every entry whose
                                  preceding cumulative mass already exceeds top_p (the top one always stays);
                       draw one index with torch.multinomial(softmax(x), 1, generator), the request's own CPU
                       generator seeded once with `seed` (one draw per generated token).
Decoding stops at `eos_token_id` (kept in the output) or after `max_new_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from manifests.cosmos3.config import Cosmos3Config
from manifests.errors import ManifestError


@dataclass(frozen=True)
class ReasonRequest:
    prompt_ids: torch.Tensor          # int64 [L] (text-only; mRoPE positions 0..L-1 on all three axes)
    max_new_tokens: int = 32
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    seed: int = 0
    eos_token_id: int | None = None

    def validate(self, cfg: Cosmos3Config) -> "ReasonRequest":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ManifestError(f"cosmos3 reasoning request: {msg}")

        ids = self.prompt_ids
        need(isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.ndim == 1,
             "prompt_ids must be an int64 [L] tensor")
        need(ids.numel() > 0, "the prompt is empty")
        need(int(ids.min()) >= 0 and int(ids.max()) < cfg.vocab_size,
             f"prompt token ids must lie in [0, {cfg.vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")
        need(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        need(math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature}")
        need(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be >= 0, got {self.top_k!r}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.eos_token_id is None or 0 <= self.eos_token_id < cfg.vocab_size,
             f"eos_token_id must lie in [0, {cfg.vocab_size})")
        return self

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_ids.numel() + self.max_new_tokens
