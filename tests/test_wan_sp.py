"""Ulysses / ring sequence parallelism inside the wan DiT, and `fvparity run wan --level C1 --plan ...`: every gloo
rank's per-step latents vs the reference pipeline and vs the engine in one process; the heads-permuted all-to-all
must fail naming step and layer; a plan the model cannot run exits 2 naming the constraint. In-process: a degree-1
mesh leaves the DiT bitwise as it was."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from manifests.wan import load_model_variant
from optimized.models.wan import PARALLELISM
from optimized.models.wan.instance import WanModelInstance
from optimized.parallel.mesh import ParallelMesh, build_mesh
from optimized.parallel.plan import ParallelPlan

VARIANT = "tiny-2.1-t2v"


def c1(plan: str, fault: str | None = None, graph: str = "eager", only: tuple[str, ...] | None = None):
    """wan C1 under `plan` on VARIANT; `only`: the case-name prefixes to run (a representative subset of the plan's
    matrix for the default suite), else the CLI's whole run."""
    from parity.families.wan.c1 import run_c1
    from parity.families.wan.common import resolve_models
    from parity.families.wan.parallel import parse_plan, run_c1_plan
    from parity.report import Report

    if only is None:
        return run_c1([VARIANT], None, "cpu", ["fp32"], 0, fault, lambda msg: None, plan=plan, graph=graph)
    models = resolve_models([VARIANT], None, 0, kinds=("model",))
    return run_c1_plan(Report("wan", "C1", {"variants": [VARIANT]}), models, parse_plan(plan, models, "cpu", fault),
                       "cpu", ["fp32"], 0, fault, lambda msg: None, graph, wanted=lambda name: name.startswith(only))


