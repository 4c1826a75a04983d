"""A skipped block-forward is not paid (issue 21): the block-forwards the accelerated step executes are exactly the
ones its AccelDecision rows claim (rows x blocks counted at WanDiTFast._block_forward), for every step cache, with
cond / uncond rows deciding apart in one batch. Counts only, no timing (speed lives in tools/bench_accel.py and
tools/profile_accel.py)."""

from __future__ import annotations

import pytest

from manifests.accel import parse_accel
from optimized.models.wan import transformer
from parity.accel_checks import default_request
from tests.test_accel_caches import SPECS, run, tiny

# the tiny model has 2 blocks: SPECS' dbcache (fn=1, bn=1) has an empty middle, a reuse there skips nothing
HOT = {**SPECS, "dbcache": "dbcache:fn=1,bn=0,warmup=1,threshold=0.5"}


@pytest.mark.parametrize("name", ["fbcache", "dbcache", "taylorseer", "magcache", "guidance_interval"])
def test_executed_block_forwards_are_the_claimed_ones(name, monkeypatch):
    executed = []
    orig = transformer.WanDiTFast._block_forward

    def counting(self, w, x, *args, **kw):
        executed.append(x.shape[0])
        return orig(self, w, x, *args, **kw)

    monkeypatch.setattr(transformer.WanDiTFast, "_block_forward", counting)
    cfg, _ = tiny()
    steps = 6
    _, (res,) = run([default_request(cfg, parse_accel(HOT[name]), steps, seed=1)])
    decisions = res["accel"]["decisions"]
    L = cfg.dit.num_layers
    # a "reuse" row runs every block outside blocks_reused (DBCache: its first Fn AND its last Bn blocks; the row's
    # blocks_computed names the first Fn only, as upstream's decision does); "skip" / "predict" rows run none
    claimed = sum(L if d.action == "compute" else L - (d.blocks_reused[1] - d.blocks_reused[0])
                  for d in decisions if d.action in ("compute", "reuse"))
    full = 2 * steps * L                                    # cond + uncond rows, every block, every step
    assert any(d.action != "compute" for d in decisions), f"{name}: no hit on the tiny model, nothing to check"
    assert sum(executed) == claimed < full


def test_accelerated_segments_run_in_the_dits_graph_mode():
    """A DiT configured for capture runs the accelerated step's block segments through its CompileCache too (the exact
    stack is compiled / captured: the cached one must not fall back to eager); same decisions, same latents."""
    from optimized.models.wan.denoise import WanDenoiseJob, WanDenoiseLoop
    from optimized.models.wan.instance import WanModelInstance
    from optimized.runtime.compile import CompileCache
    from optimized.runtime.scheduler import WorkUnitScheduler

    cfg, weights = tiny()
    req = default_request(cfg, parse_accel(HOT["dbcache"]), 4, seed=1)
    _, (eager,) = run([req])
    model = WanModelInstance(cfg, weights, weights_version="accel-test")
    dit = model.expert(1)
    dit.graph_cache = CompileCache(emulate_capture=True)
    dit.configure_graph("cuda")
    sched = WorkUnitScheduler()
    h = sched.submit(WanDenoiseLoop(model), WanDenoiseJob(req))
    while not sched.idle:
        sched.tick()
    assert h.status == "completed", h.error
    assert dit.graph_cache.stats.builds.get("replayed", 0) >= 2           # the two segments of a decide step
    assert h.result["accel"]["decisions"] == eager["accel"]["decisions"]
    assert (h.result["latents"]["vision"] - eager["latents"]["vision"]).abs().max() < 1e-5
