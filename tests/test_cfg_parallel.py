"""CFG-parallel (optimized/parallel/cfg_parallel.py) for wan, C1-style: the final latents of guided requests with
plan cfgp2 on 2 gloo ranks vs one process vs the reference pipeline (fp32 rel-L2 within 1e-5); negative control:
the branches swapped across ranks must fail. The policy itself on every mix of guided and unguided rows vs the
batched policy (the halved-predictions control must fail there). In-process: row split, structure gather at degree
1, registration."""

from __future__ import annotations

import pytest
import torch

from manifests.wan import WanGenerateRequest, load_model_variant
from optimized.models.wan.denoise import WanDenoiseLoop
from optimized.models.wan.instance import WanModelInstance
from optimized.parallel.cfg_parallel import CFGParallel, split_rows
from optimized.parallel.launch import run_ranks
from optimized.parallel.mesh import build_mesh
from optimized.parallel.plan import ParallelPlan
from optimized.runtime.scheduler import run_requests
from optimized.solvers.policies import make_policy
from parity.parallel_faults import planted

VARIANT, SEED, REL_L2 = "tiny-2.1-t2v", 0, 1e-5


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def requests(cfg) -> list[WanGenerateRequest]:
    """Two guided requests (different scales, seeds, prompts) and one unguided: 3 cond + 2 uncond rows a step."""
    s = cfg.vae.spatial_compression * 2
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 128, (n,), generator=g) for n in (7, 4, 5, 6)]
    base = dict(num_frames=5, height=2 * s, width=2 * s, num_steps=3)
    return [WanGenerateRequest(text_ids=ids[0], negative_text_ids=ids[1], guidance_scale=5.0, seed=7, **base),
            WanGenerateRequest(text_ids=ids[2], negative_text_ids=ids[1], guidance_scale=3.0, seed=8, **base),
            WanGenerateRequest(text_ids=ids[3], guidance_scale=1.0, seed=9, **base)]


def latents(policy) -> list[torch.Tensor]:
    cfg = load_model_variant(VARIANT)
    instance = WanModelInstance.random(cfg, SEED)
    results = run_requests(WanDenoiseLoop(instance, policy), requests(cfg))
    return [r["latents"]["vision"] for r in results]


def _cfgp_worker(group) -> dict:
    """This rank's latents with plan cfgp2, then with the branches swapped across ranks (the control)."""
    mesh = build_mesh(ParallelPlan.parse("cfgp2"))
    policy = CFGParallel(mesh.axis("cfgp"))
    out = {"latents": latents(policy), "stats": dict(policy.stats), "bytes": mesh.bytes_sent()}
    with planted("cfg-branches-swapped"):   # the control, patched by this rank (parity/parallel_faults.py)
        out["swapped"] = latents(CFGParallel(mesh.axis("cfgp")))
    return out


def _mixes_worker(group) -> dict:
    """(guided, unguided) -> this rank's (cond, uncond) predictions of CFGParallel, clean and with the gathered
    predictions cut in half (the control), on a forward that tags each row."""
    mesh = build_mesh(ParallelPlan.parse("cfgp2"))

    def forward(rows):   # one prediction per row, telling which row it came from
        return [torch.full((2,), float(r)) for r in rows]

    out: dict = {"clean": {}, "halved": {}}
    for guided in range(1, 4):
        for unguided in range(0, 3):
            cond, uncond = list(range(guided + unguided)), [100 + k for k in range(guided)]
            out["clean"][guided, unguided] = CFGParallel(mesh.axis("cfgp")).run(forward, cond, uncond)
            with planted("cfg-rows-halved"):
                out["halved"][guided, unguided] = CFGParallel(mesh.axis("cfgp")).run(forward, cond, uncond)
    return out


@pytest.mark.dist
def test_cfg_parallel_matches_batched_on_every_mix_of_guided_and_unguided_rows():
    """Every rank gets back the predictions of its rows' own branch, whichever rank ran them; the halved control
    (cond = the first half of the gathered rows) is right only when no request is unguided."""
    ranks = run_ranks(_mixes_worker, 2, (), timeout_s=240)
    wrong_when_halved = set()
    for (guided, unguided), got in ranks[0]["clean"].items():
        want = ([float(r) for r in range(guided + unguided)], [100.0 + k for k in range(guided)])
        for rank in ranks:
            cond, uncond = rank["clean"][guided, unguided]
            assert ([float(p[0]) for p in cond], [float(p[0]) for p in uncond]) == want, (guided, unguided)
            h_cond, h_uncond = rank["halved"][guided, unguided]
            if ([float(p[0]) for p in h_cond], [float(p[0]) for p in h_uncond]) != want:
                wrong_when_halved.add((guided, unguided))
    assert wrong_when_halved == {(g, u) for g in range(1, 4) for u in range(1, 3)}, sorted(wrong_when_halved)


def test_split_rows_and_registration():
    assert split_rows(4, 2) == [(0, 2), (2, 4)]          # 2 guided requests: rank 0 = cond, rank 1 = uncond
    assert split_rows(5, 2) == [(0, 3), (3, 5)]
    assert split_rows(3, 4)[3] == (3, 3)
    policy = make_policy("cfg-parallel")
    assert isinstance(policy, CFGParallel) and policy.group.world_size == 1
    cond, uncond = policy.run(lambda rows: [r * 2 for r in rows], [1, 2], [3])
    assert (cond, uncond) == ([2, 4], [6])


@pytest.mark.dist
def test_wan_cfgp2_matches_one_process_and_reference_and_swap_fails():
    pytest.importorskip("reference.wan.pipeline")
    from reference.wan.pipeline import WanReferencePipeline

    good = run_ranks(_cfgp_worker, 2, (), timeout_s=240)
    cfg = load_model_variant(VARIANT)
    single = latents("batched")
    ref = WanReferencePipeline(cfg, WanModelInstance.random_weights(cfg, SEED))
    want = [ref.generate(r).latents for r in requests(cfg)]
    for rank in good:
        assert rank["stats"]["steps"] == 3 and rank["bytes"] > 0           # the branches really were split
        for got, one, w in zip(rank["latents"], single, want):
            assert rel_l2(got, one) <= REL_L2, rel_l2(got, one)
            assert rel_l2(got, w) <= REL_L2, rel_l2(got, w)
    assert all(torch.equal(a, b) for a, b in zip(good[0]["latents"], good[1]["latents"]))  # ranks agree exactly

    swapped = [rel_l2(g, w) for g, w in zip(good[0]["swapped"][:2], single[:2])]   # the guided requests
    assert min(swapped) > 1e-2, swapped
