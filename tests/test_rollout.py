"""The training plane: SDE steps (reference vs optimized), BehaviorRecords (capture, round trip, tracing a sample),
weight updates (in-flight policies, no stale cache, the planted fault), group rollouts (one text encode)."""

import math
import os

import pytest
import torch

import optimized
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, SDEConfig, UniPCConfig
from manifests.errors import ManifestError
from optimized.solvers import sde as opt_sde
from optimized.training.records import BehaviorRecord, CaptureSpec, RolloutStep, tensor_hash
from optimized.training.recompute import recompute_logprobs
from optimized.training.rollout import rollout, rollout_group, submit_rollout
from reference.solvers.sde import FlowSDE, gaussian_logprob
from reference.solvers.unipc import flow_schedule

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    from parity.families.cosmos3.common import resolve_models
    (_, cfg, state), = resolve_models(["tiny"], None, 0)
    return cfg, state


def req(cfg, seed=3, guidance=5.0, sde=SDEConfig(0.7), prompt=5, **kw):
    g = torch.Generator().manual_seed(prompt)
    return Cosmos3GenerateRequest(text_ids=torch.randint(0, cfg.vocab_size, (7,), generator=g),
                                  negative_text_ids=torch.randint(0, cfg.vocab_size, (3,), generator=g),
                                  latent_frames=3, latent_height=4, latent_width=6, num_steps=4,
                                  guidance_scale=guidance, seed=seed, scheduler=UniPCConfig(flow_shift=3.0), sde=sde,
                                  **kw)


# ------------------------------------------------------------------------------------------------ SDE steps

@pytest.mark.parametrize("sde_type", ["flow_grpo", "dance_grpo"])
def test_reference_and_optimized_sde_steps_agree(sde_type):
    sigmas, _ = flow_schedule(UniPCConfig(flow_shift=3.0), 6)
    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(1, 4, 2, 3, 3, generator=g) for _ in range(3))
    ref = FlowSDE(SDEConfig(0.7, sde_type), sigmas)
    state = opt_sde.new_sde_state(SDEConfig(0.7, sde_type), sigmas)
    for i in range(6):
        want, want_lp = ref.step(v, x, i, noise)
        state, got = opt_sde.sde_step(state, v, x, noise)
        assert torch.allclose(got.x_next, want, rtol=1e-5, atol=1e-5), i
        assert abs(float(got.logprob) - float(want_lp)) < 1e-5, i
        assert torch.isfinite(got.x_next).all()  # the sigma = 1 guard keeps step 0 finite


def test_logprob_is_the_gaussian_density_averaged_over_elements():
    g = torch.Generator().manual_seed(1)
    x, mean = torch.randn(1, 50, generator=g), torch.randn(1, 50, generator=g)
    std = torch.tensor(0.3)
    want = torch.distributions.Normal(mean, std).log_prob(x).mean()
    assert abs(float(opt_sde.logprob(x, mean, std)) - float(want)) < 1e-5
    assert abs(float(gaussian_logprob(x, mean, std)) - float(want)) < 1e-5
    # at the mean the density is its peak: -log(std) - log(sqrt(2 pi))
    assert abs(float(opt_sde.logprob(mean, mean, std)) - (-math.log(0.3) - 0.5 * math.log(2 * math.pi))) < 1e-6


def test_flow_grpo_guard_at_sigma_one_uses_the_next_sigma():
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.0])
    s = opt_sde.new_sde_state(SDEConfig(0.7), sigmas)
    x, v = torch.zeros(1, 4), torch.zeros(1, 4)
    _, std = opt_sde.transition(s, v, x)
    want = 0.7 * math.sqrt(1.0 / (1 - 0.8)) * math.sqrt(0.2)
    assert abs(float(std) - want) < 1e-6


def test_sde_window_steps_outside_are_ode_and_draw_nothing(tiny):
    cfg, state = tiny
    engine = optimized.Engine.from_state_dict(cfg, state)
    s, = rollout(engine, [req(cfg, sde=SDEConfig(0.7, sde_window=(1, 3)))])
    lp = s.record.logprob
    assert math.isnan(lp[0]) and math.isnan(lp[3]) and not math.isnan(lp[1]) and not math.isnan(lp[2])
    assert sorted(s.record.noise["vision"]) == [1, 2] and s.record.sde_steps == [1, 2]