def fvparity(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parity.cli", *args], capture_output=True, text=True, timeout=300)


def dit_inputs(cfg, grid_hw: tuple[int, int] = (4, 6), frames: int = 2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.dit.in_channels, frames, *grid_hw, generator=g)
    return x, torch.tensor([500.0, 900.0]), torch.randn(2, 12, cfg.dit.text_dim, generator=g)


def _sp_dit_worker(group, plan: str, frames: int, grid_hw: tuple[int, int]) -> torch.Tensor:
    cfg = load_model_variant(VARIANT)
    instance = PARALLELISM(WanModelInstance.random(cfg, 0), build_mesh(ParallelPlan.parse(plan)))
    return instance.dit.forward_batch(*dit_inputs(cfg, grid_hw, frames))


def test_degree_one_mesh_is_the_single_process_path():
    cfg = load_model_variant(VARIANT)
    instance = WanModelInstance.random(cfg, 0)
    want = instance.dit.forward_batch(*dit_inputs(cfg))
    PARALLELISM(instance, ParallelMesh.single())
    assert instance.dit.sp_mesh is None
    assert torch.equal(instance.dit.forward_batch(*dit_inputs(cfg)), want)


def test_invalid_plan_exits_2_naming_the_constraint():
    bad = fvparity("run", "wan", "--level", "C1", "--variant", VARIANT, "--plan", "ulysses3")
    assert bad.returncode == 2, bad.stderr
    assert "2 heads are not divisible by ulysses x tp = 3" in bad.stderr
    other = fvparity("run", "wan", "--level", "C0", "--plan", "ulysses2")      # C0 takes no plan (C1 does)
    assert other.returncode == 2 and "--plan ulysses2 does not apply" in other.stderr, other.stderr


@pytest.mark.dist
def test_c1_ulysses2_passes_on_two_gloo_ranks():
    """A representative subset of the plan's matrix (the whole one: test_c1_other_plans_pass, slow): the task's own
    loop and the padded loop, on the variant and on its 2-heads-per-rank reading."""
    report = c1("ulysses2", only=("t2v_unipc_cfg", "sp_padded_2", "heads4."))
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    names = {c.name for c in report.checks}
    assert any("/rank1/" in n and n.endswith("/step3") for n in names)          # every rank, every step compared
    assert any(n.endswith("/vs_one_process") for n in names)                    # SP=2 vs SP=1 of the engine
    assert any("/sp_padded_2/rank1/" in n for n in names)                        # the padded loop ran and passed
    assert any("/heads4.sp_padded_2/rank1/" in n for n in names)                 # 2 heads per rank, padded
    assert any("/heads4.t2v_unipc_cfg/rank1/dit_step" in n for n in names)       # C0 per plan on that reading


@pytest.mark.dist
@pytest.mark.slow
def test_c1_ulysses2_compiled_passes():
    report = c1("ulysses2", graph="compile")
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    rows = [c for c in report.checks if c.name.endswith("/graph_compile")]
    assert any("/rank1/" in c.name for c in rows)
    assert all("compiled@" in c.detail and "graph breaks" in c.detail for c in rows)


def test_four_head_variant_takes_ulysses4_where_two_heads_are_refused():
    from optimized.parallel.plan import ParallelPlanError

    plan = ParallelPlan.parse("ulysses4")
    assert PARALLELISM.validate(plan, load_model_variant("tiny-2.1-t2v-4h"), 4) == plan
    with pytest.raises(ParallelPlanError, match="not divisible by ulysses x tp = 4"):
        PARALLELISM.validate(plan, load_model_variant(VARIANT), 4)


def test_padded_case_pads_the_sharded_sequence():
    """The sp_padded loop's token count leaves a remainder at every SP degree it is built for (so Ulysses / ring pad
    and mask), while the anchor loops divide 2 and 4 (so only the padded loop exercises the mask)."""
    from parity.families.wan.parallel import padded_case, plan_cases

    cfg = load_model_variant(VARIANT)
    s, t = cfg.vae.spatial_compression * cfg.dit.patch_size[1], cfg.vae.temporal_compression

    def tokens(req):
        return ((req.num_frames - 1) // t + 1) * (req.height // s) * (req.width // s)

    for n in (2, 3, 4, 8):
        assert tokens(padded_case(cfg, n).requests[0]) % n != 0, n
    others = [c for c in plan_cases(cfg, ParallelPlan.parse("ulysses2")) if c.name != "sp_padded_2"]
    assert len(others) > 4 and all(tokens(r) % 4 == 0 for c in others for r in c.requests)
    cfgp = [c.name for c in plan_cases(cfg, ParallelPlan.parse("cfgp2")) if not c.name.startswith("cfgp_mixed_rows")]
    assert cfgp == [c.name for c in others]


@pytest.mark.dist
@pytest.mark.slow
def test_pad_keys_not_masked_fails_in_the_padded_loop_naming_step_and_layer():
    report = c1("ulysses2", fault="pad-keys-not-masked")
    bad = [c for c in report.checks if not c.passed]
    assert bad, "C1 passed with the SP pad keys unmasked"
    # the anchors never pad: only the padded loop fails (on the variant and on its 2-heads-per-rank reading)
    assert all(c.name.split("/")[3] in ("sp_padded_2", "heads4.sp_padded_2") for c in bad), [c.name for c in bad][:6]
    assert any("step 0, cond branch, layer blocks.0" in (c.divergence or "") for c in bad), \
        [(c.name, c.divergence) for c in bad][:6]


@pytest.mark.dist
@pytest.mark.slow
def test_ring_without_max_shift_fails_only_in_the_large_logit_loop_naming_step_and_layer():
    """The anchor loops' logits are O(1), so raw exp sums survive there; the large-logit loop (q / k norm scales
    x 16, logits in the hundreds) must pass clean and fail under the fault at the first self-attention."""
    clean = c1("ring2")
    assert clean.passed, [(c.name, c.detail) for c in clean.checks if not c.passed][:5]
    assert any("/sp_ring_large_logits/rank1/" in c.name for c in clean.checks)   # the loop ran, every rank
    bad = [c for c in c1("ring2", fault="ring-no-max-shift").checks if not c.passed]
    assert bad, "C1 passed with the ring merge's running max removed"
    assert all("/sp_ring_large_logits/" in c.name for c in bad), [c.name for c in bad][:6]
    assert any("step 0, cond branch, layer blocks.0" in (c.divergence or "") for c in bad), \
        [(c.name, c.divergence) for c in bad][:6]


def test_large_logit_loop_overflows_exp_and_its_reference_stays_finite():
    """The loop is a real control only if some self-attention logit of every query row exceeds fp32's exp range
    (|s| > 88.7: exp(s) is inf, or every exp(s) of the row 0) while the reference, with the max shift, is finite."""
    import torch.nn.functional as F

    from parity.families.wan.c1 import run_reference
    from parity.families.wan.common import ModelUnderTest, random_model_weights, reference_pipeline
    from parity.families.wan.parallel import large_logit_case, large_logit_model, plan_cases

    cfg = load_model_variant(VARIANT)
    assert [c.name for c in plan_cases(cfg, ParallelPlan.parse("ring2"))][-1] == "sp_ring_large_logits"
    assert "sp_ring_large_logits" not in [c.name for c in plan_cases(cfg, ParallelPlan.parse("ulysses2"))]
    pipe = reference_pipeline(large_logit_model(ModelUnderTest(VARIANT, "model", cfg, random_model_weights(cfg, 0))))
    logits, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, *args, **kw):
        if q.shape[-1] == cfg.dit.head_dim and q.shape[-2] == k.shape[-2]:   # the DiT's self-attention
            logits.append((q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5)
        return sdpa(q, k, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", spy)
        run = run_reference(pipe, large_logit_case(cfg).requests[0])
    assert logits and float(logits[0].abs().amax(-1).min()) > 88.7, float(logits[0].abs().amax(-1).min())
    assert all(torch.isfinite(t).all() for t in run.trajectory)


@pytest.mark.dist
@pytest.mark.slow
def test_c1_ulysses4_on_the_four_head_variant():
    """World size 4: every tiny wan variant but tiny-2.1-t2v-4h has 2 heads, which ulysses4 cannot split."""
    from parity.families.wan.c1 import run_c1

    report = run_c1(["tiny-2.1-t2v-4h"], None, "cpu", ["fp32"], 0, None, lambda msg: None, plan="ulysses4")
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    names = {c.name for c in report.checks}
    assert any("/rank3/" in n for n in names) and any("/sp_padded_4/" in n for n in names)


@pytest.mark.dist
@pytest.mark.slow
def test_heads_permuted_all_to_all_fails_naming_step_and_layer():
    report = c1("ulysses2", fault="ulysses-heads-permuted")
    bad = [c for c in report.checks if not c.passed]
    assert bad, "C1 passed with the Ulysses heads permuted"
    assert any("step 0, cond branch, layer blocks.0" in (c.divergence or "") for c in bad), \
        [(c.name, c.divergence) for c in bad][:6]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["ulysses2", "ring2", "cfgp2"])
def test_c1_other_plans_pass(plan):
    """The CLI's whole plan matrix (every ci rule draw, the plan's own cases)."""
    report = c1(plan)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    names = {c.name.split("/")[3] for c in report.checks}
    assert any(n.startswith("batch_position.") for n in names)
    assert any(n.startswith("cfgp_mixed_rows.") for n in names) == (plan == "cfgp2")
    assert any(n.startswith("heads4.") for n in names) == (plan == "ulysses2")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["ulysses2", "ring2"])
def test_sp_dit_with_padded_sequence(plan):
    """3 tokens over 2 ranks: padded to 4, the pad key masked, trimmed after the gather."""
    from optimized.parallel.launch import run_ranks

    cfg = load_model_variant(VARIANT)
    want = WanModelInstance.random(cfg, 0).dit.forward_batch(*dit_inputs(cfg, (2, 6), frames=1))
    for got in run_ranks(_sp_dit_worker, 2, (plan, 1, (2, 6)), timeout_s=240):
        assert float((got - want).norm() / want.norm()) < 1e-6


@pytest.mark.dist
@pytest.mark.slow
def test_cfg_branches_swapped_fails_at_step_0_after_the_dit():
    bad = [c for c in c1("cfgp2", fault="cfg-branches-swapped").checks if not c.passed]
    assert bad, "C1 passed with the CFG branches swapped across ranks"
    assert any("step 0, no layer (rank 0)" in (c.divergence or "") for c in bad), \
        [(c.name, c.divergence) for c in bad][:6]


def test_parallel_faults_are_declared_with_their_axis_and_refused_without_it():
    from parity.errors import SetupError
    from parity.families.wan import faults
    from parity.families.wan.parallel import parse_plan

    assert {f.name for f in faults.PARALLEL_FAULT_DECLS} == set(faults.PARALLEL_FAULTS)
    assert set(faults.PARALLEL_FAULTS) <= set(faults.C1_FAULTS)
    models = [SimpleNamespace(cfg=load_model_variant(VARIANT))]
    for fault, plan in (("ulysses-heads-permuted", "ring2"), ("tp-wrong-slice", "cfgp2"),
                        ("cfg-branches-swapped", "tp2"), ("ring-no-max-shift", "ulysses2")):
        with pytest.raises(SetupError, match=f"fault {fault} lives on the"):
            parse_plan(plan, models, "cpu", fault)
    for fault, plan in (("ulysses-heads-permuted", "ulysses2"), ("tp-wrong-slice", "tp2"),
                        ("cfg-branches-swapped", "cfgp2")):
        assert parse_plan(plan, models, "cpu", fault).world_size == 2
