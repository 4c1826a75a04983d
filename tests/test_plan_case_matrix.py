"""What a wan plan run (`fvparity run wan --level C1 --plan P`) runs: the rule-generated case matrix, not only the
anchor loops. Under cfgp a batch mixing guided and unguided rows that the rank split cuts inside a branch; under
Ulysses a model with 2 heads on every rank (the 2-head tiny variants hold one head per rank at ulysses2, where head
order cannot be wrong); under SP the padded loop. The planted faults `cfg-rows-halved` (the gathered predictions cut
in half, not by branch) and `ulysses-heads-interleaved` (the inverse all-to-all interleaves heads) must each fail
more than one check. Default suite: the matrices themselves (no ranks); the plan runs are slow (the default suite's
plan runs: tests/test_wan_sp.py ulysses2 on a representative subset, tests/test_cfg_parallel.py the policy on
every mix of guided and unguided rows)."""

from __future__ import annotations

import pytest

from manifests.wan import load_model_variant
from optimized.parallel.plan import ParallelPlan
from parity.families.wan.common import resolve_models
from parity.families.wan.parallel import plan_cases, plan_runs
from tests.test_wan_sp import VARIANT, c1


def _names(cases) -> list[str]:
    return [c.name for c in cases]


@pytest.mark.parametrize("matrix", ["ci", "full"])
def test_cfgp_plan_runs_rule_draws_and_a_batch_split_inside_a_branch(matrix):
    cfg = load_model_variant(VARIANT)
    cases = plan_cases(cfg, ParallelPlan.parse("cfgp2"), matrix)
    names = _names(cases)
    assert any(n.startswith("batch_position.") for n in names) and any(n.startswith("guidance_lt1.") for n in names)
    mixed = [c for c in cases if "cfgp_mixed_rows" in c.rules]
    assert len(mixed) == (1 if matrix == "ci" else 3)
    for case in mixed:
        guided = sum(r.uses_cfg for r in case.requests)
        cond_rows = len(case.requests)                    # one cond row per request, then one uncond per guided
        assert 0 < guided < cond_rows and set(case.start_ticks) == {0}
        rank0_rows = -(-(cond_rows + guided) // 2)      # 2 ranks: rank 0 takes the first ceil(rows / 2)
        assert rank0_rows != cond_rows, case.name       # so one rank runs rows of both branches
    assert not any("cfgp_mixed_rows" in c.rules for c in plan_cases(cfg, ParallelPlan.parse("ulysses2")))


def test_ulysses_plan_runs_a_model_with_two_heads_per_rank():
    m = resolve_models([VARIANT], None, 0, kinds=("model",))[0]
    assert m.cfg.dit.num_heads == 2                     # one head per rank at ulysses2: order cannot be wrong
    runs = plan_runs(m, ParallelPlan.parse("ulysses2"))
    more = [(c, cm) for c, cm in runs if cm is not m]
    assert [c.name for c, _ in more] == ["heads4.t2v_unipc_cfg", "heads4.sp_padded_2"]
    model = more[0][1]
    assert model.cfg.dit.num_heads == 4 and model.cfg.dit.hidden_size == m.cfg.dit.hidden_size
    assert model.weights is m.weights                   # the same weights, grouped into more, narrower heads
    assert "sp_padded_2" in [c.name for c, _ in runs]
    assert all(cm is m for _, cm in plan_runs(m, ParallelPlan.parse("cfgp2")))   # no head split, no extra model
    four = resolve_models(["tiny-2.1-t2v-4h"], None, 0, kinds=("model",))[0]
    assert all(cm is four for _, cm in plan_runs(four, ParallelPlan.parse("ulysses2")))   # 2 per rank already
    assert {cm.cfg.dit.num_heads for _, cm in plan_runs(four, ParallelPlan.parse("ulysses4"))} == {4, 8}


@pytest.mark.dist
@pytest.mark.slow
def test_cfg_rows_halved_fails_in_the_mixed_rows_batch():
    """The mixed-rows case alone, clean then with the fault (the policy itself: tests/test_cfg_parallel.py, default
    suite). The batch step fails under the fault (too few predictions) and the scheduler reruns its requests one by
    one, so the latents stay right: the batch that never formed is what must fail, on every rank and request."""
    only = ("cfgp_mixed_rows.",)
    clean = c1("cfgp2", only=only)
    assert clean.passed, [(c.name, c.detail) for c in clean.checks if not c.passed][:5]
    assert any(c.name.endswith("/batched_with_others") for c in clean.checks)
    bad = [c for c in c1("cfgp2", fault="cfg-rows-halved", only=only).checks if not c.passed]
    assert len(bad) > 1 and all("/cfgp_mixed_rows." in c.name for c in bad), [c.name for c in bad]
    assert {c.name.split("/")[4] for c in bad} == {"rank0", "rank1"}


@pytest.mark.dist
@pytest.mark.slow
def test_cfg_rows_halved_fails_every_mixed_batch_of_the_cfgp2_matrix():
    bad = [c for c in c1("cfgp2", fault="cfg-rows-halved").checks if not c.passed]
    cases = {c.name.split("/")[3] for c in bad}
    assert any(n.startswith("cfgp_mixed_rows.") for n in cases) and any(n.startswith("batch_position.")
                                                                        for n in cases), sorted(cases)
    assert all(c.name.endswith(("/batched_with_others", "/no_batch_failed")) for c in bad), [c.name for c in bad][:6]


@pytest.mark.dist
@pytest.mark.slow
def test_ulysses_heads_interleaved_fails_only_where_a_rank_holds_two_heads():
    report = c1("ulysses2", fault="ulysses-heads-interleaved", only=("t2v_unipc_cfg", "heads4."))
    bad = [c for c in report.checks if not c.passed]
    assert len(bad) > 1 and all("/heads4." in c.name for c in bad), [c.name for c in bad][:6]
    assert any(c.name.endswith("/dit_step0") for c in bad)          # C0 under the plan, on the reference's input
    assert any(c.name.endswith("/step0") for c in bad)              # and the loop
    assert any("step 0, cond branch, layer blocks.0" in (c.divergence or "") for c in bad), \
        [(c.name, c.divergence) for c in bad][:6]
    assert any(c.passed and "/t2v_unipc_cfg/rank1/" in c.name for c in report.checks)   # 1 head per rank: blind