def test_sde_settings_are_validated(tiny):
    cfg, _ = tiny
    with pytest.raises(ManifestError, match="sde_window"):
        req(cfg, sde=SDEConfig(0.7, sde_window=(2, 9))).validate(cfg)
    with pytest.raises(ManifestError, match="sde_type"):
        req(cfg, sde=SDEConfig(0.7, "ddim")).validate(cfg)
    with pytest.raises(ManifestError, match="seed"):
        req(cfg, seed=None, noise_vision=torch.zeros(1, cfg.latent_channels, 3, 4, 6)).validate(cfg)


# ------------------------------------------------------------------------------------------------ records

def test_record_round_trip_and_atomic_replace(tiny, tmp_path):
    cfg, state = tiny
    engine = optimized.Engine.from_state_dict(cfg, state, weights_version="v1")
    s, = rollout(engine, [req(cfg)], CaptureSpec(latents=True))
    path = s.record.save(tmp_path / "rec")
    back = BehaviorRecord.load(path)
    assert back.meta() == s.record.meta()
    for name, t in s.record.tensors().items():
        assert torch.equal(back.tensors()[name], t), name
    s.record.save(tmp_path / "rec")  # replacing an existing record leaves no temporary directory behind
    assert sorted(os.listdir(tmp_path)) == ["rec"]
    (path / "record.json").write_text((path / "record.json").read_text().replace('"format_version": 1',
                                                                                  '"format_version": 9'))
    with pytest.raises(ValueError, match="format version"):
        BehaviorRecord.load(path)


def test_a_sample_traces_to_version_trajectory_seeds_and_artifact(tiny):
    cfg, state = tiny
    engine = optimized.Engine.from_state_dict(cfg, state, weights_version="policy-7")
    r = req(cfg, seed=11)
    h = submit_rollout(engine, r, CaptureSpec())
    engine.run_until_idle()
    result = h.result()
    rec = result["behavior"]
    assert rec.weights_version == "policy-7" and rec.seed == 11 and rec.graph_mode == "eager"
    assert rec.parallel_plan is None and rec.dtype == "float32" and rec.latents == {}  # small by default
    sigmas, timesteps = flow_schedule(r.scheduler, r.num_steps)
    assert torch.equal(rec.sigmas, sigmas) and rec.timesteps.tolist() == timesteps.tolist()
    assert rec.final_hashes["vision"] == tensor_hash(result["latents"]["vision"])  # the artifact
    assert sorted(rec.noise["vision"]) == [0, 1, 2, 3]
    streamed = [e.data["output"] for e in h.events if e.kind == "request.output"]
    assert [x.step for x in streamed] == [0, 1, 2, 3] and all(isinstance(x, RolloutStep) for x in streamed)
    assert streamed[0].kind == "rollout.step" and streamed[0].weights_version == "policy-7"
    # the same seed, weights and request reproduce the same artifact; another seed does not
    again, other = rollout(engine, [r, req(cfg, seed=12)])
    assert again.record.final_hashes == rec.final_hashes and other.record.final_hashes != rec.final_hashes
    assert again.record.request_hash == rec.request_hash != other.record.request_hash


def test_recompute_refuses_a_foreign_request_and_a_record_without_latents(tiny):
    cfg, state = tiny
    engine = optimized.Engine.from_state_dict(cfg, state)
    s, = rollout(engine, [req(cfg)], CaptureSpec(latents=False))
    with pytest.raises(ValueError, match="latents"):
        recompute_logprobs(engine, s.record, s.request)
    with pytest.raises(ValueError, match="request hash"):
        recompute_logprobs(engine, s.record, req(cfg, seed=99))


# ------------------------------------------------------------------------------------------------ weight updates

def perturbed(state, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in sorted(state.items())}


