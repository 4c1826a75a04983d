"""cosmos3 cases by rule (parity/families/cosmos3/cases.py): the matrices cover every rule, are reproducible from
the seed, the faults planted on every side (reference, shared manifest, optimized) FAIL at their level, and
localisation replays the real batched call."""

from __future__ import annotations

import pytest
import torch

from manifests.cosmos3 import load_variant
from parity.families.cosmos3 import FAMILY
from parity.families.cosmos3 import cases as C
from parity.families.cosmos3.c0 import run_c0
from parity.families.cosmos3.c1 import run_c1

NEW_FAULTS = {  # fault -> (level, the cases that must catch it, dtypes)
    "ref-fps-one-row-action": ("C0", ("one_row_action",), ["fp32"]),
    "ref-time-embed-bf16": ("C0", ("t2v",), ["bf16"]),
    "ref-noise-order": ("C1", ("sound",), ["fp32"]),
    "manifest-uses-cfg-gt1": ("C1", ("gen_sound_seeded_g05", "guidance_lt1"), ["fp32"]),
    "batched-timestep-first": ("C1", ("concurrent3",), ["fp32"]),
}


@pytest.fixture(scope="module")
def tiny():
    return load_variant("tiny")


def _reqs(cases):
    return [r for c in cases for r in c.requests]


def test_c0_matrix_covers_each_rule(tiny):
    ci = C.c0_cases("ci")
    assert C.rules_covered(ci) == set(C.C0_RULES) - {"config_permutation", "prompt_edit"}
    assert any(c.vision[0] == 1 for c in ci if "image" in c.rules)
    assert any(c.action_rows == 1 and not c.action_cond for c in ci) and any(c.action_rows == 1 and c.action_cond
                                                                             for c in ci)
    assert any(c.cond_frames and len(c.cond_frames) < c.vision[0] for c in ci)
    assert any(len(c.cond_frames) == c.vision[0] for c in ci if "conditioned_frames" in c.rules)
    (name, perm), = C.config_permutations(tiny, "ci")
    assert perm.attention_bias and perm.qk_norm_for_text != tiny.qk_norm_for_text, name
    assert len(C.config_permutations(tiny, "full")) >= 3
    ids = torch.tensor([5, 9, 11, 3])
    edits = C.prompt_edits(ids, 128)
    assert torch.equal(edits["last_token_edit"][:-1], ids[:-1]) and edits["last_token_edit"][-1] != ids[-1]


def test_c1_matrix_covers_each_rule(tiny):
    ci, full = C.c1_cases(tiny, "ci"), C.c1_cases(tiny, "full")
    assert C.rules_covered(ci) == set(C.C1_RULES) - {"sampling"} == C.rules_covered(full)
    g = [r.guidance_scale for r in _reqs(ci)]
    assert 1.0 in g and any(0 < x < 1 for x in g) and any(x > 1 for x in g)
    # an unguided request among guided ones at every batch position (full), all submitted on the same tick
    positions = {[r.guidance_scale for r in c.requests].index(1.0) for c in full if "batch_position" in c.rules}
    assert positions == {0, 1, 2}
    assert all(c.start_ticks == (0, 0, 0) for c in full if "batch_position" in c.rules)
    acts = [r.action for r in _reqs(ci) if r.action is not None]
    assert any(a.mode == "forward_dynamics" and a.raw_actions.shape[0] == 1 for a in acts)
    assert any(a.chunk_size == 1 for a in acts)
    assert any(r.latent_frames == 1 and not r.vision_condition_frames for r in _reqs(ci))
    assert any(r.scheduler.use_native_flow_schedule for r in _reqs(ci))
    assert any(r.scheduler.use_karras_sigmas for r in _reqs(ci))
    edit = next(c for c in ci if "prompt_edit" in c.rules)
    a, b = (r.text_ids for r in edit.requests)
    assert a.shape == b.shape and torch.equal(a[:-1], b[:-1]) and a[-1] != b[-1]
    ar = C.ar_requests(tiny, "ci")
    long = [r for r in ar if r.max_new_tokens >= 16]
    assert any(r.top_p > 0.95 for r in long) and any(r.top_p < 0.2 and r.top_k > 1 for r in long)


