"""Role pools as Ray actors: the actor body in-process (default suite, no Ray), and a local Ray cluster (slow) where a
denoiser replica's process is killed mid-stage: the request completes on the other replica, nothing lost or written
twice; with every denoiser killed it fails with one clear error."""

import os
import signal
import sys
import threading
import time

import pytest

from optimized.fleet.deployment import parse_deployment
from optimized.fleet.ray_pool import LocalReplica, RayUnavailable, ReplicaActor, local_pools
from optimized.fleet.router import FleetRequestFailed, Router, StageOutput, StagePlan


class SlowWorker:
    """A role worker in the replica's process: the denoiser runs `steps` steps of `delay` seconds each."""

    def __init__(self, role, delay=0.0):
        self.role, self.delay, self.cache = role, delay, {}

    def resident(self):
        return tuple(self.cache)

    def run_stage(self, call):
        if self.role == "encoder":
            hit = call.cache_key in self.cache
            self.cache[call.cache_key] = emb = self.cache.get(call.cache_key, sum(map(ord, call.payload["prompt"])))
            return StageOutput({"emb": emb, "steps": call.payload["steps"],
                                "hang_first": call.payload.get("hang_first", False)}, 0.0, cache_hit=hit,
                               bytes_moved=8)
        if self.role == "denoiser":
            if call.payload.get("hang_first") and call.attempt == 1:
                time.sleep(600)                       # a replica that stops answering
            x = call.payload["emb"]
            for s in range(call.payload["steps"]):
                time.sleep(self.delay)
                x = (x * 31 + s) % 1_000_003
            return StageOutput({"latent": x, "pid": os.getpid()}, 0.0, bytes_moved=8)
        return StageOutput(f"video:{call.payload['latent']}", 0.0, bytes_moved=8)


def make_worker(role, replica_id=None, delay=0.0):
    return SlowWorker(role, delay)


def spec_doc(backend="local", denoisers=2):
    return {"name": "t", "model": {"family": "wan", "variant": "tiny-2.1-t2v"},
            "transport": "ray_object_store" if backend == "ray" else "inprocess",
            "placement": {"backend": backend, "num_cpus": 2},
            "roles": {"encoder": {"num_cpus": 0.25}, "denoiser": {"replicas": denoisers, "num_cpus": 0.25},
                      "decoder": {"num_cpus": 0.25}},
            "routing": {"stage_timeout_s": 120, "health_timeout_s": 30}}


PLANS = [StagePlan("encoder", 1, "text:p"), StagePlan("denoiser", 40), StagePlan("decoder", 1)]


def expected(prompt="p", steps=40):
    x = sum(map(ord, prompt))
    for s in range(steps):
        x = (x * 31 + s) % 1_000_003
    return f"video:{x}"


def test_actor_body_in_process_reports_health_and_residency():
    actor = ReplicaActor("encoder-0", "encoder", make_worker)
    out = actor.run_stage(type("C", (), {"request_id": "r", "role": "encoder", "attempt": 1, "cache_key": "k",
                                         "payload": {"prompt": "p", "steps": 2}})())
    assert out.payload == {"emb": ord("p"), "steps": 2, "hang_first": False} and out.resident == ("k",) and out.seconds >= 0
    h = actor.health()
    assert h.healthy and h.completed == 1 and h.inflight == 0 and h.resident == ("k",)


def test_local_backend_runs_a_request_through_the_router():
    spec = parse_deployment(spec_doc())
    pools = local_pools(spec, make_worker)
    assert [r.replica_id for r in pools["denoiser"]] == ["denoiser-0", "denoiser-1"]
    assert all(isinstance(r, LocalReplica) for reps in pools.values() for r in reps)
    router = Router(pools, spec.routing)
    art, ledger = router.run("r1", {"prompt": "p", "steps": 40}, PLANS)
    assert art == expected() and ledger.artifact_commits == 1


def test_ray_missing_is_one_clear_error(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    from optimized.fleet.ray_pool import RayRolePools
    with pytest.raises(RayUnavailable, match=r"needs Ray: pip install -e '.\[fleet\]'"):
        RayRolePools.start(parse_deployment(spec_doc("ray")), make_worker)


# ---------------------------------------------------------------------------------------- a local Ray cluster
@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the actors unpickle this module's workers
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _kill_when_running(replica, seen):
    """SIGKILL the replica's process once it is inside a stage."""
    pid = replica.pid()
    for _ in range(2000):
        if replica.running():
            seen.append(replica.running())
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.01)


@pytest.mark.slow
def test_ray_denoiser_killed_mid_stage_completes_on_the_other(ray_cluster):
    from functools import partial

    from optimized.fleet.ray_pool import RayRolePools
    spec = parse_deployment(spec_doc("ray"))
    pools = RayRolePools.start(spec, partial(make_worker, delay=0.05))
    try:
        assert not pools.started_ray                                   # joined the fixture's cluster
        d0, d1 = pools.replicas["denoiser"]
        assert d0.pid() != d1.pid() and d0.pid() != os.getpid()        # one process per replica
        router = Router(pools.replicas, spec.routing)
        seen, writes = [], []
        killer = threading.Thread(target=_kill_when_running, args=(d0, seen))
        killer.start()
        art, ledger = router.run("r1", {"prompt": "p", "steps": 40}, PLANS, finish=lambda v: writes.append(v) or v)
        killer.join(30)
        assert seen == ["r1/denoiser#1"]                               # it died inside the stage
        assert art == expected() and writes == [art]                   # same result, written once
        assert ledger.completed["denoiser"].replica_id == "denoiser-1"
        assert ledger.completed["denoiser"].attempt == 2 and ledger.completed["encoder"].attempt == 1
        assert len(ledger.failures) == 1 and "denoiser-0 died: actor process gone" in ledger.failures[0]
        assert router.check_health()["denoiser-0"] is False
        assert router.health()["roles"]["denoiser"][0]["status"] == "dead"
        # and with the last denoiser killed too: one clear error, no artifact
        killer = threading.Thread(target=_kill_when_running, args=(d1, seen))
        killer.start()
        with pytest.raises(FleetRequestFailed, match="stage denoiser could not complete .*completed stages: encoder"):
            router.run("r2", {"prompt": "p", "steps": 40}, PLANS, finish=writes.append)
        killer.join(30)
        assert writes == [art]
    finally:
        pools.shutdown()


@pytest.mark.slow
def test_ray_a_silent_replica_is_killed_at_the_stage_timeout_and_failed_over(ray_cluster):
    import dataclasses

    from optimized.fleet.ray_pool import RayRolePools
    spec = parse_deployment(spec_doc("ray"))
    spec = dataclasses.replace(spec, routing=dataclasses.replace(spec.routing, stage_timeout_s=3.0))
    pools = RayRolePools.start(spec, make_worker)
    try:
        d0 = pools.replicas["denoiser"][0]
        pid = d0.pid()
        router = Router(pools.replicas, spec.routing)
        t0 = time.monotonic()
        art, ledger = router.run("r1", {"prompt": "p", "steps": 40, "hang_first": True}, PLANS)
        assert time.monotonic() - t0 < 60
        assert art == expected() and ledger.completed["denoiser"].replica_id == "denoiser-1"
        assert "denoiser-0 died: no answer within 3 s (actor killed)" in ledger.failures[0]
        for _ in range(100):                      # the silent actor's process is gone: no late answer can come
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the timed-out actor's process {pid} is still alive")
    finally:
        pools.shutdown()