@pytest.mark.parametrize("policy", ["finish", "drain"])
def test_in_flight_requests_finish_on_their_version(tiny, policy):
    cfg, state = tiny
    engine = optimized.Engine.from_state_dict(cfg, state, weights_version="v1")
    first = submit_rollout(engine, req(cfg, seed=1))
    engine.step()  # one step taken on v1
    update = engine.update_weights({"transformer": perturbed(state)}, "v2", policy=policy)
    assert update.in_flight == (first.request_id,)
    if policy == "drain":
        assert first.status == "completed"  # drained before the swap
    second = submit_rollout(engine, req(cfg, seed=1))
    engine.run_until_idle()
    a, b = first.result()["behavior"], second.result()["behavior"]
    assert a.weights_version == "v1" and b.weights_version == "v2"
    assert a.final_hashes != b.final_hashes  # same request, new weights: a new sample


def test_update_refuses_a_version_that_is_not_bumped_and_unknown_policies(tiny):
    cfg, state = tiny
    engine = optimized.Engine.from_state_dict(cfg, state, weights_version="v1")
    with pytest.raises(ValueError, match="new version"):
        engine.update_weights({"transformer": perturbed(state)}, "v1")
    with pytest.raises(ValueError, match="policy"):
        engine.update_weights({"transformer": perturbed(state)}, "v2", policy="later")


def _cache_ops(engine):
    ops = []
    engine.subscribe(lambda e: ops.append(e.data["op"]), "trace.cache")
    return ops


def test_no_stale_cache_after_an_update_and_the_planted_fault_is_caught(tiny):
    from parity.rollout_checks import stale_cache_after_update
    cfg, state = tiny
    for planted in (False, True):
        engine = optimized.Engine.from_state_dict(cfg, state, weights_version="v1")
        rollout(engine, [req(cfg, guidance=1.0)])  # the prompt's und K/V cached under v1
        if planted:
            with stale_cache_after_update():
                engine.update_weights({"transformer": perturbed(state)}, "v2")
        else:
            update = engine.update_weights({"transformer": perturbed(state)}, "v2")
            assert update.evicted >= 1 and update.carried == 0
        ops = _cache_ops(engine)
        engine.model.stats.reset()
        s, = rollout(engine, [req(cfg, guidance=1.0)], CaptureSpec(latents=True))
        versions = {k.weights_version for k in engine.model.und_cache.keys()}
        rc = recompute_logprobs(engine, s.record, s.request, use_cache=False)
        identical = torch.equal(rc.logprob, s.record.logprob)
        if not planted:  # the first forward after the update recomputes the prompt under v2
            assert ops[0] == "miss" and versions == {"v2"} and identical
        else:  # the fault serves v1's K/V to v2's weights; the recompute (no cache) sees the difference
            assert ops[0] == "hit" and not identical


# ------------------------------------------------------------------------------------------------ group rollouts

def test_group_rollout_runs_as_one_batch_and_computes_the_prompt_once(tiny):
    cfg, state = tiny
    engine = optimized.Engine.from_state_dict(cfg, state, batching="greedy")  # batch sizes asserted: not on the clock
    engine.model.stats.reset()
    samples = rollout_group(engine, req(cfg, guidance=1.0), k=6)
    assert [s.record.seed for s in samples] == [3, 4, 5, 6, 7, 8]
    assert all(s.record.batch_sizes == [6] * 4 for s in samples)
    assert engine.model.stats.und_prompts_computed == 1  # one prompt, computed once for the whole group
    assert len({s.record.final_hashes["vision"] for s in samples}) == 6


def test_wan_group_rollout_encodes_the_text_once():
    from manifests.solvers import SDEConfig as SDE
    from parity.families.wan.c2 import sde_request
    from parity.families.wan.common import resolve_models
    m, = resolve_models(["tiny-2.1-t2v"], None, 0, kinds=("model",))
    engine = optimized.Engine.from_weights(m.cfg, m.weights, batching="greedy")  # batch sizes asserted
    ops = _cache_ops(engine)
    k = 5
    samples = rollout_group(engine, sde_request(m.cfg, 0, guidance=1.0, sde=SDE(0.7)), k=k)
    assert ops.count("miss") == 1 and ops.count("hit") == k - 1  # encoded once, served K - 1 times
    assert all(s.record.batch_sizes == [k] * 4 for s in samples)
    assert all(s.record.family == "wan" and s.record.experts == [1] * 4 for s in samples)