def test_matrices_are_reproducible_from_the_seed(tiny):
    d = lambda seed: [C.describe(c) for c in C.c1_cases(tiny, "ci", seed)] + \
        [C.describe(c) for c in C.c0_cases("full", seed)] + [C.describe(r) for r in C.ar_requests(tiny, "ci", seed)]
    assert d(0) == d(0)
    assert d(0) != d(1)
    assert len(C.c0_cases("full")) > len(C.c0_cases("ci")) and len(C.c1_cases(tiny, "full")) > len(C.c1_cases(tiny))


def test_zero_by_construction_is_named(tiny):
    spec = next(c for c in C.c0_cases("ci") if c.name.endswith(".given"))
    assert set(C.zero_by_construction(C.make_inputs(tiny, spec, 0))) == {"action"}
    spec = next(c for c in C.c0_cases("ci") if c.name.endswith(".all"))
    assert set(C.zero_by_construction(C.make_inputs(tiny, spec, 0))) == {"vision"}
    assert C.zero_by_construction(C.make_inputs(tiny, C.C0_ANCHORS[0], 0)) == {}


def test_new_faults_are_declared_on_every_side():
    for name, (level, _, _) in NEW_FAULTS.items():
        f = FAMILY.fault(name)
        assert f is not None and f.level == level, name
    assert {n.split("-")[0] for n in NEW_FAULTS} >= {"ref", "manifest", "batched"}


def _run(level, fault, only, dtypes):
    if level == "C0":
        return run_c0(["tiny"], None, "cpu", dtypes, 0, fault, lambda m: None, only=only)
    return run_c1(["tiny"], None, "cpu", dtypes, 0, fault, lambda m: None, only=only)


@pytest.mark.parametrize("level", ["C0", "C1"])
def test_clean_subsets_pass(level):
    """The subsets the faults are run on pass without a fault (so each fault test below can fail)."""
    only = tuple(o for lv, os_, _ in NEW_FAULTS.values() if lv == level for o in os_)
    report = _run(level, None, only, ["fp32", "bf16"] if level == "C0" else ["fp32"])
    failed = [c.name for c in report.checks if not c.passed]
    assert report.checks and not failed, failed
    names = [c.name for c in report.checks]
    if level == "C0":
        assert any(n.endswith(":action(zero by construction)") for n in names)
        assert any(n.endswith("/time_embed") for n in names)
    else:
        assert any(n.endswith("/initial:sound") for n in names) and any(n.endswith("/timesteps") for n in names)
        assert any(n.startswith("upstream/gen_sound_seeded_g05/") for n in names)


@pytest.mark.parametrize("fault", list(NEW_FAULTS))
def test_new_fault_fails_at_its_level(fault):
    level, only, dtypes = NEW_FAULTS[fault]
    report = _run(level, fault, only, dtypes)
    failed = {c.name: c for c in report.checks if not c.passed}
    assert failed, f"{fault} planted, yet {level} passed"
    if fault == "ref-fps-one-row-action":
        assert "tiny/packing/one_row_action.0.noisy" in failed
    if fault == "ref-time-embed-bf16":
        assert set(failed) == {"tiny/bf16/time_embed"}  # the survivor: the forward stays inside bf16 tolerance
    if fault == "ref-noise-order":
        assert "tiny/fp32/sound/initial:vision" in failed and "tiny/fp32/sound/initial:sound" in failed
    if fault == "manifest-uses-cfg-gt1":  # both sides agree: only upstream tells
        assert all(n.startswith("upstream/") for n in failed)


def test_localisation_names_the_batched_call():
    """A bug only a batched forward shows (mates at other steps): the replay of the real batched call finds the
    layer; replaying the request alone would have blamed the solver."""
    report = run_c1(["tiny"], None, "cpu", ["fp32"], 0, "batched-timestep-first", lambda m: None,
                    only=("concurrent3",))
    div = {c.name: c.divergence for c in report.checks if not c.passed and c.divergence}
    where = div["tiny/fp32/concurrent3/req1/step0"]
    assert where.startswith("step 0, cond branch, layer embed (replayed batched call [mate 0@step1, this "
                            "request@step0]"), where
