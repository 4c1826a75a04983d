"""The WorkUnit scheduler's batch forming, driven by a fake clock (no timing is ever asserted on a real clock):
the cost model never keeps a batch that measured slower than its members run one by one, a step that compiled or
captured its body is not a measurement, batches prefer bucket compositions whose body is already compiled /
captured, and the cost model, the graph keys and the per-rank reservations know the parallel plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan, per_rank_share
from optimized.runtime.scheduler import CostModel, WorkUnitScheduler


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Job:
    name: str
    steps: int
    bucket: str = "s"


@dataclass
class JobState:
    job: Job
    done: int = 0


@dataclass
class TimedKernel(LoopKernel[JobState]):
    """Each `run_step` of a batch of b advances the fake clock by `seconds(b)`. With `graph` set, the step reports a
    compiled body per bucket composition: "miss" (and `compile_seconds` more) the first time, "hit" after."""
    clock: FakeClock
    seconds: callable
    graph: bool = False
    compile_seconds: float = 100.0
    plan_hash: str = "single"
    batches: list = field(default_factory=list)
    compiled: set = field(default_factory=set)
    loop_id = "toy.timed"

    def init_state(self, request: Job) -> JobState:
        return JobState(request)

    def plan_step(self, s: JobState) -> WorkPlan:
        return WorkPlan("", self.loop_id, "step", s.done, batch_key="k", shape_signature=s.job.bucket,
                        graph_bucket=s.job.bucket, parallel_plan_hash=self.plan_hash,
                        resources=ResourceRequest(cost_seconds=1.0))

    def run_step(self, states, plans):
        self.batches.append([s.job.name for s in states])
        self.clock.now += self.seconds(len(states))
        if self.graph:
            composition = tuple(sorted(s.job.bucket for s in states))
            miss = composition not in self.compiled
            self.compiled.add(composition)
            self.clock.now += self.compile_seconds if miss else 0.0
            for p in plans:
                p.info.update(graph="compiled", bucket=str(composition), graph_cache="miss" if miss else "hit")
        return [JobState(s.job, s.done + 1) for s in states]

    def is_done(self, s: JobState) -> bool:
        return s.done >= s.job.steps

    def finalize(self, s: JobState):
        return s.done


def _sizes(kernel: TimedKernel) -> list[int]:
    return [len(b) for b in kernel.batches]


def _run(kernel: TimedKernel, late: list[Job], first: Job, solo_ticks: int = 2, **kw) -> WorkUnitScheduler:
    """`first` runs alone for `solo_ticks` ticks (its solo time is measured), then `late` join it (solo_ticks=0: all
    arrive together, so none steps alone unless the scheduler sends it)."""
    sched = WorkUnitScheduler(clock=kernel.clock, **kw)
    sched.submit(kernel, first)
    for _ in range(solo_ticks):
        sched.tick()
    for job in late:
        sched.submit(kernel, job)
    sched.run_until_idle()
    return sched


# ---------------------------------------------------------------------------------------------------- cost model
def test_a_batch_measured_slower_than_one_by_one_is_never_formed_again():
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 * b + 0.5 * (b > 1))   # batching costs more than it saves
    sched = _run(kernel, [Job("b", 8), Job("c", 8)], Job("a", 10))
    sizes = _sizes(kernel)
    assert sizes[:2] == [1, 1]                    # a alone: its solo time is measured
    assert sizes[2] == 3                          # unknown: tried once
    assert sizes[3] == 2 and sizes[4] == 1        # 3 measured slower than 3 solos: the next size down, measured too
    assert set(sizes[5:]) == {1}, sizes           # 2 also slower: one by one from then on
    assert sched.cost.slower_than_solo([kernel.plan_step(JobState(Job("x", 1)))] * 2)


def test_a_batch_that_pays_off_stays_batched():
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 + 0.2 * b)
    sched = _run(kernel, [Job("b", 8), Job("c", 8)], Job("a", 10))
    assert set(_sizes(kernel)[2:10]) == {3}, _sizes(kernel)
    plans = [kernel.plan_step(JobState(Job(n, 1))) for n in "abc"]
    assert sched.cost.batch_ratio(plans) == pytest.approx(1.6 / 3.6)


def test_compile_time_is_not_a_step_measurement():
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 + 0.2 * b, graph=True, compile_seconds=100.0)
    sched = _run(kernel, [Job("b", 8), Job("c", 8)], Job("a", 10))
    assert set(_sizes(kernel)[2:10]) == {3}, _sizes(kernel)   # the 100 s compile of the batch never split it
    key = CostModel.key(kernel.plan_step(JobState(Job("a", 1))))
    assert sched.cost.solo[key] == pytest.approx(1.2) and sched.cost.measured[key] < 2


def test_requests_that_arrive_together_probe_one_member_alone_then_split_a_slow_batch():
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 * b + 0.5 * (b > 1))   # batching costs more than it saves
    sched = _run(kernel, [Job("b", 10), Job("c", 10)], Job("a", 10), solo_ticks=0)
    assert kernel.batches[0] == ["a", "b", "c"]                  # nothing measured: batched
    assert kernel.batches[1:3] == [["a"], ["b", "c"]]            # the probe: a alone, the others still together
    assert set(_sizes(kernel)[4:]) == {1}, _sizes(kernel)        # 3 and then 2 measured slower: one by one
    assert sched.cost.slower_than_solo([kernel.plan_step(JobState(Job("x", 1)))] * 3)


def test_requests_that_arrive_together_stay_batched_when_the_batch_pays_off():
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 + 0.2 * b)
    _run(kernel, [Job("b", 10), Job("c", 10)], Job("a", 10), solo_ticks=0)
    assert kernel.batches[1:3] == [["a"], ["b", "c"]]            # one probe step, no more
    assert set(_sizes(kernel)[3:10]) == {3}, _sizes(kernel)


def test_a_compiled_probe_step_is_probed_again_until_it_measures():
    """The probe's first solo step compiles its body (not a measurement): the member steps alone once more."""
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 * b + 0.5 * (b > 1), graph=True, compile_seconds=100.0)
    sched = _run(kernel, [Job("b", 10), Job("c", 10)], Job("a", 10), solo_ticks=0)
    sizes = _sizes(kernel)
    # tick 1 compiles the 3-batch (no measurement); tick 2 measures it; ticks 3 and 4 probe a alone (compile, then
    # measure) while b + c compile and then measure as a pair; from there the measured rule splits everything
    assert sizes[:7] == [3, 3, 1, 2, 1, 2, 1], sizes
    assert set(sizes[7:]) == {1}, sizes
    key = CostModel.key(kernel.plan_step(JobState(Job("a", 1))))
    assert sched.cost.solo[key] == pytest.approx(1.0)


