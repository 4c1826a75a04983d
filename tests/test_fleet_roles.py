"""Role workers and the local fleet: the program's split into roles (derived from its stages), the stage checks at a
replica's door, and a fleet whose roles run on their own engines (in this process; in spawned processes: slow)
producing the co-located engine's video bitwise, with the bytes each transfer moved counted per request."""

import pytest
import torch

from optimized.fleet.roles import LocalFleet, RoleEngine, RoleSpec
from optimized.fleet.stages import role_of_stage, split_program
from optimized.fleet.transfer import TransferError, pack

VARIANT = "tiny-2.1-t2v"


@pytest.fixture(scope="module")
def engine():
    from optimized.serving.loading import load_engine
    return load_engine("wan", None, VARIANT)


@pytest.fixture(scope="module")
def request_and_video(engine):
    from optimized.programs import generate_video
    from optimized.serving.requests import build_request
    req, img = build_request(engine, prompt_ids=[3, 5, 7, 9], num_frames=5, height=32, width=32, num_steps=2, seed=7)
    return req, img, generate_video(engine, req, image=img, request_id="co")


def test_roles_follow_the_program_stages(engine, request_and_video):
    assert [role_of_stage(s) for s in ("encode", "denoise", "decode", "artifact")] == \
        ["encoder", "denoiser", "decoder", "decoder"]
    req, img, _ = request_and_video
    split = split_program(engine, req, img)
    assert split.program_stages == ("denoise", "decode")          # no image to encode: the encoder passes through
    assert split.stages_of("encoder") == () and split.stages_of("decoder") == ("decode", "artifact")


def test_role_spec_refuses_bad_fields():
    with pytest.raises(ValueError, match="^role"):
        RoleSpec("vae", family="wan", variant=VARIANT)
    with pytest.raises(ValueError, match="exactly one of variant or model_dir"):
        RoleSpec("encoder", family="wan")


def test_a_replica_refuses_a_manifest_for_another_role(engine, request_and_video):
    req, img, _ = request_and_video
    body = RoleEngine(RoleSpec("decoder", family="wan", variant=VARIANT), engine)
    m, t = pack({"request": req, "image": img}, request_id="r", stage="request", producer="gateway",
                consumer="encoder")
    with pytest.raises(TransferError, match="^consumer: manifest is for encoder, this replica is decoder-0"):
        body.run_stage(m, t)


def test_inprocess_fleet_is_bitwise_the_colocated_video_and_counts_bytes(request_and_video):
    req, img, co = request_and_video
    with LocalFleet("wan", VARIANT, denoisers=2, processes=False, chunk_bytes=128) as fleet:
        got = fleet.generate(req, img)
        again = fleet.generate(req, img)
        counted = sum(w.transport.bytes_moved for ws in fleet.workers.values() for w in ws)
    assert torch.equal(got.frames, co.frames) and torch.equal(got.latents["vision"], co.latents["vision"])
    assert torch.equal(again.frames, co.frames)
    assert {got.replicas["denoiser"], again.replicas["denoiser"]} == {"denoiser-0", "denoiser-1"}   # least used
    # bytes: analytic from the co-located outputs (frames F*H*W*3 uint8; latents fp32) and the request's ids
    ids = sum(t.numel() * t.element_size() for t in (req.text_ids, req.negative_text_ids))
    assert got.bytes_by_transfer == {"gateway->encoder": ids, "encoder-0->denoiser": ids,
                                     f"{got.replicas['denoiser']}->decoder": co.latents["vision"].numel() * 4,
                                     "decoder-0->gateway": 5 * 32 * 32 * 3}
    assert got.bytes_moved == sum(got.bytes_by_transfer.values())
    # every role's transport carried its input and its output, for both requests
    assert counted == 2 * (got.bytes_moved + ids + co.latents["vision"].numel() * 4)


def test_denoiser_cache_serves_a_repeat_on_the_replica_holding_it(request_and_video):
    req, img, co = request_and_video
    with LocalFleet("wan", VARIANT, denoisers=2, processes=False, denoiser_cache_entries=2) as fleet:
        first = fleet.generate(req, img)
        repeat = fleet.generate(req, img)
    assert not first.cache_hits["denoiser"] and repeat.cache_hits["denoiser"]
    assert repeat.replicas["denoiser"] == first.replicas["denoiser"]       # affinity: where the entry is
    assert torch.equal(repeat.frames, co.frames)


@pytest.mark.slow
def test_process_fleet_is_bitwise_the_colocated_video(request_and_video):
    req, img, co = request_and_video
    with LocalFleet("wan", VARIANT, denoisers=1, processes=True, transport="shared_memory",
                    chunk_bytes=128) as fleet:
        got = fleet.generate(req, img)
        pids = {w.proc.pid for ws in fleet.workers.values() for w in ws}
        transports = [w.transport for ws in fleet.workers.values() for w in ws]
    import os
    assert len(pids) == 3 and os.getpid() not in pids
    assert torch.equal(got.frames, co.frames) and torch.equal(got.latents["vision"], co.latents["vision"])
    assert all(t.live_segments() == set() for t in transports)            # every segment consumed and released


@pytest.mark.slow
def test_a_role_process_that_cannot_load_is_one_clear_error(tmp_path):
    from optimized.fleet.roles import RoleFailed, RoleWorker
    worker = RoleWorker(RoleSpec("denoiser", family="wan", model_dir=str(tmp_path / "missing")))
    with pytest.raises(RoleFailed, match="^denoiser-0 failed to start: "):
        worker.start()
    assert worker.proc is None                                            # closed, nothing left running
