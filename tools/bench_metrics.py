"""Benchmark: what observability costs the engine, in one process, on one engine.

  - end to end: the same batch of video programs (submitted together, batched by the scheduler) with no observer,
    with the metrics observer (Prometheus), and with metrics + OpenTelemetry spans (request, program, stage, step;
    spans go to a processor that drops them, so the cost is making them, not exporting). Rounds alternate between
    the modes; each mode's median seconds are divided by the no-observer median (1.00 = free).
  - per event: microseconds the observer spends on one recorded event (replayed), and the bus's own stamping of
    an event with the seed's fields (always on), against the mean step time of the run.
Prints ratios. Not a test: speed is never asserted. Tiny variants are the worst case (steps of a few ms); a real
model's steps are 100x longer and the same per-event cost is 100x smaller in proportion.

    python tools/bench_metrics.py
    python tools/bench_metrics.py --variant tiny-2.1-t2v --programs 4 --steps 8 --rounds 7
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from tabulate import tabulate

from manifests.wan import WanGenerateRequest
from optimized import Engine
from optimized.runtime.events import Event, ProgramContext, new_trace_id
from optimized.serving.observability import Observer

MODES = ("off", "metrics", "metrics+spans")


def _span_sink():
    """A TracerProvider whose spans are made (recorded, ended) and then dropped."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Drop()))
    return provider


def run_programs(engine: Engine, n: int, steps: int, size: int, observer: Observer | None, tag: str) -> float:
    """n video programs submitted together, run to the end; seconds."""
    t0 = time.perf_counter()
    progs = []
    for i in range(n):
        pid = f"{tag}-{i}"
        engine.bus.open_program(pid)        # what AsyncEngine.submit does (the observer's hook opens the trace)
        req = WanGenerateRequest(text_ids=torch.arange(1, 6), num_frames=5, height=size, width=size,
                                 num_steps=steps, guidance_scale=1.0, seed=i)
        prog = engine.start_video(req, request_id=pid)
        if observer is not None:
            prog.subscribe(observer.on_program_event)   # what AsyncEngine.subscribe delivers in the server
        progs.append(prog)
    engine.run_until_idle()
    seconds = time.perf_counter() - t0
    bad = [p.id for p in progs if p.status != "completed"]
    if bad:
        raise SystemExit(f"programs {bad} did not complete")
    return seconds


def make_observer(engine: Engine, mode: str) -> Observer | None:
    if mode == "off":
        return None
    if mode == "metrics":
        obs = Observer(engine)
        obs.tracing = None                  # metrics only (no OpenTelemetry, whatever the global provider is)
        return obs
    return Observer(engine, tracer_provider=_span_sink())


def per_event_cost(engine: Engine, args: argparse.Namespace) -> dict:
    """Microseconds per event: the observer's handlers on replayed events, the bus's stamping."""
    recorded: list[Event] = []
    undo = engine.subscribe(recorded.append)
    obs = Observer(engine, tracer_provider=_span_sink())
    run_programs(engine, args.programs, args.steps, args.size, obs, "record")
    undo()
    obs.close()
    out = {}
    for mode in ("metrics", "metrics+spans"):
        obs = make_observer(engine, mode)
        obs.close()                         # not subscribed: only the replay below reaches it
        if obs.tracing is not None:         # the request spans the replayed stage and step spans hang under
            for pid in {ev.request_id.split("/")[0] for ev in recorded if ev.request_id and "/" in ev.request_id}:
                obs.tracing.open(ProgramContext(pid, new_trace_id()))
        reps = max(1, 20000 // max(1, len(recorded)))
        t0 = time.perf_counter()
        for _ in range(reps):
            for ev in recorded:
                obs.on_event(ev)
        out[mode] = (time.perf_counter() - t0) / (reps * len(recorded)) * 1e6
        if obs.tracing is not None:
            obs.tracing.close()
    bus = engine.bus
    n = 20000
    t0 = time.perf_counter()
    for i in range(n):   # a fresh event each time (stamping happens once per event), no subscriber work
        ev = Event("trace.step", None, 0, {"loop": "x"})
        bus._stamp(ev)
    stamp_engine = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for i in range(n):
        Event("trace.step", None, 0, {"loop": "x"})
    make = (time.perf_counter() - t0) / n * 1e6
    out["bus stamp"] = max(0.0, stamp_engine - make)
    out["events per run"] = len(recorded)
    out["steps per run"] = sum(1 for ev in recorded if ev.kind == "trace.step" and
                               ev.data.get("batch", [ev.request_id])[0] == ev.request_id)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="tiny-2.1-t2v")
    ap.add_argument("--programs", type=int, default=4, help="video programs per round (submitted together)")
    ap.add_argument("--steps", type=int, default=8, help="denoise steps per program")
    ap.add_argument("--size", type=int, default=32, help="height = width in pixels")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per mode (alternating)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    engine = Engine.from_variant(args.variant, seed=0, device=args.device, batching="greedy")
    run_programs(engine, args.programs, args.steps, args.size, None, "warmup")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:   # alternate the order: drift hits every mode alike
            obs = make_observer(engine, mode)
            times[mode].append(run_programs(engine, args.programs, args.steps, args.size, obs, f"{mode}-{r}"))
            if obs is not None:
                obs.close()
    base, fastest = statistics.median(times["off"]), min(times["off"])
    rows = [[m, f"{statistics.median(times[m]) * 1e3:.1f}", f"{min(times[m]) * 1e3:.1f}",
             f"{statistics.median(times[m]) / base:.3f}", f"{min(times[m]) / fastest:.3f}"] for m in MODES]
    print(f"{args.variant} on {args.device} ({platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}): {args.programs} programs x {args.steps} steps at {args.size}x{args.size}, "
          f"{args.rounds} rounds per mode")
    print(tabulate(rows, headers=["mode", "median ms", "min ms", "median / off", "min / off"]))
    print("(on a shared, loaded machine the spread between rounds exceeds the observer's cost: read the per-event "
          "figures below)")
    cost = per_event_cost(engine, args)
    step_ms = fastest / max(1, cost["steps per run"]) * 1e3
    per_step = {m: cost[m] * cost["events per run"] / max(1, cost["steps per run"]) for m in MODES[1:]}
    print()
    print(tabulate([["observer: metrics", f"{cost['metrics']:.1f}"],
                    ["observer: metrics + spans", f"{cost['metrics+spans']:.1f}"],
                    ["bus: stamping the seed's fields (always on)", f"{cost['bus stamp']:.2f}"]],
                   headers=["per event", "µs"]))
    print(f"\n{cost['events per run']} events and {cost['steps per run']} scheduled steps per run; a step takes "
          f"{step_ms:.2f} ms here (fastest round). Observer cost per scheduled step: "
          + ", ".join(f"{m} {us:.0f} µs = {us / (step_ms * 1e3) * 100:.2f}% of a step" for m, us in per_step.items()))


if __name__ == "__main__":
    main()
