"""The capture interleave check (issue 22): two callers' replays of one captured bucket, interleaved, with an earlier
output held across a later replay. It must pass on the clean capture path and fail for each planted capture fault
(stale-static-buffer, static-output-handback, aliased-static-inputs), on a toy body and on every family step body
that captures (cosmos3 gen step, cosmos3 AR decode step, wan block stack). Real CUDA graphs: marked `gpu`."""

from __future__ import annotations

import pytest
import torch

from optimized.runtime.compile import CompileCache, GraphKey
from parity.graph_checks import capture_interleave_check, capture_interleave_checks, recording_calls
from parity.graph_faults import GRAPH_FAULTS, planted_graph_fault

# what each fault's failing check must say (parity/graph_checks.py capture_interleave_check)
SAYS = {"stale-static-buffer": "stale or aliased inputs",
        "static-output-handback": "static output buffers handed back",
        "aliased-static-inputs": "alias the first call's inputs"}


class ToyOwner:
    """A model-like owner of one step body: y = tanh(x @ w) + b, through its CompileCache."""

    def __init__(self, device: str = "cpu") -> None:
        g = torch.Generator().manual_seed(0)
        self.w, self.device, self.graph_mode = torch.randn(8, 8, generator=g).to(device), device, "eager"
        self.graph_cache = CompileCache()

    def body(self, x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(x @ self.w) + b,)

    def step(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        key = GraphKey("toy", "v", "w0", "float32", self.device, "B=4", 4, "none", "sdpa", self.graph_mode)
        runner, _ = self.graph_cache.step(key, self.body, (x, b))
        return runner(x, b)[0]


def toy_calls(device: str = "cpu", same: bool = False):
    owner = ToyOwner(device)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g).to(device) for _ in range(2)]
    b = torch.randn(8, generator=g).to(device)
    with recording_calls([owner]) as calls:
        for x in xs if not same else xs[:1] * 2:
            owner.step(x, b)
    assert owner.graph_cache.__class__ is CompileCache   # the owner's own cache is back
    return calls


def test_clean_capture_passes_and_says_what_it_replayed():
    (check,) = capture_interleave_checks("toy", toy_calls())
    assert check.passed, check.detail
    assert check.name == "toy/capture_interleave[B=4]" and "emulated graph" in check.detail


@pytest.mark.parametrize("fault", GRAPH_FAULTS)
def test_each_capture_fault_fails_the_check_naming_it(fault):
    calls = toy_calls()
    with planted_graph_fault(fault, []):
        (check,) = capture_interleave_checks("toy", calls)
    assert not check.passed and SAYS[fault] in check.detail, check.detail
    (clean,) = capture_interleave_checks("toy", calls)   # the seam is restored on exit
    assert clean.passed, clean.detail


def test_a_run_without_two_distinct_calls_fails_instead_of_measuring_nothing():
    (check,) = capture_interleave_checks("toy", toy_calls(same=True))
    assert not check.passed and "no bucket was called twice" in check.detail
    (a, b) = toy_calls().pairs()[0]
    same = capture_interleave_check("toy", a, a)
    assert not same.passed and "nothing measured" in same.detail
    assert capture_interleave_checks("toy", type(toy_calls())(enabled=False)) == []


def test_a_body_that_raises_is_a_failed_check_not_a_crash():
    (a, b) = toy_calls().pairs()[0]
    a.body = b.body = lambda x, y: (x @ torch.ones(3, 3),)
    check = capture_interleave_check("toy", a, b)
    assert not check.passed and "raised RuntimeError" in check.detail


# ---------------------------------------------------------------------------------------------- family step bodies

def _cosmos3_gen_calls():
    from manifests.cosmos3 import canonical_key_shapes, load_variant
    from manifests.cosmos3.io import Cosmos3ForwardInputs
    from optimized.models.cosmos3.model import Cosmos3Fast
    from parity.weights import random_state_dict

    cfg = load_variant("tiny")
    fast = Cosmos3Fast(cfg, random_state_dict(canonical_key_shapes(cfg), 0))
    g = torch.Generator().manual_seed(6)
    xs = [Cosmos3ForwardInputs(text_ids=torch.randint(0, cfg.vocab_size, (7,), generator=g),
                               vision_latents=torch.randn(1, cfg.latent_channels, 2, 4, 6, generator=g),
                               timestep=t, fps_vision=24.0) for t in (900, 300)]   # two callers, one bucket
    with recording_calls([fast]) as calls:
        for x in xs:
            fast.forward_batch([x])
    return calls


