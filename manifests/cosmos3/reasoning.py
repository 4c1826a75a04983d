"""The cosmos3 reasoning (AR text decoding) request contract and the sampling rule both sides implement.

Sampling rule for one token, from fp32 logits over the vocabulary:
  temperature == 0  -> greedy: the first index of the maximum.
  otherwise         -> x = logits / temperature;
                       top_k > 0: entries below the k-th largest value become -inf (ties kept);
                       top_p < 1: as transformers' TopPLogitsWarper: sort x ascending with torch.sort's
                                  default (unstable) order, cumulative sum of the softmax of the sorted values,
                                  drop every entry whose cumulative mass is <= 1 - top_p (compared in fp32), the
                                  last of that order (a most likely token) always kept. Two edges follow (upstream):
                                  among tokens tied at the cut the sort's order decides which survive (on CPU the
                                  later index for rows of up to 16 entries, implementation-defined beyond), and a
                                  top_p equal to the mass of the k most likely tokens keeps just those k;
                       draw one index with torch.multinomial(softmax(x), 1, generator), the request's own CPU
                       generator seeded once with `seed` (one draw per generated token).
Decoding stops at `eos_token_id` (kept in the output) or after `max_new_tokens`.
Temperatures in (0, MIN_TEMPERATURE) are refused: sampling there is greedy in effect (a logit gap of 1e-4 becomes
100 nats) while logits / temperature can overflow fp32 to inf (and softmax to NaN); ask for greedy with 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from manifests.cosmos3.config import Cosmos3Config
from manifests.errors import ManifestError

MIN_TEMPERATURE = 1e-6
SEED_LIMIT = 2 ** 64            # torch.Generator.manual_seed takes an unsigned 64-bit integer


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
        need(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
             f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        need(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature!r}")
        need(self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
             f"temperature {self.temperature!r} is below {MIN_TEMPERATURE}: greedy in effect but logits / "
             f"temperature overflow; use temperature=0 for greedy decoding")
        need(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be >= 0, got {self.top_k!r}")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT,
             f"seed must be an int in [0, 2**64), got {self.seed!r}")
        need(self.eos_token_id is None or (_is_int(self.eos_token_id) and 0 <= self.eos_token_id < cfg.vocab_size),
             f"eos_token_id must lie in [0, {cfg.vocab_size})")
        return self

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_ids.numel() + self.max_new_tokens
