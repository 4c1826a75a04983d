"""The memory plane (optimized/runtime/memory.py): offload on / off bitwise equal (wan t2v, cosmos3), blockwise
offload under a budget smaller than the DiT, sleep / wake by tag, unload / reload, admission counting slept weights,
and negative controls (a block that was never prefetched is caught and named; weights asleep are refused)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from manifests.cosmos3.reasoning import ReasonRequest
from manifests.wan.model import load_model_variant
from manifests.wan.sampling import WanGenerateRequest
from optimized import Engine
from optimized.engine import RequestRejected
from optimized.models.wan.instance import WanModelInstance
from optimized.runtime.memory import MemoryStateError, StreamedBlocks


def wan_request(seed: int = 0) -> WanGenerateRequest:
    return WanGenerateRequest(text_ids=torch.arange(1, 5), negative_text_ids=torch.arange(1, 3), num_frames=5,
                              height=32, width=32, num_steps=2, guidance_scale=5.0, seed=seed)


def deep_wan_weights(layers: int = 8):
    """The tiny t2v model with a deeper DiT (8 blocks): bigger than its VAE, so a weight budget can hold the VAE
    whole and still be below the DiT's bytes."""
    cfg = load_model_variant("tiny-2.1-t2v")
    cfg = dataclasses.replace(cfg, dit=dataclasses.replace(cfg.dit, num_layers=layers))
    return cfg, WanModelInstance.random_weights(cfg, 0)


def wan_video(engine: Engine):
    r = engine.generate_video(wan_request())
    return r.frames, r.latents["vision"]


@pytest.fixture(scope="module")
def wan_resident():
    cfg, weights = deep_wan_weights()
    return cfg, weights, wan_video(Engine.from_weights(cfg, weights))


@pytest.mark.parametrize("mode", ["idle", "blockwise"])
def test_wan_offload_bitwise_equal(wan_resident, mode):
    cfg, weights, (frames, latents) = wan_resident
    eng = Engine.from_weights(cfg, weights, offload=mode)
    got_frames, got_latents = wan_video(eng)
    assert torch.equal(got_frames, frames) and torch.equal(got_latents, latents)
    s = eng.memory.summary()
    total = sum(c["bytes"] for c in s["components"].values())
    assert s["weights_peak_device_bytes"] < total      # never the whole model on the device at once
    assert eng.memory.stats.onloads > 0                 # weights really moved


def test_wan_blockwise_under_a_budget_below_the_dit(wan_resident):
    cfg, weights, (frames, latents) = wan_resident
    probe = Engine.from_weights(cfg, weights).memory.components
    dit, vae = probe["transformer"].nbytes, probe["vae"].nbytes
    budget = vae                                        # the largest block-less component must fit whole
    assert budget < dit
    eng = Engine.from_weights(cfg, weights, offload="blockwise", offload_budget_bytes=budget)
    got_frames, got_latents = wan_video(eng)
    assert torch.equal(got_frames, frames) and torch.equal(got_latents, latents)
    s = eng.memory.summary()
    assert s["weights_peak_device_bytes"] <= budget < dit
    assert s["components"]["transformer"]["window"] == 2            # one block running, one prefetched
    assert eng.memory.stats.block_fetches >= 2 * 8                  # every block of every step came from host
    # between forwards no DiT block is on the device
    assert all(not s.on_device for b in eng.memory.components["transformer"].block_slots for s in b)


def test_blockwise_budget_too_small_is_refused():
    cfg, weights = deep_wan_weights()
    with pytest.raises(ValueError, match="below what 'transformer' needs"):
        Engine.from_weights(cfg, weights, offload="blockwise", offload_budget_bytes=1000)
    with pytest.raises(ValueError, match="offload must be one of"):
        Engine.from_variant("tiny-2.1-t2v", offload="sometimes")


def test_missed_prefetch_is_caught_and_named(wan_resident, monkeypatch):
    """Negative control: a prefetch that skips block 3 must fail naming it, never run on a stand-in tensor."""
    cfg, weights, _ = wan_resident
    eng = Engine.from_weights(cfg, weights, offload="blockwise")
    real = StreamedBlocks._fetch

    def broken(self, j):
        if j == 3:
            self.resident.add(j)   # claims the block without copying it
            return
        real(self, j)
    monkeypatch.setattr(StreamedBlocks, "_fetch", broken)
    with pytest.raises(RuntimeError, match="block 3 of 'transformer' is not resident"):   # the program's failure
        eng.generate_video(wan_request())


def test_sleep_wake_bitwise_and_admission(wan_resident):
    cfg, weights, (frames, latents) = wan_resident
    eng = Engine.from_weights(cfg, weights)
    plane = eng.memory
    total = plane.device_bytes
    freed = eng.sleep(("weights:vae",))
    assert freed == plane.components["vae"].nbytes and plane.asleep() == ["vae"]
    assert all(s.tensor.is_meta for s in plane.components["vae"].slots)   # nothing of the VAE on the device
    assert plane.admission_bytes() == freed
    eng.wake("weights:vae")
    assert plane.device_bytes == total and not plane.asleep()
    eng.sleep()                                                  # every component to host
    assert plane.device_bytes == 0
    with pytest.raises(MemoryStateError, match="asleep"):       # used directly while asleep: refused
        eng.model.vae  # noqa: B018 - (attribute access is fine; running is not)
        plane.use("vae")
    got_frames, got_latents = wan_video(eng)                     # a request wakes the weights
    assert torch.equal(got_frames, frames) and torch.equal(got_latents, latents)
    assert plane.device_bytes == total


