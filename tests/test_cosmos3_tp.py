"""cosmos3 tensor parallel (optimized/models/cosmos3/tp.py): q / k / v by heads (GQA KV heads replicated when tp
exceeds them), o_proj / down_proj row-parallel, MLP gate / up column-parallel, in the und and gen pathways.

Default run: the slice map (column / row / replicated, the KV replication rule); a canonical checkpoint read as each
rank's slices only; invalid tp degrees refused at load with exit 2 naming the constraint; the AR decode loop under
tp2 on two gloo ranks gives the one-process tokens and logits; a tp2 forward on two gloo ranks equals one process
(both pathways: the und stream computed and then served from the rank's own cache) while every rank holds only its
slices. Slow + dist: tp4 (KV heads replicated), ulysses2 x tp2, C1 for tp2 / cfgp2,tp2 / ulysses2,tp2 (`fvparity
run cosmos3 --level C1 --plan tp2`), and the negative control (a row-parallel shard loaded from the next rank's
slice) failing at the named step and layer."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.io import Cosmos3ForwardInputs
from optimized.models.cosmos3 import PARALLELISM, Cosmos3Fast
from optimized.models.cosmos3.tp import kv_head_span, tp_slice
from optimized.parallel.mesh import build_mesh
from optimized.parallel.plan import ParallelPlan, ParallelPlanError
from optimized.runtime.family import seeded_random_state
from tests.test_compile import _reason_all
from tests.test_cosmos3_sp import EXACT, outputs, rel_l2
from tests.test_cosmos3_sp import batch as sound_batch

VARIANTS = ("tiny", "tiny-edge")   # silu (fused gate_up) and relu2 (up_proj, k_norm_for_gen)


class FakeAxis:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def batch(cfg) -> list[Cosmos3ForwardInputs]:
    """test_cosmos3_sp's two samples (different shapes, timesteps; the second with sound where the model has it)."""
    if cfg.has_sound:
        return sound_batch(cfg)
    g = torch.Generator().manual_seed(0)
    return [Cosmos3ForwardInputs(text_ids=torch.randint(1, 100, (n,), generator=g), timestep=t, fps_vision=16.0,
                                 vision_latents=torch.randn(1, cfg.latent_channels, f, 4, 6, generator=g))
            for n, t, f in ((7, 500, 3), (5, 900, 2))]


def model(variant: str = "tiny") -> Cosmos3Fast:
    cfg = load_variant(variant)
    return Cosmos3Fast(cfg, seeded_random_state(canonical_key_shapes(cfg), 0)).configure_graph(buckets=EXACT)