def _cosmos3_ar_calls():
    import optimized
    from manifests.cosmos3.reasoning import ReasonRequest

    eng = optimized.Engine.from_variant("cosmos3:tiny", kv_block_size=4, batching="greedy")
    g = torch.Generator().manual_seed(4)
    reqs = [ReasonRequest(prompt_ids=torch.randint(0, eng.model.cfg.vocab_size, (9,), generator=g),
                          max_new_tokens=4, seed=k) for k in range(2)]
    with recording_calls([eng.model]) as calls:
        for r in reqs:
            eng.submit_reasoning(r)
        eng.run_until_idle()
    return calls


def _wan_calls():
    import optimized
    from manifests.wan import WanGenerateRequest

    eng = optimized.Engine.from_variant("tiny-2.1-t2v", seed=0)
    s = eng.model.cfg.vae.spatial_compression * eng.model.cfg.dit.patch_size[1]
    req = WanGenerateRequest(text_ids=torch.tensor([5, 6, 7]), negative_text_ids=torch.tensor([8, 9]),
                             num_frames=5, height=2 * s, width=2 * s, num_steps=2, guidance_scale=5.0, seed=0)
    with recording_calls(eng.model.experts()) as calls:
        eng.generate(req)
    return calls


FAMILY_CALLS = {"cosmos3-gen": _cosmos3_gen_calls, "cosmos3-ar-decode": _cosmos3_ar_calls, "wan-blocks": _wan_calls}


@pytest.fixture(scope="module", params=sorted(FAMILY_CALLS))
def family_calls(request):
    return request.param, FAMILY_CALLS[request.param]()


def test_family_step_bodies_pass_clean_and_fail_every_capture_fault(family_calls):
    name, calls = family_calls
    clean = capture_interleave_checks(name, calls)
    assert clean and all(c.passed for c in clean), [c.detail for c in clean]
    for fault in GRAPH_FAULTS:
        with planted_graph_fault(fault, []):
            bad = capture_interleave_checks(name, calls)
        assert bad and not any(c.passed for c in bad), (fault, [c.detail for c in bad])
        assert all(SAYS[fault] in c.detail for c in bad), (fault, [c.detail for c in bad])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a CUDA device")
@pytest.mark.parametrize("fault", (None,) + GRAPH_FAULTS)
def test_real_cuda_graphs_interleave(fault):
    """The same check through torch.cuda.CUDAGraph: clean passes, each planted fault fails naming itself."""
    calls = toy_calls("cuda")
    with planted_graph_fault(fault, []) if fault else torch.no_grad():
        (check,) = capture_interleave_checks("toy", calls)
    assert "CUDA graph" in check.detail
    assert check.passed if fault is None else (not check.passed and SAYS[fault] in check.detail), check.detail


# ---------------------------------------------------------------------------------------------- through C1

@pytest.mark.slow
@pytest.mark.parametrize("family, fault", [(f, x) for f in ("cosmos3", "wan") for x in
                                           ("static-output-handback", "aliased-static-inputs")])
def test_c1_names_the_capture_fault_at_its_interleave_check(family, fault):
    """`fvparity run <family> --level C1 --plant-fault <fault>` (the C1 runner, first loop case): the interleave
    check fails with the fault's declared divergence (parity/families/*/faults.py)."""
    from parity.families import families

    if family == "cosmos3":
        from parity.families.cosmos3.c1 import run_c1
        report = run_c1(["tiny"], None, "cpu", ["fp32"], 0, fault, lambda m: None, only=("t2v",))
    else:
        from parity.families.wan.c1 import run_c1
        report = run_c1(["tiny-2.1-t2v"], None, "cpu", ["fp32"], 0, fault, lambda m: None)
    caps = [c for c in report.checks if "/capture_interleave[" in c.name]
    want = families()[family].fault(fault).divergence
    assert caps and all(not c.passed and want in c.divergence for c in caps), [(c.name, c.divergence) for c in caps]
