"""cosmos3 reasoning: autoregressive text through the und pathway + final norm + lm_head.

Readable on purpose: every new token recomputes the whole sequence (no KV cache). The sampling rule is the
one written in manifests/cosmos3/reasoning.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from manifests.cosmos3.reasoning import ReasonRequest
from reference.cosmos3.model import Cosmos3Transformer, mrope_cos_sin
from reference.cosmos3.packing import text_position_ids


@dataclass
class ReasonResult:
    tokens: list[int]                                         # generated ids (EOS included when hit)
    logits: list[torch.Tensor] = field(default_factory=list)  # fp32 [V] that chose each token
    stopped_by: str = "max_new_tokens"                        # or "eos"


def und_logits(model: Cosmos3Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Logits [L, V] of a text-only sequence: the und stream, `und_norm`, `lm_head`."""
    cfg = model.cfg
    x = model.embed_tokens(ids)
    rope = mrope_cos_sin(cfg, text_position_ids(cfg, ids.numel()), x.dtype)  # text: t = h = w = position
    for layer in model.layers:
        x, _, _ = layer.und_forward(x, rope)
    return model.lm_head(model.und_norm(x))


def choose_token(logits: torch.Tensor, req: ReasonRequest, generator: torch.Generator) -> int:
    x = logits.float()
    if req.temperature == 0:
        return int(torch.argmax(x))
    x = x / req.temperature
    if req.top_k > 0:
        kth = torch.topk(x, min(req.top_k, x.numel())).values[-1]
        x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
    if req.top_p < 1:
        # ascending, in torch.sort's default (unstable) tie order: it picks which tied token survives a cut (upstream)
        ascending, order = torch.sort(x, descending=False)
        cumulative = torch.cumsum(torch.softmax(ascending, dim=-1), dim=-1)
        # a mass of exactly 1 - top_p counts as below: top_p equal to a cumulative mass drops the next token (upstream)
        below = cumulative <= 1 - req.top_p
        below[-1] = False  # the last in that order (a most likely token) always survives
        x = x.clone()
        x[order[below]] = float("-inf")
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator))


def reason(model: Cosmos3Transformer, req: ReasonRequest, keep_logits: bool = True) -> ReasonResult:
    req.validate(model.cfg)
    generator = torch.Generator().manual_seed(req.seed)
    ids = req.prompt_ids.clone()
    result = ReasonResult(tokens=[])
    with torch.no_grad():
        for _ in range(req.max_new_tokens):
            last = und_logits(model, ids)[-1].float()  # full recompute of the whole sequence, every token
            token = choose_token(last, req, generator)
            result.tokens.append(token)
            if keep_logits:
                result.logits.append(last)
            ids = torch.cat([ids, torch.tensor([token])])
            if token == req.eos_token_id:
                result.stopped_by = "eos"
                break
    return result
