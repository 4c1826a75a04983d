"""fvparity C2 (logprob identity) and C3 (rollout distributions): they pass on the tiny models and every planted
fault makes its level fail. The C3 runs (hundreds of rollouts) are marked slow."""

import numpy as np
import pytest
import torch

from parity.errors import SetupError
from parity.families.cosmos3 import c2 as cosmos3_c2
from parity.families.cosmos3 import c3 as cosmos3_c3
from parity.families.wan import c2 as wan_c2
from parity.families.wan import c3 as wan_c3
from parity.rollout_checks import energy_test, logprob_check

torch.set_num_threads(1)
quiet = lambda msg: None  # noqa: E731


def failed(report):
    return [c.name for c in report.checks if not c.passed]


def test_logprob_check_is_exact_at_zero_tolerance():
    a = torch.tensor([-1.0, -2.0, float("nan")])
    assert logprob_check("x", a, a.clone(), 0.0).passed
    b = a.clone()
    b[1] += 1e-6
    r = logprob_check("x", a, b, 0.0)
    assert not r.passed and "first divergent step 1" in r.detail
    assert not logprob_check("x", a, torch.tensor([-1.0, float("nan"), -3.0]), 1.0).passed  # other SDE steps


def test_energy_test_separates_shifted_samples_only():
    g = np.random.default_rng(0)
    x, y = g.normal(size=(40, 8)), g.normal(size=(40, 8))
    assert energy_test(x, y, 500)[1] > 0.05
    assert energy_test(x, y + 1.0, 500)[1] < 0.01


def test_cosmos3_c2_passes_identically():
    report = cosmos3_c2.run_c2(["tiny"], None, "cpu", ["fp32"], 0, None, quiet)
    assert report.passed, failed(report)
    names = {c.name for c in report.checks}
    for case in ("flow_grpo_cfg", "flow_grpo_no_cfg", "dance_grpo_cfg", "sde_window", "batch8/sample7",
                 "flow_grpo_cfg/recompute_without_und_cache", "weight_update/recompute_without_und_cache"):
        assert f"tiny/fp32/{case}" in names, case
    # two and three stepped modalities: identical to the engine's recompute, and against the reference's recompute
    # and rollout, per modality and as a whole
    for case, modalities in (("vision_sound", ("vision", "sound")),
                             ("vision_sound_action", ("vision", "sound", "action"))):
        for kind in ("", "/reference_recompute", "/reference_rollout"):
            assert f"tiny/fp32/{case}{kind}" in names, (case, kind)
            assert all(f"tiny/fp32/{case}{kind}:{m}" in names for m in modalities), (case, kind)
    step0 = next(c for c in report.checks if c.name == "tiny/fp32/flow_grpo_cfg").extra
    assert step0["steps"][0] == 0 and step0["abs_delta"][0] == 0.0 and step0["ratio"][0] == 1.0


@pytest.mark.parametrize("fault, must_fail", [
    ("sde-sigma-off-by-one", "tiny/fp32/flow_grpo_cfg"),
    ("sde-noise-level-mismatch", "tiny/fp32/dance_grpo_cfg"),
    ("stale-und-cache-after-update", "tiny/fp32/weight_update/recompute_without_und_cache"),
    pytest.param("record-modalities-weighed-equally", "tiny/fp32/vision_sound_action/reference_recompute",
                 marks=pytest.mark.slow),   # one rollout of it runs fast in tests/test_logprob_modalities.py
])
def test_cosmos3_c2_faults_fail(fault, must_fail):
    report = cosmos3_c2.run_c2(["tiny"], None, "cpu", ["fp32"], 0, fault, quiet)
    assert must_fail in failed(report)
    if fault == "stale-und-cache-after-update":  # the rollouts before the update are untouched
        assert "tiny/fp32/flow_grpo_cfg" not in failed(report)
    if fault == "record-modalities-weighed-equally":  # only multi-modality samples, and only as a whole
        assert all(n.startswith(("tiny/fp32/vision_sound", "tiny/fp32/vision_sound_action")) and ":" not in n
                   for n in failed(report)), failed(report)


def test_wan_c2_passes_and_its_stale_cache_fault_fails():
    report = wan_c2.run_c2(["tiny-2.1-t2v"], None, "cpu", ["fp32"], 0, None, quiet)
    assert report.passed, failed(report)
    bad = wan_c2.run_c2(["tiny-2.1-t2v"], None, "cpu", ["fp32"], 0, "stale-text-cache-after-update", quiet)
    assert failed(bad) and "tiny-2.1-t2v/fp32/weight_update/recompute_without_text_cache" in failed(bad)


@pytest.mark.parametrize("runner", [cosmos3_c2.run_c2, cosmos3_c3.run_c3, wan_c2.run_c2, wan_c3.run_c3])
def test_unknown_faults_are_refused(runner):
    with pytest.raises(SetupError, match="no-such-fault"):
        runner([], None, "cpu", ["fp32"], 0, "no-such-fault", quiet)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sde-sigma-off-by-one", "sde-noise-level-mismatch"])
def test_wan_c2_sde_faults_fail(fault):
    report = wan_c2.run_c2([], None, "cpu", ["fp32"], 0, fault, quiet)
    assert "tiny-2.1-t2v/fp32/flow_grpo_euler_cfg" in failed(report)


@pytest.mark.slow
@pytest.mark.parametrize("module", [cosmos3_c3, wan_c3])
def test_c3_passes_and_detects_its_controls(module):
    report = module.run_c3([], None, "cpu", ["fp32"], 0, None, quiet)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    controls = [c for c in report.checks if "/control/" in c.name]
    assert len(controls) == 2 and all(c.passed for c in controls)


@pytest.mark.slow
@pytest.mark.parametrize("module", [cosmos3_c3, wan_c3])
def test_c3_guidance_drift_fails(module):
    report = module.run_c3([], None, "cpu", ["fp32"], 0, "guidance-drift", quiet)
    assert any(n.endswith("/reference_vs_engine") for n in failed(report))