def test_under_a_multi_rank_layout_batches_never_follow_the_clock():
    """Every rank runs its own scheduler and their steps meet in collectives: a batch split decided by one rank's
    clock would leave the ranks in different collectives. Under a plan, no probe and no split."""
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 * b + 0.5 * (b > 1), plan_hash="cfgp2@abc")
    _run(kernel, [Job("b", 10), Job("c", 10)], Job("a", 10), solo_ticks=0)
    assert set(_sizes(kernel)) == {3}, _sizes(kernel)


def test_cfg_parallel_names_its_layout_in_the_step_plan(wan_tiny):
    """A distributed CFG policy on a model without a plan still makes the step multi-rank (the rule above)."""
    from manifests.wan import WanGenerateRequest
    from optimized.models.wan.denoise import WanDenoiseLoop
    from optimized.models.wan.instance import WanModelInstance
    from optimized.parallel.cfg_parallel import CFGParallel

    cfg, weights = wan_tiny
    instance = WanModelInstance(cfg, weights, weights_version="t")
    s = cfg.vae.spatial_compression * cfg.dit.patch_size[1]
    req = WanGenerateRequest(text_ids=torch.tensor([5, 6, 7]), negative_text_ids=torch.tensor([8, 9]), num_frames=5,
                             height=2 * s, width=2 * s, num_steps=2, guidance_scale=5.0, seed=0)
    hashes = [WanDenoiseLoop(instance, policy).plan_step(WanDenoiseLoop(instance).init_state(req)).parallel_plan_hash
              for policy in (CFGParallel(SimpleNamespace(world_size=2, rank=0)), CFGParallel())]
    assert hashes == ["cfgp2", "single"]


