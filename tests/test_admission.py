"""Admission before allocation (issue 22, F1 / F2 / F19 / F21): a request's peak bytes come from its fields and are
compared with the engine's memory budget before anything is allocated; every numeric field is bounded by the
family's request contract; every refusal is a RequestRejected naming the field."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.sampling import Cosmos3GenerateRequest
from manifests.wan.sampling import WanGenerateRequest
from optimized import Engine, RequestRejected
from parity.weights import random_state_dict

ROOT = Path(__file__).resolve().parents[1]
COSMOS_CFG = load_variant("tiny")
COSMOS_STATE = random_state_dict(canonical_key_shapes(COSMOS_CFG), 3)


def cosmos_engine(**kw):
    return Engine.from_state_dict(COSMOS_CFG, COSMOS_STATE, **kw)


def cosmos_request(**kw):
    base = dict(text_ids=torch.arange(6), negative_text_ids=torch.arange(3), latent_frames=2, latent_height=4,
                latent_width=4, num_steps=2, guidance_scale=4.0, seed=1)
    base.update(kw)
    return Cosmos3GenerateRequest(**base)


def wan_request(**kw):
    base = dict(text_ids=torch.arange(1, 5), negative_text_ids=torch.arange(1, 3), num_frames=5, height=32, width=32,
                num_steps=1, seed=0)
    base.update(kw)
    return WanGenerateRequest(**base)


# the requests of F1, each inside wan's family limits (4093 frames, 16384 pixels a side)
HUGE = [(2049, 8192, 8192), (1025, 4096, 4096), (4093, 16384, 16384)]

PROBE = """
import json, resource, sys, torch
from manifests.wan.sampling import WanGenerateRequest
from optimized import Engine, RequestRejected
eng = Engine.from_variant("tiny-2.1-t2v")
eng.generate_video(WanGenerateRequest(text_ids=torch.arange(1, 5), num_frames=5, height=32, width=32, num_steps=1,
                                      guidance_scale=1.0))   # warm: every lazy buffer and import is in place
out = []
for frames, height, width in json.loads(sys.argv[1]):
    for how in ("submit", "start_video"):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        req = WanGenerateRequest(text_ids=torch.arange(1, 5), num_frames=frames, height=height, width=width,
                                 num_steps=1, guidance_scale=1.0)
        try:
            getattr(eng, how)(req)
            error, field = "accepted", None
        except RequestRejected as e:
            error, field = "RequestRejected", e.field
        except Exception as e:   # the defect: a raw error after the allocation
            error, field = type(e).__name__, None
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before   # KiB of peak RSS growth
        out.append(dict(request=[frames, height, width], how=how, error=error, field=field, grown_kib=grown))
print(json.dumps(out))
"""


def test_huge_wan_requests_are_rejected_naming_the_field_before_any_allocation():
    """Peak RSS (a fresh process, warmed up) grows by less than 50 MiB while each request is refused; the refusal is
    a RequestRejected naming num_frames, through Engine.submit and through a video program."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HUGE)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * len(HUGE)
    for row in rows:
        assert row["error"] == "RequestRejected" and row["field"] == "num_frames", row
        assert row["grown_kib"] < 50 * 1024, row


def test_rejection_says_what_the_peak_is_and_the_budget():
    eng = Engine.from_variant("tiny-2.1-t2v")
    with pytest.raises(RequestRejected, match=r"needs about .* GiB at its peak .* memory budget of 8 GiB") as e:
        eng.submit(wan_request(num_frames=2049, height=8192, width=8192))
    assert "num_frames, height, width" in str(e.value)


def test_the_video_peak_bounds_what_a_clip_really_holds_and_follows_the_budget():
    """The costed artifact phase is at least the clip's float video + uint8 frames (measured on a real result),
    and a budget below the costed peak refuses the program while one above it runs it."""
    eng = Engine.from_variant("tiny-2.1-t2v")
    req = wan_request(num_frames=9, height=64, width=64)
    result = eng.generate_video(req)
    cost = eng.family.request_cost(eng, req, ("denoise", "decode", "artifact"))
    held_by_a_clip = result.frames.numel() * (1 + 4)   # uint8 frames + the decoded float32 video
    assert cost.phases["artifact"] >= held_by_a_clip
    _, peak = cost.peak
    small = Engine.from_variant("tiny-2.1-t2v", memory_budget_bytes=peak - 1)
    with pytest.raises(RequestRejected, match="memory budget") as e:
        small.start_video(req)
    assert e.value.field == "num_frames"
    assert small.scheduler.idle and not small.scheduler.records      # nothing was submitted
    roomy = Engine.from_variant("tiny-2.1-t2v", memory_budget_bytes=peak + (64 << 20))
    assert torch.equal(roomy.generate_video(req).frames, result.frames)


