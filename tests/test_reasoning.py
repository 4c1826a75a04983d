"""AR reasoning on the engine: refusal of bad requests, KV blocks reserved at admission and freed on
completion/cancel, co-scheduling with denoising where neither kind starves."""

import itertools

import pytest
import torch

from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.reasoning import ReasonRequest
from manifests.cosmos3.sampling import Cosmos3GenerateRequest
from optimized import Engine, RequestRejected
from parity.weights import random_state_dict
from reference.cosmos3 import load_transformer
from reference.cosmos3.reasoner import choose_token, reason

CFG = load_variant("tiny")
STATE = random_state_dict(canonical_key_shapes(CFG), 5)


def engine(**kw):
    return Engine.from_state_dict(CFG, STATE, kv_block_size=4, **kw)


@pytest.mark.parametrize("bad, message", [
    (dict(prompt_ids=torch.tensor([], dtype=torch.int64)), "prompt is empty"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(prompt_ids=torch.tensor([3, 128])), "must lie in \\[0, 128\\)"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
])
def test_bad_reasoning_requests_refused(bad, message):
    eng = engine()
    ok = eng.submit_reasoning(ReasonRequest(torch.arange(4), 3))
    with pytest.raises(RequestRejected, match=message):
        eng.submit_reasoning(ReasonRequest(**{"prompt_ids": torch.arange(4), **bad}))
    assert len(ok.result()["tokens"]) == 3


def test_kv_blocks_reserved_at_admission_freed_on_cancel_and_completion():
    eng = engine(kv_blocks=12)
    pool = eng.loop("reasoning").pool
    a = eng.submit_reasoning(ReasonRequest(torch.arange(6), 10))       # 16 tokens = 4 blocks
    b = eng.submit_reasoning(ReasonRequest(torch.arange(3) + 9, 20))   # 23 tokens = 6 blocks
    c = eng.submit_reasoning(ReasonRequest(torch.arange(5) + 1, 5))    # 10 tokens = 3 blocks: must wait
    eng.step()
    assert pool.num_free == 12 - 4 - 6 and a.status == b.status == "running" and c.status == "waiting"
    b.cancel()
    eng.step()
    assert b.status == "cancelled" and c.status == "running"
    assert pool.num_free == 12 - 4 - 3
    eng.run_until_idle()
    assert pool.num_free == 12 and eng.scheduler.reserved_bytes == 0
    with pytest.raises(RequestRejected, match="can never fit"):
        eng.submit_reasoning(ReasonRequest(torch.arange(40), 20))       # 60 tokens > 12 blocks of 4


def test_reasoning_and_denoising_interleave_and_neither_starves():
    # a tick budget that fits only one group per tick: the scheduler must alternate the two loop kinds
    eng = engine(tick_budget_seconds=1e-12)
    steps = []
    eng.subscribe(lambda ev: steps.append((ev.tick, ev.data["loop"])), prefix="trace.step")
    gen = Cosmos3GenerateRequest(text_ids=torch.arange(5), negative_text_ids=torch.arange(2), latent_frames=2,
                                 latent_height=4, latent_width=4, num_steps=6, guidance_scale=3.0, seed=0)
    h_gen = eng.submit(gen)
    h_ar = eng.submit_reasoning(ReasonRequest(torch.arange(7), 6))
    eng.run_until_idle()
    assert h_gen.status == "completed" and h_ar.status == "completed"
    kinds = [loop for _, loop in sorted(steps)]
    first_ar, last_dn = kinds.index("cosmos3.ar_decode"), len(kinds) - 1 - kinds[::-1].index("cosmos3.denoise")
    assert first_ar < last_dn, "reasoning must start before denoising ends (no starvation)"
    runs = [len(list(g)) for _, g in itertools.groupby(kinds)]
    assert max(runs) <= 2, f"one kind ran {max(runs)} ticks in a row while the other waited: {kinds}"


def test_sampling_rule_reference_examples():
    """The shared sampling rule on hand-made logits (values worked out by hand)."""
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0])
    g = torch.Generator().manual_seed(0)
    assert choose_token(logits, ReasonRequest(torch.arange(1), 1), g) == 1  # greedy: first maximum
    only_top = ReasonRequest(torch.arange(1), 1, temperature=1.0, top_k=1)
    assert {choose_token(logits, only_top, g) for _ in range(20)} <= {1, 3}  # ties at the k-th value kept
    nucleus = ReasonRequest(torch.arange(1), 1, temperature=1.0, top_p=0.3)
    assert {choose_token(torch.tensor([5.0, 0.0, 0.0]), nucleus, g) for _ in range(20)} == {0}


def test_reference_reason_stops_at_eos():
    model = load_transformer(CFG, STATE)
    first = reason(model, ReasonRequest(torch.arange(5), 4)).tokens
    res = reason(model, ReasonRequest(torch.arange(5), 4, eos_token_id=first[1]))
    assert res.tokens == first[:2] and res.stopped_by == "eos"
    got = engine().reason(ReasonRequest(torch.arange(5), 4, eos_token_id=first[1]))
    assert got["tokens"] == first[:2] and got["stopped_by"] == "eos"