def test_without_the_probe_requests_that_arrive_together_never_split():
    """Negative control: with the probe disabled the slow batch is never compared, so it runs batched to the end."""
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 * b + 0.5 * (b > 1))
    sched = WorkUnitScheduler(clock=clock)
    sched.cost.unmeasured_solo = lambda plans: None
    for job in (Job("a", 10), Job("b", 10), Job("c", 10)):
        sched.submit(kernel, job)
    sched.run_until_idle()
    assert set(_sizes(kernel)) == {3}


def test_fake_clock_negative_control_without_the_cost_model_rule():
    """The rule above is what splits the slow batch: a cost model that never finds a batch slower keeps size 3."""
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 * b + 0.5 * (b > 1))
    sched = WorkUnitScheduler(clock=clock)
    sched.cost.slower_than_solo = lambda plans: False
    sched.submit(kernel, Job("a", 10))
    sched.tick(), sched.tick()
    for job in (Job("b", 8), Job("c", 8)):
        sched.submit(kernel, job)
    sched.run_until_idle()
    assert set(_sizes(kernel)[2:10]) == {3}


def test_greedy_batching_ignores_the_clock():
    """Parity runs compare batched against solo results: with batching="greedy" the same slow-batch clock as above
    never splits the batch (its composition cannot depend on timing), while "measured" does."""
    slow = lambda b: 1.0 * b + 0.5 * (b > 1)
    kernel = TimedKernel(FakeClock(), seconds=slow)
    _run(kernel, [Job("b", 8), Job("c", 8)], Job("a", 10), batching="greedy")
    assert set(_sizes(kernel)[2:10]) == {3}, _sizes(kernel)
    kernel = TimedKernel(FakeClock(), seconds=slow)
    _run(kernel, [Job("b", 8), Job("c", 8)], Job("a", 10))
    assert 3 not in _sizes(kernel)[3:10], _sizes(kernel)
    with pytest.raises(ValueError, match="batching must be one of"):
        WorkUnitScheduler(batching="sometimes")


# ---------------------------------------------------------------------------------------------------- captured buckets
def _split_group(graph: bool) -> TimedKernel:
    """max_batch 2: e and a (buckets X, X) warm up the (X, X) body and e finishes; then c (Y) and d (X) arrive.
    Age order would run [a, c] (a cold composition) + [d]; the captured preference runs [a, d] (warm) + [c]."""
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 + 0.1 * b, graph=graph, compile_seconds=0.0)
    sched = WorkUnitScheduler(clock=clock, max_batch=2)
    sched.submit(kernel, Job("e", 1, bucket="X"))
    sched.submit(kernel, Job("a", 6, bucket="X"))
    sched.tick()
    sched.submit(kernel, Job("c", 4, bucket="Y"))
    sched.submit(kernel, Job("d", 4, bucket="X"))
    sched.tick()
    sched.run_until_idle()
    return kernel


def test_a_split_group_batches_members_whose_bucket_is_already_captured():
    kernel = _split_group(graph=True)
    assert kernel.batches[:3] == [["e", "a"], ["a", "d"], ["c"]], kernel.batches


def test_eager_steps_keep_age_order():
    kernel = _split_group(graph=False)
    assert kernel.batches[:3] == [["e", "a"], ["a", "c"], ["d"]], kernel.batches   # the control: age order


def test_a_group_that_fits_one_batch_is_never_split_for_a_captured_size():
    clock = FakeClock()
    kernel = TimedKernel(clock, seconds=lambda b: 1.0 + 0.1 * b, graph=True, compile_seconds=0.0)
    sched = WorkUnitScheduler(clock=clock)
    for name in "ab":
        sched.submit(kernel, Job(name, 6))
    sched.tick(), sched.tick()                 # a + b: the body of two "s" rows is compiled
    sched.submit(kernel, Job("c", 4))
    sched.tick()
    assert kernel.batches[-1] == ["a", "b", "c"]   # one cold batch of 3, not a warm 2 + a cold 1