def test_default_budget_is_the_devices_memory_or_the_host_budget():
    from optimized.engine import HOST_MEMORY_BUDGET, default_memory_budget
    assert cosmos_engine().scheduler.memory_budget_bytes == HOST_MEMORY_BUDGET
    assert cosmos_engine(memory_budget_bytes=1 << 33).scheduler.memory_budget_bytes == 1 << 33
    if torch.cuda.is_available():
        assert default_memory_budget("cuda:0") == torch.cuda.get_device_properties(0).total_memory


@pytest.mark.parametrize("bad, field", [
    (dict(num_steps=10 ** 9), "num_steps"),                   # F2: passed 7 GiB building the schedule
    (dict(num_steps=1001), "num_steps"),
    (dict(guidance_scale=1e308), "guidance_scale"),            # F19: ran the whole denoise, failed at decode
    (dict(guidance_scale=-math.inf), "guidance_scale"),
    (dict(text_ids=torch.arange(10_000) % 100), "text_ids"),   # F19: 10,000 prompt ids were accepted
    (dict(negative_text_ids=torch.zeros(600, dtype=torch.int64)), "negative_text_ids"),
    (dict(fps=1e300), "fps"),
])
def test_cosmos3_numeric_fields_are_bounded_by_the_contract(bad, field, monkeypatch):
    from optimized.models.cosmos3.loops import FlowDenoiseLoop
    monkeypatch.setattr(FlowDenoiseLoop, "init_state", lambda self, job: pytest.fail("allocated before the bound"))
    eng = cosmos_engine()
    with pytest.raises(RequestRejected) as e:
        eng.submit(cosmos_request(**bad))
    assert e.value.field == field, str(e.value)
    assert field in str(e.value)
    assert not eng.scheduler.records


@pytest.mark.parametrize("bad, field", [
    (dict(num_steps=10 ** 9), "num_steps"),
    (dict(guidance_scale=1e308), "guidance_scale"),
    (dict(text_ids=torch.arange(1, 10_001) % 100 + 1), "text_ids"),
    (dict(num_frames=8), "num_frames"),
    (dict(width=33), "width"),
])
def test_wan_numeric_fields_are_rejected_naming_the_field(bad, field):
    with pytest.raises(RequestRejected) as e:
        Engine.from_variant("tiny-2.1-t2v").submit(wan_request(**bad))
    assert e.value.field == field, str(e.value)


def test_the_bounds_are_contract_data_both_sides_read():
    from manifests.cosmos3 import sampling as cosmos3_sampling
    from manifests.errors import RequestFieldError
    from manifests.wan import sampling as wan_sampling
    for contract in (cosmos3_sampling, wan_sampling):
        b = contract.BOUNDS
        assert b.max_steps >= 50 and math.isfinite(b.max_abs_guidance) and b.max_prompt_tokens >= 1
    with pytest.raises(RequestFieldError) as e:   # the reference side validates through the same contract
        cosmos_request(num_steps=cosmos3_sampling.BOUNDS.max_steps + 1).validate(COSMOS_CFG)
    assert e.value.field == "num_steps"
    cosmos_request(num_steps=cosmos3_sampling.BOUNDS.max_steps).validate(COSMOS_CFG)   # the bound itself is allowed


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.complex64])
def test_an_engine_in_a_dtype_its_kernels_cannot_run_is_refused_at_construction(dtype):
    """F21: int8 built an engine that failed only at the first generate."""
    with pytest.raises(ValueError, match="the engine runs in one of float32, bfloat16, float16"):
        Engine.from_variant("tiny-2.1-t2v", dtype=dtype)
    with pytest.raises(ValueError, match="the engine runs in one of"):
        Engine.from_state_dict(COSMOS_CFG, COSMOS_STATE, dtype=dtype)