def test_slice_map():
    cfg = load_variant("tiny")                     # 4 heads, 2 KV heads, head_dim 16, hidden 64, ffn 96
    d = cfg.head_dim
    r1 = FakeAxis(1, 2)
    assert tp_slice("layers.0.gen.q_proj.weight", (4 * d, 64), r1, cfg) == (0, 2 * d, 2 * d)
    assert tp_slice("layers.2.und.k_proj.weight", (2 * d, 64), r1, cfg) == (0, d, d)
    assert tp_slice("layers.0.und.o_proj.weight", (64, 4 * d), r1, cfg) == (1, 2 * d, 2 * d)
    assert tp_slice("layers.1.gen.mlp.gate_proj.weight", (96, 64), r1, cfg) == (0, 48, 48)
    assert tp_slice("layers.1.gen.mlp.down_proj.weight", (64, 96), r1, cfg) == (1, 48, 48)
    for replicated in ("layers.0.gen.q_norm.weight", "layers.0.gen.attn_norm.weight", "layers.0.und.o_proj.bias",
                       "embed_tokens.weight", "vision_in.weight", "gen_norm.weight"):
        assert tp_slice(replicated, (64,), r1, cfg) is None, replicated
    # GQA: tp 4 over 2 KV heads -> ranks 0, 1 read KV head 0 and ranks 2, 3 KV head 1 (query heads r -> kv r // 2)
    assert [kv_head_span(2, FakeAxis(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [tp_slice("layers.0.gen.v_proj.weight", (2 * d, 64), FakeAxis(r, 4), cfg)[1] for r in range(4)] == \
        [0, 0, d, d]


def test_checkpoint_shards_read_only_their_slices(tmp_path, monkeypatch):
    from converters import convert
    from manifests.checkpoint import load_state, read_checkpoint
    from optimized.models.cosmos3 import tp as cosmos3_tp
    from tests.test_converters import make_diffusers_ckpt

    src, _ = make_diffusers_ckpt(tmp_path / "src", "tiny")
    convert("cosmos3", "diffusers", src, tmp_path / "ckpt")
    ckpt = read_checkpoint(tmp_path / "ckpt")
    cfg, whole = ckpt.typed_config(), load_state(ckpt)
    reads: list[tuple[tuple[int, ...], int, int]] = []
    from optimized.parallel import tp as tp_primitives   # the one sharded reader (both families)
    real = tp_primitives.read_slice

    def counting(file, offset, dtype, shape, dim, start, length):
        reads.append((tuple(shape), dim, length))
        return real(file, offset, dtype, shape, dim, start, length)
    monkeypatch.setattr(tp_primitives, "read_slice", counting)
    for r in range(2):
        axis = FakeAxis(r, 2)
        got = cosmos3_tp.read_sharded_state(ckpt.component(), cfg, axis)
        for k, v in whole.items():
            sl = tp_slice(k, tuple(v.shape), axis, cfg)
            assert torch.equal(got[k], v if sl is None else v.narrow(*sl)), k
    sharded = [(s, d, n) for s, d, n in reads if n != s[d]]
    assert len(sharded) == 2 * sum(cosmos3_tp.tp_dim(k) is not None for k in whole)
    assert all(n * 2 == s[d] for s, d, n in sharded)                   # half of each sharded tensor, never all


def test_invalid_tp_refused_with_exit_2():
    cfg = load_variant("tiny")
    assert PARALLELISM.validate(ParallelPlan.parse("tp2"), cfg, 2)
    assert PARALLELISM.validate(ParallelPlan.parse("tp4"), cfg, 4)             # 2 KV heads replicated 2x
    with pytest.raises(ParallelPlanError, match="4 heads are not divisible by ulysses x tp = 1 x 3 = 3"):
        PARALLELISM.validate(ParallelPlan.parse("tp3"), cfg, 3)
    with pytest.raises(ParallelPlanError, match="ulysses x tp = 2 x 4 = 8"):
        PARALLELISM.validate(ParallelPlan.parse("ulysses2,tp4"), cfg, 8)
    six_kv = dataclasses.replace(cfg, num_heads=12, num_kv_heads=6)   # ulysses3 x tp4 = 12 replicates 6 KV heads,
    with pytest.raises(ParallelPlanError, match="6 KV heads can be neither split nor replicated over tp = 4"):
        PARALLELISM.validate(ParallelPlan.parse("ulysses3,tp4"), six_kv, 12)   # but tp4 alone can't share them out
    bad = subprocess.run([sys.executable, "-m", "parity.cli", "run", "cosmos3", "--level", "C1", "--variant", "tiny",
                          "--plan", "tp3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr
    assert "4 heads are not divisible by ulysses x tp = 1 x 3 = 3" in bad.stderr


def _reason_requests(cfg):
    from manifests.cosmos3.reasoning import ReasonRequest
    g = torch.Generator().manual_seed(6)
    return [ReasonRequest(prompt_ids=torch.randint(0, cfg.vocab_size, (9 + k,), generator=g), max_new_tokens=6,
                          temperature=0.0 if k == 0 else 0.9, top_k=0 if k == 0 else 30, seed=k) for k in range(3)]


def _tp_reason_worker(group, plan: str, variant: str) -> dict:
    import optimized
    from optimized.models.cosmos3 import FAMILY

    fast = model(variant)
    PARALLELISM(fast, build_mesh(ParallelPlan.parse(plan)))
    eng = optimized.Engine(fast, FAMILY, kv_block_size=4, batching="greedy")
    got, _ = _reason_all(eng, _reason_requests(fast.cfg))
    return {"tokens": [g["tokens"] for g in got], "logits": [torch.stack(g["logits"]) for g in got],
            "pool_heads": eng.loop("reasoning").pool.k.shape[3],
            "sent": fast.parallel_mesh.axis("tp").stats["bytes_sent"]}


@pytest.mark.dist
def test_ar_reasoning_under_tp2_equals_one_process():
    """The AR decode loop under tp2: each rank's KV pool holds its KV head, o_proj / down_proj partial sums are
    all-reduced; prefill + decode steps give the one-process tokens, and logits within 1e-6 (rel L2), on every
    rank, for both variants (silu / relu2 with keys-for-gen)."""
    import optimized
    from optimized.models.cosmos3 import FAMILY
    from optimized.parallel.launch import run_ranks

    for variant in VARIANTS:
        one = model(variant)
        want, _ = _reason_all(optimized.Engine(one, FAMILY, kv_block_size=4, batching="greedy"),
                              _reason_requests(one.cfg))
        for r in run_ranks(_tp_reason_worker, 2, ("tp2", variant), timeout_s=300):
            assert r["pool_heads"] == 1 and r["sent"] > 0               # 1 of the 2 KV heads; partial sums moved
            assert r["tokens"] == [w["tokens"] for w in want]
            for got, w in zip(r["logits"], want):
                assert rel_l2(got, torch.stack(w["logits"])) < 1e-6, variant


def _tp_forward_worker(group, plan: str, variant: str) -> dict:
    fast = model(variant)
    full = {k: v.numel() for k, v in fast.params.items()}
    PARALLELISM(fast, build_mesh(ParallelPlan.parse(plan)))
    first = outputs(fast.forward_batch(batch(fast.cfg)))
    second = outputs(fast.forward_batch(batch(fast.cfg)))             # the und stream from this rank's cache
    cached = [fast.und_cache.get(fast.und_cache_key(x.text_ids)) for x in batch(fast.cfg)]
    return {"first": first, "second": second, "hits": fast.stats.und_cache_hits,
            "und_heads": [None if c is None else c.k.shape[2] for c in cached],
            "held": {k: v.numel() / full[k] for k, v in fast.params.items()},
            "sent": {a: fast.parallel_mesh.axis(a).stats["bytes_sent"] for a in ("tp", "sp_ulysses")}}


def check_tp_forward(plan: str, world: int, variant: str = "tiny") -> list[dict]:
    from optimized.parallel.launch import run_ranks

    one = model(variant)
    want = outputs(one.forward_batch(batch(one.cfg)))
    ranks = run_ranks(_tp_forward_worker, world, (plan, variant), timeout_s=300)
    for r in ranks:
        assert r["hits"] == 2                                              # both prompts served from the cache
        assert r["sent"]["tp"] > 0
        for got, w in zip(r["first"] + r["second"], want + want):
            assert rel_l2(got, w) < 1e-6, (plan, variant, rel_l2(got, w))
    return ranks


@pytest.mark.dist
def test_tp2_forward_equals_one_process_holding_only_its_slices():
    n = 2
    for variant in VARIANTS:
        ranks = check_tp_forward("tp2", n, variant)
        for r in ranks:
            assert r["und_heads"] == [1, 1]               # cached und K/V: this rank's 1 of the 2 KV heads
            held = r["held"]
            for key in ("layers.0.und.qkv.weight", "layers.2.gen.o_proj.weight", "layers.1.gen.mlp.down_proj.weight"):
                assert held[key] == pytest.approx(1 / n), (variant, key, held[key])
            assert held["embed_tokens.weight"] == 1 and held["layers.0.gen.q_norm.weight"] == 1


# ---- slow: other plans, C1, the negative control --------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan,world", [("tp4", 4), ("ulysses2,tp2", 4)])
def test_tp_forward_other_plans(plan, world):
    ranks = check_tp_forward(plan, world)
    assert all(r["und_heads"] == [1, 1] for r in ranks)   # 2 KV heads over a head split of 4: one each (replicated)
    if "ulysses" in plan:
        assert all(r["sent"]["sp_ulysses"] > 0 for r in ranks)


def c1(plan: str, fault: str | None = None, only=("t2v",)):
    from parity.families.cosmos3.parallel import run_c1
    return run_c1(list(VARIANTS), None, "cpu", ["fp32"], 0, fault, lambda msg: None, only=only, plan=plan)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan,only", [("tp2", ("t2v", "sound")), ("cfgp2,tp2", ("t2v",)),
                                       ("ulysses2,tp2", ("t2v",))])
def test_c1_tp_plan_passes(plan, only):
    report = c1(plan, only=only)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    names = {c.name for c in report.checks}
    world = ParallelPlan.parse(plan).world_size
    assert any(f"/rank{world - 1}/" in n and n.endswith("/step3") for n in names)   # every rank, every step
    assert any("/vs_one_process:" in n for n in names)
    assert all(c.passed for c in report.checks if c.name.endswith("/axes_exchanged"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan,graph", [("tp2", "compile"), ("ulysses2", "eager"), ("cfgp2,tp2", "eager")])
def test_c1_plan_reasoning_rows(plan, graph):
    """A plan run's AR rows: every rank's reasoning (head-sharded under tp, whole under SP / cfgp) vs the reference
    by the one-process AR rule, and every decode step of every rank ran the asked graph."""
    from parity.families.cosmos3.parallel import run_c1
    report = run_c1(["tiny"], None, "cpu", ["fp32"], 0, None, lambda msg: None, only=("ar",), plan=plan, graph=graph)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    world = ParallelPlan.parse(plan).world_size
    names = {c.name for c in report.checks}
    assert {f"tiny/fp32/{plan}/ar/rank{r}/graph_{graph}" for r in range(world)} <= names
    assert any(f"/ar/rank{world - 1}/req" in n and n.endswith(":tokens") for n in names)


@pytest.mark.dist
@pytest.mark.slow
def test_tp_wrong_slice_fails_naming_step_and_layer():
    from parity.families.cosmos3.faults import PARALLEL_FAULT_DECLS
    where = next(f.divergence for f in PARALLEL_FAULT_DECLS if f.name == "tp-wrong-slice")
    assert where == "step 0, cond branch, layer layers.1.gen"
    report = c1("tp2", "tp-wrong-slice")
    bad = [c for c in report.checks if not c.passed]
    assert bad, "C1 passed with tp-wrong-slice planted"
    assert any(where in (c.divergence or "") for c in bad), [(c.name, c.divergence) for c in bad][:6]
