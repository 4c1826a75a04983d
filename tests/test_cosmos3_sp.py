"""cosmos3 under parallel plans (optimized/models/cosmos3/parallelize.py, parity/families/cosmos3/parallel.py):
Ulysses / ring SP of the packed gen stream with the und K/V sharded by heads, CFG-parallel, on gloo ranks.

Default run: a degree-1 mesh leaves the model bitwise as it was; an invalid plan exits 2 naming the constraint (the
GQA KV-replication rule included); ulysses2 on two ranks equals one process on a batch whose gen stream must be
padded for SP, with the und cache hit and sharded by heads. Slow: the other plans' forwards (ring2, ulysses4 with
KV replication, ulysses2 x ring2), C1 (the loop cases of `fvparity run cosmos3 --level C1 --plan ...`, a few each) for
cfgp2, ulysses2, ring2, cfgp2,ulysses2, ulysses2,ring2 and ulysses4, and the negative controls (heads permuted in the all-to-all, CFG branches swapped across ranks) that
must fail naming the step and layer."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.io import Cosmos3ForwardInputs
from optimized.models.cosmos3 import PARALLELISM, Cosmos3Fast
from optimized.parallel.mesh import ParallelMesh, build_mesh
from optimized.parallel.plan import ParallelPlan, ParallelPlanError
from optimized.runtime.compile import ShapeBuckets
from optimized.runtime.family import seeded_random_state

VARIANT = "tiny"
EXACT = ShapeBuckets(multiple={"text": 1, "gen": 1})   # gen_pad = the longest sample: 18 rows, not a multiple of 4


def model(exact_buckets: bool = True) -> Cosmos3Fast:
    cfg = load_variant(VARIANT)
    fast = Cosmos3Fast(cfg, seeded_random_state(canonical_key_shapes(cfg), 0))
    return fast.configure_graph(buckets=EXACT) if exact_buckets else fast


def batch(cfg) -> list[Cosmos3ForwardInputs]:
    """Two samples of different shapes and timesteps; the second carries sound (18 and 19 gen tokens: with exact
    buckets the gen stream is 19 rows, padded to 20 for SP and the pad keys masked)."""
    g = torch.Generator().manual_seed(0)
    return [Cosmos3ForwardInputs(text_ids=torch.randint(1, 100, (7,), generator=g), timestep=500, fps_vision=16.0,
                                 vision_latents=torch.randn(1, cfg.latent_channels, 3, 4, 6, generator=g)),
            Cosmos3ForwardInputs(text_ids=torch.randint(1, 100, (5,), generator=g), timestep=900, fps_vision=16.0,
                                 vision_latents=torch.randn(1, cfg.latent_channels, 2, 4, 6, generator=g),
                                 sound_latents=torch.randn(cfg.sound_dim, 7, generator=g),
                                 fps_sound=float(cfg.sound_latent_fps))]


def outputs(preds) -> list[torch.Tensor]:
    return [t for p in preds for t in (p.vision, p.sound) if t is not None]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _sp_forward_worker(group, plan: str) -> dict:
    fast = model()
    PARALLELISM(fast, build_mesh(ParallelPlan.parse(plan)))
    first = outputs(fast.forward_batch(batch(fast.cfg)))
    second = outputs(fast.forward_batch(batch(fast.cfg)))             # the und stream from the (sharded) cache
    cached = [fast.und_cache.get(fast.und_cache_key(x.text_ids)) for x in batch(fast.cfg)]
    return {"first": first, "second": second, "hits": fast.stats.und_cache_hits,
            "und_heads": [None if c is None else c.k.shape[2] for c in cached],
            "sent": {a: fast.parallel_mesh.axis(a).stats["bytes_sent"] for a in ("sp_ulysses", "sp_ring")}}


def check_sp_forward(plan: str, world: int) -> list[dict]:
    from optimized.parallel.launch import run_ranks

    one = model()
    want = outputs(one.forward_batch(batch(one.cfg)))
    ranks = run_ranks(_sp_forward_worker, world, (plan,), timeout_s=300)
    for r in ranks:
        assert r["hits"] == 2                                              # both prompts served from the cache
        for got, w in zip(r["first"] + r["second"], want + want):
            assert rel_l2(got, w) < 1e-6, (plan, rel_l2(got, w))
    return ranks


# ---- default run ---------------------------------------------------------------------------------------------

def test_degree_one_mesh_is_the_single_process_path():
    fast = model(exact_buckets=False)
    want = outputs(fast.forward_batch(batch(fast.cfg)))
    PARALLELISM(fast, ParallelMesh.single())
    assert fast.sequence_parallel is None
    fast.clear_und_cache()
    assert all(torch.equal(a, b) for a, b in zip(outputs(fast.forward_batch(batch(fast.cfg))), want))


def test_plans_refused_naming_the_constraint():
    cfg = load_variant(VARIANT)                                            # 4 heads, 2 KV heads
    assert PARALLELISM.validate(ParallelPlan.parse("ulysses4"), cfg, 4)     # 2 KV heads replicated 2x (declared)
    with pytest.raises(ParallelPlanError, match="4 heads are not divisible by ulysses x tp = 3 x 1 = 3"):
        PARALLELISM.validate(ParallelPlan.parse("ulysses3"), cfg, 3)
    odd_kv = dataclasses.replace(cfg, num_heads=6, num_kv_heads=3)
    with pytest.raises(ParallelPlanError, match="3 KV heads are not divisible by ulysses x tp = 2, nor does"):
        PARALLELISM.validate(ParallelPlan.parse("ulysses2"), odd_kv, 2)
    with pytest.raises(ParallelPlanError, match="world size 4"):
        PARALLELISM.validate(ParallelPlan.parse("cfgp2,ulysses2"), cfg, 2)


def test_invalid_plan_exits_2_naming_the_constraint():
    bad = subprocess.run([sys.executable, "-m", "parity.cli", "run", "cosmos3", "--level", "C1", "--variant", VARIANT,
                          "--plan", "ulysses3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr
    assert "4 heads are not divisible by ulysses x tp = 3 x 1 = 3" in bad.stderr
    from parity.errors import SetupError
    from parity.families.cosmos3.parallel import run_c1
    with pytest.raises(SetupError, match="give a plan with sp_ulysses > 1"):     # a fault the plan cannot reach
        run_c1([VARIANT], None, "cpu", ["fp32"], 0, "ulysses-heads-permuted", lambda msg: None, plan="cfgp2")


def test_parallel_faults_are_declared_apart_from_the_one_process_faults():
    from parity.families.cosmos3 import faults
    assert {f.name for f in faults.PARALLEL_FAULT_DECLS} == set(faults.PARALLEL_FAULT_AXES)
    assert not {f.name for f in faults.FAULTS} & set(faults.PARALLEL_FAULT_AXES)   # one process cannot plant them


@pytest.mark.dist
def test_ulysses2_forward_equals_one_process_with_padding_and_sharded_und_cache():
    ranks = check_sp_forward("ulysses2", 2)
    for r in ranks:
        assert r["sent"]["sp_ulysses"] > 0
        assert r["und_heads"] == [1, 1]               # cached und K/V [layers, L, 1 of the 2 KV heads, d] per prompt


# ---- slow: other plans, C1 per plan, negative controls ----------------------------------------------------------

@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan,world", [("ring2", 2), ("ulysses4", 4), ("ulysses2,ring2", 4)])
def test_sp_forward_other_plans(plan, world):
    ranks = check_sp_forward(plan, world)
    axes = ParallelPlan.parse(plan)
    assert all(r["sent"][a] > 0 for r in ranks for a in ("sp_ulysses", "sp_ring") if axes.degree(a) > 1)
    if axes.sp_ulysses == 4:                          # 2 KV heads replicated over 4 ranks: one head each
        assert all(r["und_heads"] == [1, 1] for r in ranks)


def c1(plan: str, fault: str | None = None, only=("t2v",), graph: str = "eager"):
    from parity.families.cosmos3.parallel import run_c1
    return run_c1([VARIANT], None, "cpu", ["fp32"], 0, fault, lambda msg: None, only=only, plan=plan, graph=graph)


def _compiled_on_every_rank(report, world: int) -> None:
    rows = [c for c in report.checks if c.name.endswith("/graph_compile")]
    assert {f"/rank{r}/" for r in range(world)} <= {f"/rank{c.name.split('/rank')[1].split('/')[0]}/" for c in rows}
    assert all(c.passed and "compiled@" in c.detail and "graph breaks" in c.detail for c in rows), rows[0].detail


@pytest.mark.dist
@pytest.mark.slow   # compile-heavy on two ranks (~1.5 min on 2 cores); the default run keeps tests/test_compile.py
def test_c1_ulysses2_compiled_passes_with_collectives_between_compiled_regions():
    """--graph compile under a plan: every rank's step body is compiled (dynamo graphs > 0, its graph broken at each
    collective, which runs eagerly with its byte count), every step within the loop tolerance of the reference."""
    report = c1("ulysses2", graph="compile")
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    _compiled_on_every_rank(report, 2)
    assert all(c.passed for c in report.checks if c.name.endswith("/axes_exchanged"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan,only", [("cfgp2,ulysses2", ("t2v", "concurrent3", "sound")), ("cfgp2", ("t2v",)),
                                       ("ulysses2", ("t2v", "policy")), ("ring2", ("t2v",)),
                                       ("ulysses2,ring2", ("t2v",)), ("ulysses4", ("t2v",))])
def test_c1_plan_passes(plan, only):
    report = c1(plan, only=only)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    names = {c.name for c in report.checks}
    world = ParallelPlan.parse(plan).world_size
    assert any(f"/rank{world - 1}/" in n and n.endswith("/step3") for n in names)   # every rank, every step
    assert any("/vs_one_process:" in n for n in names)                              # SP=N vs one process
    assert any(n.endswith("/axes_exchanged") for n in names)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["ring2", "tp2", "cfgp2,ulysses2"])
def test_c1_plan_compiled_passes(plan):
    report = c1(plan, graph="compile")
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    _compiled_on_every_rank(report, ParallelPlan.parse(plan).world_size)


@pytest.mark.dist
@pytest.mark.slow
def test_heads_permuted_fails_the_compiled_plan_too():
    report = c1("ulysses2", "ulysses-heads-permuted", graph="compile")
    bad = [c for c in report.checks if not c.passed and "/step" in c.name]
    assert bad and any("step 0" in (c.divergence or "") for c in bad), [(c.name, c.divergence) for c in bad][:4]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan,fault,where", [
    ("ulysses2", "ulysses-heads-permuted", "step 0, cond branch, layer layers.0.gen"),
    ("cfgp2", "cfg-branches-swapped", "step 0, no layer")])
def test_parallel_faults_fail_naming_step_and_layer(plan, fault, where):
    report = c1(plan, fault)
    bad = [c for c in report.checks if not c.passed]
    assert bad, f"C1 passed with {fault} planted"
    assert any(where in (c.divergence or "") for c in bad), [(c.name, c.divergence) for c in bad][:6]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan,fault", [("ulysses2", None), ("ring2", None), ("cfgp2,ulysses2", None),
                                        ("ulysses2", "ulysses-heads-permuted")])
def test_c0_per_plan_forward_rows(plan, fault):
    """C0 per plan: every rank's parallel transformer on the reference's inputs of every step vs the reference."""
    from parity.families.cosmos3.cases import STEPS
    rows = [c for c in c1(plan, fault).checks if "/forward_step" in c.name]
    world = ParallelPlan.parse(plan).world_size
    assert {(r, s) for r in range(world) for s in range(STEPS)} == \
        {(r, s) for c in rows for r in range(world) for s in range(STEPS) if f"/rank{r}/forward_step{s}:" in c.name}
    if fault is None:
        assert all(c.passed for c in rows), [(c.name, c.metrics) for c in rows if not c.passed][:4]
    else:                                              # every row fails, naming the layer of the permuted heads
        assert not any(c.passed for c in rows)
        assert all("cond branch, layer layers.0.gen" in (c.divergence or "") for c in rows), rows[0].divergence


# ---- the plan's own cases (issue 29) ---------------------------------------------------------------------------

def test_cfgp_plan_adds_a_mixed_rows_batch_split_inside_a_branch():
    """Under cfgp the plan runs guided and unguided requests in one same-tick batch whose rows the 2-rank split cuts
    inside a branch (c1's batch_position batch, 3 cond + 2 uncond rows, splits exactly at the branch)."""
    from parity.families.cosmos3.parallel import plan_cases

    cfg = load_variant(VARIANT)
    for matrix in ("ci", "full"):
        mixed = [c for c in plan_cases(cfg, ParallelPlan.parse("cfgp2"), matrix) if "cfgp_mixed_rows" in c.rules]
        assert len(mixed) == (1 if matrix == "ci" else 3)
        for case in mixed:
            guided = sum(r.guidance_scale != 1.0 for r in case.requests)
            cond_rows = len(case.requests)
            assert 0 < guided < cond_rows and set(case.start_ticks) == {0}
            assert -(-(cond_rows + guided) // 2) != cond_rows, case.name   # rank 0's rows end inside a branch
    assert not any("cfgp_mixed_rows" in c.rules for c in plan_cases(cfg, ParallelPlan.parse("ulysses2")))


@pytest.mark.dist
@pytest.mark.slow
def test_cfg_rows_halved_fails_the_same_tick_batches():
    """The halved predictions make a mixed batch's step fail; the scheduler reruns its requests one by one, so the
    batches that never formed fail (every rank and request of the same-tick cases), clean they pass."""
    only = ("cfgp_mixed_rows", "batch_position")
    clean = c1("cfgp2", only=only)
    assert clean.passed, [(c.name, c.detail) for c in clean.checks if not c.passed][:5]
    bad = [c for c in c1("cfgp2", "cfg-rows-halved", only=only).checks if not c.passed]
    batched = [c for c in bad if c.name.endswith("/batched_with_others")]
    assert len(batched) > 1 and any("/cfgp_mixed_rows." in c.name for c in batched), [c.name for c in bad]
    assert {"rank0", "rank1"} <= {p for c in batched for p in c.name.split("/")}