# ---------------------------------------------------------------------------------------------------- parallel plan
def test_cost_model_keys_on_the_parallel_plan():
    single = TimedKernel(FakeClock(), seconds=lambda b: 1.0)
    sharded = TimedKernel(FakeClock(), seconds=lambda b: 1.0, plan_hash="cfgp2@abc")
    p1, p2 = single.plan_step(JobState(Job("a", 1))), sharded.plan_step(JobState(Job("a", 1)))
    cost = CostModel()
    cost.observe([p1], 4.0)
    assert cost.predict(p1) == 4.0 and cost.predict(p2) == p2.resources.cost_seconds   # not the other layout's
    assert CostModel.key(p1) != CostModel.key(p2)


def test_per_rank_share():
    assert per_rank_share(10, 2) == 5 and per_rank_share(9, 2) == 5 and per_rank_share(9, 1, 3) == 3
    assert per_rank_share(7) == 7


@pytest.fixture(scope="module")
def wan_tiny():
    from manifests.wan.model import load_model_variant
    from optimized.models.wan.instance import WanModelInstance

    cfg = load_model_variant("tiny-2.1-t2v")
    return cfg, WanModelInstance.random_weights(cfg, 0)


def _wan_plan(cfg, weights, plan_text: str | None):
    from manifests.wan import WanGenerateRequest
    from optimized.models.wan import FAMILY
    from optimized.models.wan.denoise import WanDenoiseLoop
    from optimized.models.wan.instance import WanModelInstance
    from optimized.parallel.plan import ParallelPlan

    instance = WanModelInstance(cfg, weights, weights_version="t")
    if plan_text is not None:
        plan = ParallelPlan.parse(plan_text)
        FAMILY.parallelize(instance, SimpleNamespace(plan=plan, world_size=plan.world_size))
    loop = WanDenoiseLoop(instance)
    s = cfg.vae.spatial_compression * cfg.dit.patch_size[1]
    req = WanGenerateRequest(text_ids=torch.tensor([5, 6, 7]), negative_text_ids=torch.tensor([8, 9]), num_frames=5,
                             height=2 * s, width=4 * s, num_steps=2, guidance_scale=5.0, seed=0)
    state = loop.init_state(req)
    return instance, loop.plan_step(state), loop.admission(state)


def test_wan_step_bytes_and_cost_are_per_rank_and_keyed_on_the_plan(wan_tiny):
    cfg, weights = wan_tiny
    _, single, held = _wan_plan(cfg, weights, None)
    _, cfgp, held_cfgp = _wan_plan(cfg, weights, "cfgp2")
    assert single.parallel_plan_hash == "single" and cfgp.parallel_plan_hash.startswith("cfgp2@")
    assert cfgp.resources.device_bytes * 2 == single.resources.device_bytes   # one CFG branch per rank
    assert cfgp.resources.cost_seconds < single.resources.cost_seconds
    assert held_cfgp == held                                                    # latents and texts: whole per rank
    assert CostModel.key(single) != CostModel.key(cfgp)


def test_wan_graph_keys_name_the_parallel_plan(wan_tiny):
    from optimized.runtime.compile import GraphKey

    cfg, weights = wan_tiny
    instance, plan, _ = _wan_plan(cfg, weights, "cfgp2")
    x = torch.randn(1, cfg.dit.in_channels, 2, 4, 8)
    instance.dit.forward_batch(x, torch.tensor([500]), torch.randn(1, cfg.max_sequence_length, cfg.dit.text_dim))
    (key,) = instance.dit.graph_cache.keys()
    assert key.parallel_plan_hash == plan.parallel_plan_hash != "single"
    other = GraphKey(**{**key.__dict__, "parallel_plan_hash": "ulysses2@x"})
    with pytest.raises(ValueError, match="one cache never|compile cache of plan"):
        instance.dit.graph_cache.step(other, lambda *a: a, ())
