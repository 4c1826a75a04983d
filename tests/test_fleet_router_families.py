"""Each family's video program split into encoder / denoiser / decoder replicas (in this process) computes bitwise
what the co-located engine computes: wan t2v, wan i2v with an image (encoded by its denoise loop), cosmos3 with an
image (encoded by the encoder role's VAE encode loop). An exact repeat is served from the replicas' resident stage
outputs (fleetcore's RoleEngine cache, keyed by the input's content) and is still bitwise the same."""

import pytest
import torch

from optimized.fleet.deployment import parse_deployment
from optimized.serving.fleet_server import FleetGateway, FleetProgram
from optimized.serving.loading import load_engine
from optimized.serving.requests import build_request

FIELDS = {"prompt_ids": [5, 7, 9, 11], "num_steps": 2, "seed": 3}


def run_fleet(gw, image, pid):
    req, img = build_request(gw.front, image=image, **FIELDS)
    prog = FleetProgram(gw, req, program_id=pid, image=img).start()
    assert prog.done.wait(300)
    assert prog.status == "completed", prog.error
    return prog


@pytest.mark.parametrize("family, variant, with_image", [("wan", "tiny-2.1-t2v", False),
                                                         ("wan", "tiny-2.1-i2v", True),
                                                         ("cosmos3", "tiny", True)])
def test_disaggregated_video_is_bitwise_the_colocated_one(family, variant, with_image):
    torch.manual_seed(0)
    image = torch.rand(3, 32, 32) * 2 - 1 if with_image else None
    co = load_engine(family, None, variant)
    req, img = build_request(co, image=image, **FIELDS)
    want = co.generate_video(req, image=img)
    spec = parse_deployment({"name": "f", "model": {"family": family, "variant": variant}, "transport": "inprocess",
                             "placement": {"backend": "local"}, "routing": {"health_interval_s": 3600},
                             "roles": {"encoder": {}, "denoiser": {"replicas": 2}, "decoder": {}}})
    gw = FleetGateway.start(spec)
    first = None
    try:
        for i in range(2):   # the repeat: the encoder's cache (an image it encoded) and the denoiser's text cache
            prog = run_fleet(gw, image, f"p{i}")
            got = prog.value
            assert torch.equal(got.frames, want.frames)
            assert set(got.latents) == set(want.latents)
            assert all(torch.equal(got.latents[k], want.latents[k]) for k in want.latents)
            assert (got.audio is None) == (want.audio is None)
            assert got.audio is None or torch.equal(got.audio, want.audio)
            assert got.seed == want.seed and got.fps == want.fps and got.weights_version == want.weights_version
            stages = prog.ledger.completed
            assert list(stages) == ["encoder", "denoiser", "decoder"] and prog.ledger.bytes_moved > 0
            if i == 1:   # an exact repeat: served from the resident stage outputs, routed to where they are
                assert stages["encoder"].cache_hit is True and stages["decoder"].cache_hit is False
                assert stages["denoiser"].cache_hit is True
                assert stages["denoiser"].replica_id == first.completed["denoiser"].replica_id
            first = prog.ledger
    finally:
        gw.close()
