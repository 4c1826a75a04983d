"""One definition of a sample's logprob over its stepped modalities (manifests.solvers.SAMPLE_LOGPROB_REDUCTION):
the joint Gaussian log-density of the step per element of the whole sample. Each side implements it on its own
(optimized.training.records.sample_logprob, reference.solvers.sde.sample_logprob); the record, both recomputes and
C2 use it. Before it, the record took the element-weighted mean and the engine's recompute the plain mean, so a
vision + sound rollout disagreed with its own recompute on clean code."""

import math

import pytest
import torch

import optimized
from manifests.solvers import SAMPLE_LOGPROB_REDUCTION
from optimized.solvers import sde as opt_sde
from optimized.training.records import BehaviorRecord, CaptureSpec, sample_logprob
from optimized.training.recompute import recompute_logprobs
from optimized.training.rollout import rollout
from parity.families.cosmos3.c2 import multi_modality_cases
from reference.solvers import sde as ref_sde

torch.set_num_threads(1)
BATCH_INVARIANT = CaptureSpec(latents=True, batch_invariant=True)


@pytest.fixture(scope="module")
def tiny():
    from parity.families.cosmos3.common import resolve_models
    (_, cfg, state), = resolve_models(["tiny"], None, 0)
    return cfg, optimized.Engine.from_state_dict(cfg, state, batching="greedy")


@pytest.fixture(scope="module")
def vision_sound(tiny):
    cfg, engine = tiny
    r = multi_modality_cases(cfg)["vision_sound"]
    s, = rollout(engine, [r], BATCH_INVARIANT)
    assert s.record.modalities == ["vision", "sound"]
    return s


def _transitions(shapes: dict[str, tuple[int, ...]]):
    """Per modality (x_next, mean, std) of one Gaussian step, seeded; stds differ so the modalities' values do."""
    g = torch.Generator().manual_seed(7)
    return {m: (torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.tensor(0.2 + 0.3 * k))
            for k, (m, shape) in enumerate(shapes.items())}


def test_the_rule_is_the_joint_density_per_element_on_both_sides():
    """Oracle: torch.distributions' log-density of every element of every modality, averaged over all of them."""
    steps = _transitions({"vision": (1, 4, 3, 4, 6), "sound": (8, 8), "action": (3, 6)})
    joint = torch.cat([torch.distributions.Normal(mean, std).log_prob(x).reshape(-1)
                       for x, mean, std in steps.values()]).double().mean()
    numel = {m: x.numel() for m, (x, _, _) in steps.items()}
    opt = opt_sde.logprob
    ours = sample_logprob({m: opt(*t)[None] for m, t in steps.items()}, numel)
    theirs = ref_sde.sample_logprob({m: ref_sde.gaussian_logprob(*t) for m, t in steps.items()}, numel)
    assert SAMPLE_LOGPROB_REDUCTION == "element_weighted_mean"
    assert abs(float(ours[0]) - float(joint)) < 1e-5 and abs(float(theirs) - float(joint)) < 1e-5
    plain = sum(float(opt(*t)) for t in steps.values()) / 3
    assert abs(plain - float(joint)) > 1e-2  # the modalities' values differ enough to tell the two apart


def test_one_modality_is_its_own_value_bitwise_and_ode_steps_stay_nan():
    lp = torch.tensor([float("nan"), -1.2345678, 0.3333333, float("nan")])
    same = sample_logprob({"vision": lp}, {"vision": 288})
    assert torch.equal(same[1:3], lp[1:3]) and math.isnan(same[0]) and math.isnan(same[3])
    ref = ref_sde.sample_logprobs({"vision": [None, lp[1], lp[2], None]}, {"vision": 288})
    assert ref[0] is None and ref[3] is None and float(ref[1]) == float(lp[1]) and float(ref[2]) == float(lp[2])


def test_missing_counts_and_ragged_steps_are_refused():
    with pytest.raises(ValueError, match="element count"):
        sample_logprob({"vision": torch.zeros(2), "sound": torch.zeros(2)}, {"vision": 4})
    with pytest.raises(ValueError, match="logprobs for"):
        ref_sde.sample_logprob({"vision": torch.tensor(-1.0), "sound": None}, {"vision": 4, "sound": 2})


def test_record_and_recompute_agree_on_a_two_modality_rollout(tiny, vision_sound):
    """Regression: the record (element-weighted) and the engine's recompute (plain mean) disagreed here by up to
    0.03 per step although every modality's logprob was identical."""
    _, engine = tiny
    rc = recompute_logprobs(engine, vision_sound.record, vision_sound.request)
    for m in ("vision", "sound"):
        assert torch.equal(rc.logprobs[m], vision_sound.record.logprobs[m]), m
    assert torch.equal(rc.logprob, vision_sound.record.logprob)
    assert not torch.allclose(vision_sound.record.logprobs["vision"], vision_sound.record.logprobs["sound"])


def test_a_saved_record_keeps_its_weights(vision_sound, tmp_path):
    back = BehaviorRecord.load(vision_sound.record.save(tmp_path / "rec"))
    assert back.extra["numel"] == {"vision": 288, "sound": 64}
    assert back.extra["logprob_reduction"] == SAMPLE_LOGPROB_REDUCTION
    assert torch.equal(back.logprob, vision_sound.record.logprob)


def test_the_planted_equal_weighting_breaks_the_multi_modality_identity_only(tiny):
    """The C2 negative control `record-modalities-weighed-equally`, on one rollout of each kind (the full C2 run
    with it planted is in the slow fault sweep)."""
    from parity.families.cosmos3.c2 import C2_FAULTS, request
    cfg, engine = tiny
    with C2_FAULTS["record-modalities-weighed-equally"]():
        multi, vision = rollout(engine, [multi_modality_cases(cfg)["vision_sound"], request(cfg, 1)],
                                BATCH_INVARIANT)
    rc = recompute_logprobs(engine, multi.record, multi.request)
    assert torch.equal(rc.logprobs["sound"], multi.record.logprobs["sound"])   # every modality still identical
    assert not torch.equal(rc.logprob, multi.record.logprob)                  # the sample's logprob is not
    rc = recompute_logprobs(engine, vision.record, vision.request)
    assert torch.equal(rc.logprob, vision.record.logprob)                     # a vision-only record is unchanged
