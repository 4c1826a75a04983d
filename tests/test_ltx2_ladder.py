"""ltx2's C2 / C3 / C4 (parity/families/ltx2/{rollout,c2,c3,c4}.py): the levels pass on the tiny variants, and every
planted fault fails and is localised (step / modality / stage). The default suite runs one clean C2, one C2 fault,
one C4 case and the C3 plumbing; the whole levels, every fault and the CLI are `slow`."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from parity.families import families
from parity.families.ltx2 import c2, c3, c4
from parity.families.ltx2.rollout import MODALITIES, recompute, rollouts


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return c2.setup("tiny", "tiny", 0)


def _failed(report):
    return [c for c in report.checks if not c.passed]


# ------------------------------------------------------------------------------------------------ the driver

def test_rollout_is_stochastic_and_recomputes_identically(tiny):
    """An SDE rollout draws noise (two seeds differ, the final latents leave the ODE path), its recompute is
    identical per modality, and an ODE step (outside the SDE window) has no logprob."""
    args = (tiny.stats, tiny.media, tiny.sched)
    with torch.no_grad():
        window = c2.case(tiny, 4, sde=c2.SDEConfig(0.7, sde_window=(1, 3)))
        a, = rollouts(tiny.optimized, [window], *args)
        again, = recompute(tiny.optimized, [window], [a], *args)
        ode = dataclasses.replace(window, sde=c2.SDEConfig(0.7, sde_window=(3, 4)))
        b, = rollouts(tiny.optimized, [ode], *args)
    for m in MODALITIES:
        assert torch.equal(a.logprobs[m].nan_to_num(7.0), again.logprobs[m].nan_to_num(7.0))
        assert [math.isnan(float(x)) for x in a.logprobs[m]] == [True, False, False, True]
        assert len(a.latents[m]) == c2.STEPS + 1
        assert torch.equal(a.latents[m][0], b.latents[m][0])            # the same initial noise (same seed)
        assert not torch.equal(a.latents[m][2], b.latents[m][2])        # step 1 is SDE in one, ODE in the other
    assert a.rows == [2] * c2.STEPS                                      # [uncond | cond]


def test_recompute_refuses_a_record_of_another_seed(tiny):
    args = (tiny.stats, tiny.media, tiny.sched)
    with torch.no_grad():
        a, = rollouts(tiny.optimized, [c2.case(tiny, 1)], *args)
        with pytest.raises(ValueError, match="initial video latents differ"):
            recompute(tiny.optimized, [c2.case(tiny, 2)], [a], *args)


# ------------------------------------------------------------------------------------------------ C2

def test_c2_passes_on_tiny():
    report = c2.run_c2(["tiny"])
    assert report.passed, [(c.name, c.detail) for c in _failed(report)][:5]
    rows = {c.name: c for c in report.checks}
    for name in ("flow_grpo_cfg", "flow_grpo_no_cfg", "dance_grpo_cfg", "sde_window"):
        for suffix in ("", ":video", ":audio"):
            assert rows[f"tiny/float32/{name}{suffix}"].extra["abs_delta"] and \
                max(rows[f"tiny/float32/{name}{suffix}"].extra["abs_delta"]) == 0.0       # identical
        assert f"tiny/float32/{name}/reference_rollout:audio" in rows
    assert rows["tiny/float32/sde_window"].extra["steps"] == [1, 2]
    assert rows["tiny/float32/batch8/ran_as_one_batch"].passed


def test_c2_audio_guidance_fault_names_audio_and_step_0():
    report = c2.run_c2(["tiny"], fault="c2-audio-uses-video-guidance")
    failed = {c.name: c for c in _failed(report)}
    assert failed["tiny/float32/flow_grpo_cfg:audio"].divergence == "step 0 audio"
    assert "tiny/float32/flow_grpo_cfg:video" not in failed       # the recompute is teacher-forced: video identical
    assert failed["tiny/float32/flow_grpo_cfg"].divergence == "step 0 sample"


@pytest.mark.slow
@pytest.mark.parametrize("fault", [f.name for f in c2.FAULTS])
def test_every_c2_fault_fails_and_is_localised(fault):
    report = c2.run_c2(["tiny"], fault=fault)
    failed = _failed(report)
    want = next(f.divergence for f in c2.FAULTS if f.name == fault)
    assert failed and any(want in (c.divergence or "") for c in failed), [(c.name, c.divergence) for c in failed]
    # the reference's own identity never involves the optimized rollout: it stays clean
    assert all(c.passed for c in report.checks if c.name.endswith("/reference_identity"))


@pytest.mark.slow
def test_c2_passes_on_tiny_2_3():
    report = c2.run_c2(["tiny-2.3"])
    assert report.passed, [(c.name, c.detail) for c in _failed(report)][:5]


# ------------------------------------------------------------------------------------------------ C3

def test_c3_sides_share_rollouts_per_modality(tiny):
    """The video and audio rows read one set of rollouts (the cache), each projected on its modality, with a logprob
    statistic per SDE step; the mixed side returns the requests' own rollouts (not the background's)."""
    cached = c3.CachedSides(tiny, None)
    with torch.no_grad():
        video = cached.sides("video").engine(range(4))
        audio = cached.sides("audio").engine(range(4))
        mixed = cached.sides("video").mixed(range(4))
        alone = cached.sides("video").reference(range(4))
    assert len(cached.cache) == 3
    assert video.finals.shape[0] == audio.finals.shape[0] == mixed.finals.shape[0] == 4
    assert video.finals.shape[1] != audio.finals.shape[1]
    assert {f"logprob_step{i}" for i in range(c2.STEPS)} <= set(video.scalars)
    # batch composition changes nothing on CPU: the mixed batches and the reference reproduce the one batch
    assert abs(mixed.finals - video.finals).max() < 1e-5 and abs(alone.finals - video.finals).max() < 1e-4


@pytest.mark.slow
def test_c3_passes_on_tiny():
    report = c3.run_c3(["tiny"])
    assert report.passed, [(c.name, c.detail) for c in _failed(report)]
    names = {c.name for c in report.checks}
    assert {"tiny/float32/video/control/guidance", "tiny/float32/audio/control/noise_level"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("fault, modality", [("guidance-drift", "video"), ("c3-audio-std-inverted", "audio")])
def test_c3_fault_fails_on_its_modality(fault, modality):
    report = c3.run_c3(["tiny"], fault=fault)
    failed = {c.name: c for c in _failed(report)}
    row = f"tiny/float32/{modality}/reference_vs_engine"
    assert row in failed and failed[row].divergence.startswith(modality), list(failed)
    assert "tiny/float32/video/batch_composition" not in failed   # both sides of that row carry the fault


# ------------------------------------------------------------------------------------------------ C4

def test_c4_one_case_end_to_end(tmp_path):
    case = c4.CASES[0]
    comp = c4.components(case, 0)
    texts = c4.c1.prompts(comp.ccfg.caption_channels * c4.c1.TEXT_LAYERS, 3)
    reqs = c4.requests()
    with torch.no_grad():
        want = c4.reference_chain(comp, case, reqs, texts)
        got = c4.optimized_chain(comp, case, reqs, texts)
        with c4.planted("c4-swapped-stereo"):
            swapped = c4.optimized_chain(comp, case, reqs[:1], texts[:1])
    bounds = dict(c4.DEFAULT_BOUNDS)
    from manifests.parity import Tolerance
    tol = Tolerance(rel_l2=1e-4)
    rows = c4.artifact_checks("r0", want[0], got[0], bounds, tol, comp.ocfg.output_sampling_rate, tmp_path, print)
    assert all(c.passed for c in rows), [(c.name, c.detail) for c in rows if not c.passed]
    assert {c.name for c in rows} >= {"r0/frames", "r0/audio", "r0/wav", "r0/png_frames", "r0/artifacts_roundtrip"}
    assert want[0].video.shape[2] == 9 and want[0].audio.shape[0] == 2            # frames, stereo
    bad = {c.name: c for c in c4.artifact_checks("s0", want[0], swapped[0], bounds, tol,
                                                  comp.ocfg.output_sampling_rate, tmp_path, print)}
    assert not bad["s0/audio"].passed and bad["s0/audio"].divergence.startswith("vocoder")
    assert bad["s0/frames"].passed and bad["s0/mel"].passed


@pytest.mark.slow
def test_c4_passes():
    report = c4.run_c4()
    assert report.passed, [(c.name, c.detail) for c in _failed(report)]
    assert report.settings["thresholds"]["min_snr_db"]["source"] == "contract"


@pytest.mark.slow
@pytest.mark.parametrize("fault, stage, row", [("c4-rgb-as-bgr", "video vae decode", "frames"),
                                              ("c4-swapped-stereo", "vocoder", "audio")])
def test_c4_fault_names_its_stage(fault, stage, row):
    report = c4.run_c4(fault=fault)
    failed = _failed(report)
    assert failed and all(c.name.endswith((f"/{row}", "/png_frames", "/wav")) for c in failed), \
        [c.name for c in failed]
    assert all(stage in c.divergence for c in failed if c.name.endswith(f"/{row}"))


# ------------------------------------------------------------------------------------------------ registry, CLI

def test_ltx2_registers_every_level_with_its_faults():
    fam = families()["ltx2"]
    assert set(fam.levels) == {"C0", "C1", "C2", "C3", "C4"}
    for level in ("C2", "C3", "C4"):
        assert any(f.level == level for f in fam.faults), level


@pytest.mark.slow
@pytest.mark.parametrize("level", ["C2", "C4"])
def test_cli_runs_the_level(level, tmp_path, fvparity):
    import json
    out = tmp_path / "r.json"
    proc = fvparity("run", "ltx2", "--level", level, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(out.read_text())["passed"]


def test_levels_refuse_what_they_do_not_run():
    from parity.errors import SetupError
    for run in (c2.run_c2, c3.run_c3, c4.run_c4):
        with pytest.raises(SetupError, match="no-such-fault"):
            run(["tiny"], fault="no-such-fault")
        with pytest.raises(SetupError, match="fp32 only"):
            run(["tiny"], dtypes=["bf16"])
        with pytest.raises(SetupError, match="CPU"):
            run(["tiny"], checkpoint="/nowhere")
    with pytest.raises(SetupError, match="variants"):
        c2.run_c2(["tiny-split"])


def test_driver_refuses_a_loop_that_does_not_carry_on_from_the_injected_state(tiny, monkeypatch):
    """Negative control for the driver itself: a loop whose trace hands over a copy (so the SDE sample would be
    dropped and the loop stay on its ODE path) is an error, not a silently deterministic "rollout"."""
    from parity.families.ltx2.rollout import OptimizedSide
    original = OptimizedSide.generate

    def copying(self, cases, stats, media, sched, trace, watch):
        return original(self, cases, stats, media, sched, lambda n, x: trace(n, x.clone()), watch)
    monkeypatch.setattr(OptimizedSide, "generate", copying)
    with torch.no_grad(), pytest.raises(ValueError, match="did not start from the state"):
        rollouts(tiny.optimized, [c2.case(tiny, 1)], tiny.stats, tiny.media, tiny.sched)
