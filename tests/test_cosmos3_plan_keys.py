"""cosmos3 caches and scheduling know the parallel layout (issue #12 item 4): the plan's hash is in every und (text)
K/V CacheKey and every GraphKey of the step body, so nothing computed under one layout is served under another; the
denoise plan's step bytes / cost are per rank and keyed on the plan; its `graph_bucket` names the padded shape bucket
so the scheduler can group members onto an already captured body; the admission reservation holds this rank's text
K/V heads. All single-process: the plan is attached as a bare (plan, world_size) mesh, which keys and plans exactly
as a rank does but runs the one-process body."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.io import Cosmos3ForwardInputs
from manifests.cosmos3.sampling import Cosmos3GenerateRequest
from optimized.models.cosmos3 import PARALLELISM, Cosmos3Fast
from optimized.models.cosmos3.loops import FlowDenoiseLoop
from optimized.parallel.plan import ParallelPlan
from optimized.runtime.cache import CacheStore
from optimized.runtime.family import seeded_random_state
from optimized.runtime.scheduler import CostModel, WorkUnitScheduler

VARIANT = "tiny"   # 3 layers, 4 heads, 2 KV heads, head_dim 16, hidden 64, patch 2


@pytest.fixture(scope="module")
def tiny():
    cfg = load_variant(VARIANT)
    return cfg, seeded_random_state(canonical_key_shapes(cfg), 0)


def fast_model(tiny, und_cache: CacheStore | None = None, plan: str | None = None) -> Cosmos3Fast:
    cfg, sd = tiny
    fast = Cosmos3Fast(cfg, sd, weights_version="w", und_cache=und_cache)
    if plan is not None:
        attach(fast, plan)
    return fast


def attach(fast: Cosmos3Fast, plan: str) -> ParallelPlan:
    p = ParallelPlan.parse(plan)
    PARALLELISM(fast, SimpleNamespace(plan=p, world_size=p.world_size))
    return p


def inputs(cfg, text_len: int = 7, seed: int = 0) -> list[Cosmos3ForwardInputs]:
    g = torch.Generator().manual_seed(seed)
    return [Cosmos3ForwardInputs(text_ids=torch.randint(1, 100, (text_len,), generator=g), timestep=500,
                                 fps_vision=16.0,
                                 vision_latents=torch.randn(1, cfg.latent_channels, 2, 4, 6, generator=g))]


def request(text_len: int = 7, neg_len: int = 5, latent=(2, 4, 6), guidance: float = 5.0) -> Cosmos3GenerateRequest:
    T, H, W = latent
    return Cosmos3GenerateRequest(text_ids=torch.arange(1, text_len + 1),
                                  negative_text_ids=torch.arange(1, neg_len + 1),
                                  latent_frames=T, latent_height=H, latent_width=W, num_steps=2,
                                  guidance_scale=guidance, seed=0)


# ---- item 1: keys -----------------------------------------------------------------------------------------------

def test_graph_keys_name_the_plan_and_a_body_built_under_one_plan_misses_under_another(tiny):
    cfg, _ = tiny
    fast = fast_model(tiny)
    fast.forward_batch(inputs(cfg))
    assert [k.parallel_plan_hash for k in fast.graph_cache.keys()] == ["single"]
    plan = attach(fast, "cfgp2")
    misses = fast.graph_cache.stats.misses
    fast.forward_batch(inputs(cfg))
    assert fast.graph_cache.stats.misses == misses + 1                 # the one-process body is not reused
    assert sorted(k.parallel_plan_hash for k in fast.graph_cache.keys()) == sorted(["single", plan.hash()])
    attach(fast, "ulysses2")                                            # another plan: a third body
    fast.forward_batch(inputs(cfg))
    assert fast.graph_cache.stats.misses == misses + 2


def test_und_cache_filled_under_one_plan_misses_under_another(tiny):
    cfg, _ = tiny
    store = CacheStore(1 << 26, name="shared")
    single = fast_model(tiny, store)
    single.forward_batch(inputs(cfg))
    (single_key,) = store.keys()
    assert single_key.parallel_plan_hash == "single"
    for plan in ("ulysses2", "cfgp2", "ulysses2,ring2"):
        fast = fast_model(tiny, store, plan)
        fast.forward_batch(inputs(cfg))
        assert (fast.stats.und_cache_hits, fast.stats.und_cache_misses) == (0, 1), plan   # never the other layout's
        fast.forward_batch(inputs(cfg))
        assert fast.stats.und_cache_hits == 1, plan                                         # its own entry
        assert fast.und_cache_key(inputs(cfg)[0].text_ids).parallel_plan_hash == ParallelPlan.parse(plan).hash()
    assert len(store) == 4
    single.stats.reset()
    single.forward_batch(inputs(cfg))
    assert (single.stats.und_cache_hits, single.stats.und_cache_misses) == (1, 0)


def test_plan_keys_survive_a_patched_key_and_follow_a_new_plan(tiny):
    """The key reads the model's plan itself: an instance-level patch of `und_cache_key` (how parity plants the
    stale-und-cache fault) removed again leaves the plan in the key, and attaching another plan (a degree-1 one
    included) re-keys both caches."""
    fast = fast_model(tiny, plan="ulysses2")
    ids = torch.arange(1, 6)
    plan_key = fast.und_cache_key(ids)
    assert plan_key.parallel_plan_hash == ParallelPlan.parse("ulysses2").hash()
    original = fast.und_cache_key
    fast.und_cache_key = lambda text_ids, *a, **kw: dataclasses.replace(original(text_ids, *a, **kw), input_hashes=())
    del fast.und_cache_key
    assert fast.und_cache_key(ids) == plan_key
    attach(fast, "")                                                    # back to one process
    assert fast.und_cache_key(ids).parallel_plan_hash == "single" == fast.graph_cache.parallel_plan_hash
    assert fast.sequence_parallel is None
    assert dataclasses.replace(fast.und_cache_key(ids), parallel_plan_hash=plan_key.parallel_plan_hash) == plan_key


# ---- item 2: the denoise plan -------------------------------------------------------------------------------------

def plan_and_admission(tiny, plan: str | None, req: Cosmos3GenerateRequest | None = None):
    loop = FlowDenoiseLoop(fast_model(tiny, plan=plan))
    state = loop.init_state(req or request())
    return loop.plan_step(state), loop.admission(state).device_bytes


def test_step_bytes_and_cost_are_per_rank_and_keyed_on_the_plan(tiny):
    cfg, _ = tiny
    text, gen = 7, 2 * math.ceil(4 / cfg.patch_size) * math.ceil(6 / cfg.patch_size)   # 7 text + 12 gen tokens
    single, _ = plan_and_admission(tiny, None)
    cfgp, _ = plan_and_admission(tiny, "cfgp2")
    uly, _ = plan_and_admission(tiny, "ulysses2")
    both, _ = plan_and_admission(tiny, "cfgp2,ulysses2,ring2")
    assert single.parallel_plan_hash == "single" and cfgp.parallel_plan_hash.startswith("cfgp2@")
    assert len({CostModel.key(p) for p in (single, cfgp, uly, both)}) == 4
    assert single.shape_signature == cfgp.shape_signature                       # same step, another layout
    # cfgp: one of the two CFG branches per rank
    assert cfgp.resources.device_bytes * 2 == single.resources.device_bytes
    assert cfgp.resources.cost_seconds * 2 == pytest.approx(single.resources.cost_seconds)
    # ulysses x ring: gen tokens split, the text stream whole on every rank
    assert uly.resources.cost_seconds == pytest.approx(single.resources.cost_seconds * (text + gen / 2) / (text + gen))
    assert both.resources.cost_seconds == pytest.approx(single.resources.cost_seconds * (text + gen / 4)
                                                        / (text + gen) / 2)
    assert uly.resources.device_bytes < single.resources.device_bytes
    # an unguided request under cfgp2: no branch to split, every rank runs its one row
    unguided = request(guidance=1.0)
    solo_single, _ = plan_and_admission(tiny, None, unguided)
    solo_cfgp, _ = plan_and_admission(tiny, "cfgp2", unguided)
    assert solo_cfgp.resources.device_bytes == solo_single.resources.device_bytes


def test_graph_bucket_names_padded_text_gen_and_rows(tiny):
    a, _ = plan_and_admission(tiny, None, request(text_len=7))
    b, _ = plan_and_admission(tiny, None, request(text_len=9))                  # same text bucket (multiple of 16)
    c, _ = plan_and_admission(tiny, None, request(text_len=7, latent=(2, 4, 40)))   # 80 gen tokens: next gen bucket
    d, _ = plan_and_admission(tiny, None, request(text_len=20))                  # next text bucket
    assert a.graph_bucket and a.shape_signature != b.shape_signature
    assert a.graph_bucket == b.graph_bucket == "text=16/16;gen=64;rows=2"
    assert len({a.graph_bucket, c.graph_bucket, d.graph_bucket}) == 3
    cfgp, _ = plan_and_admission(tiny, "cfgp2", request(text_len=7))
    assert cfgp.graph_bucket == "text=16/16;gen=64;rows=1"                      # one branch of it on this rank


def test_scheduler_groups_cosmos3_requests_by_captured_bucket(tiny):
    """A group that must be split takes the members whose bucket composition already has a captured body: two
    requests of other text lengths in the warm bucket go together, the one of another gen bucket waits."""
    loop = FlowDenoiseLoop(fast_model(tiny))
    plan = lambda req: loop.plan_step(loop.init_state(req))                    # noqa: E731
    warm = [plan(request(text_len=7)), plan(request(text_len=8))]              # the batch that was captured
    rest = {"r0": plan(request(text_len=9)), "r1": plan(request(text_len=7, latent=(2, 4, 40))),
            "r2": plan(request(text_len=11))}
    sched = WorkUnitScheduler(max_batch=2, batching="greedy")
    group = (id(loop), warm[0].batch_key)
    sched.warm[(group, sched._buckets(warm))] = None                           # what _run_group records
    sched.graph_groups.add(group)
    assert sched._chunks(group, ["r0", "r1", "r2"], rest) == [["r0", "r2"], ["r1"]]


# ---- item 3: admission --------------------------------------------------------------------------------------------

def test_admission_holds_this_ranks_text_kv_heads(tiny):
    cfg, _ = tiny
    kv_whole = 2 * cfg.num_layers * (7 + 5) * cfg.num_kv_heads * cfg.head_dim * 4   # cond + uncond text, fp32
    _, single = plan_and_admission(tiny, None)
    _, cfgp = plan_and_admission(tiny, "cfgp2")
    _, ring = plan_and_admission(tiny, "ring2")
    _, uly2 = plan_and_admission(tiny, "ulysses2")
    _, uly4 = plan_and_admission(tiny, "ulysses4")
    assert cfgp == single and ring == single           # whole latents and text K/V on every rank
    assert single - uly2 == kv_whole // 2              # 2 KV heads over ulysses 2: one per rank
    assert uly4 == uly2                                # ulysses 4 > 2 KV heads: each replicated, still one per rank