def test_slept_bytes_count_against_the_budget():
    probe = Engine.from_variant("tiny-2.1-t2v")
    cost = probe.family.request_cost(probe, wan_request(), ("denoise", "decode", "artifact"))
    budget = cost.peak[1] + probe.memory.device_bytes // 2       # the request fits; the request + weights do not
    eng = Engine.from_variant("tiny-2.1-t2v", memory_budget_bytes=budget)
    eng.generate_video(wan_request())
    eng.sleep()
    with pytest.raises(RequestRejected, match="slept weights"):
        eng.generate_video(wan_request())
    assert eng.memory.asleep()                                    # refused: nothing was woken
    with pytest.raises(ValueError, match="unknown memory tag"):
        eng.sleep(("weights:nope",))


def test_unload_reload_from_the_variant_seed(wan_resident):
    eng = Engine.from_variant("tiny-2.1-t2v")
    want = wan_video(eng)
    before = eng.memory.device_bytes
    freed = eng.unload("text_encoder")
    assert freed > 0 and eng.memory.unloaded() == ["text_encoder"]
    assert all(s.host is None for s in eng.memory.components["text_encoder"].slots)   # not even on host
    eng.model.text_encoder.cache.clear()
    with pytest.raises(RequestRejected, match="unloaded"):
        eng.generate_video(wan_request())
    eng.reload("text_encoder")
    assert eng.memory.device_bytes == before
    got = wan_video(eng)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_sleep_refused_with_requests_in_flight():
    eng = Engine.from_variant("tiny-2.1-t2v")
    eng.submit(wan_request())
    with pytest.raises(RuntimeError, match="in flight"):
        eng.sleep()
    eng.run_until_idle()


def cosmos3_run(eng: Engine):
    h = eng.submit_built("video", text_ids=torch.arange(4), negative_text_ids=torch.arange(2), num_frames=5, height=32,
                         width=32, num_steps=2, guidance_scale=3.0, seed=1)
    video = h.result()["latents"]["vision"]
    tokens = eng.generate(ReasonRequest(torch.arange(4), 3))
    return video, tokens


@pytest.mark.parametrize("mode", ["idle", "blockwise"])
def test_cosmos3_offload_bitwise_equal(mode):
    want_video, want_tokens = cosmos3_run(Engine.from_variant("cosmos3:tiny", seed=0))
    eng = Engine.from_variant("cosmos3:tiny", seed=0, offload=mode)
    video, tokens = cosmos3_run(eng)
    assert torch.equal(video, want_video)
    assert torch.equal(torch.as_tensor(tokens["text_ids"]), torch.as_tensor(want_tokens["text_ids"]))
    if mode == "blockwise":
        c = eng.memory.components["transformer"]
        assert eng.memory.peak_device_bytes < c.nbytes and eng.memory.stats.block_fetches > 0
        eng.sleep()
        assert eng.memory.device_bytes == 0
        video, _ = cosmos3_run(eng)                                   # woken by admission
        assert torch.equal(video, want_video)


def test_fvgen_offload_flag_same_frames(tmp_path, capsys):
    """`fvgen wan --offload blockwise` writes the frames the resident run writes; an unknown mode is a usage error."""
    from optimized.serving import fvgen
    from parity.artifacts import read_png_frames

    frames = {}
    for mode in ("none", "blockwise"):
        out = tmp_path / mode
        code = fvgen.main(["wan", "--variant", "tiny", "--prompt", "hi", "--steps", "2", "--frames", "5", "--size",
                           "32x32", "--quiet", "--offload", mode, "--out", str(out)])
        assert code == 0, capsys.readouterr().err
        frames[mode] = read_png_frames(out)
    assert np.array_equal(frames["none"], frames["blockwise"])
    code = fvgen.main(["wan", "--variant", "tiny", "--prompt", "hi", "--offload", "sometimes", "--out",
                       str(tmp_path / "x")])
    assert code == 2 and "--offload" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_card_says_where_the_weights_are():
    eng = Engine.from_variant("tiny-2.1-t2v", offload="idle")
    mem = eng.deployment_card()["memory"]
    assert mem["offload"] == "idle" and mem["weights_device_bytes"] == 0
    assert mem["weights_host_bytes"] == sum(c.nbytes for c in eng.memory.components.values())   # all on host
    eng.generate_video(wan_request())
    eng.sleep()
    mem = eng.deployment_card()["memory"]
    assert sorted(mem["asleep"]) == sorted(eng.memory.components) and mem["weights_device_bytes"] == 0


def test_offload_follows_a_weight_update():
    cfg = load_model_variant("tiny-2.1-t2v")
    new = WanModelInstance.random_weights(cfg, 1)
    want = wan_video(Engine.from_weights(cfg, new))
    eng = Engine.from_weights(cfg, WanModelInstance.random_weights(cfg, 0), offload="blockwise")
    eng.update_weights(new, version="v1")
    got = wan_video(eng)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert eng.memory.instance is eng.model and eng.memory.mode == "blockwise" and eng.memory.stats.block_fetches


def test_captured_graphs_refuse_moving_weights():
    """A captured CUDA graph holds weight addresses: sleeping or offloading under it is refused, nothing moved."""
    eng = Engine.from_variant("tiny-2.1-t2v")
    eng.model.dit.graph_mode = "cuda"   # as configure_graph("cuda") leaves it (no capture needed to refuse)
    with pytest.raises(MemoryStateError, match="captured CUDA graphs"):
        eng.sleep()
    assert eng.memory.device_bytes == sum(c.nbytes for c in eng.memory.components.values())
