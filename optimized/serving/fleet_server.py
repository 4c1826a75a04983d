"""`fvgen serve --fleet deployment.yaml`: the same HTTP /v1/videos API as `fvgen serve`, served by a fleet of role
pools (encoder, denoiser, decoder; N replicas each, Ray actors or in-process) behind the fleet router.

    python -m optimized.serving.fleet_server --fleet examples/fleet/deployment.yaml --port 8000

The gateway (this process) parses and validates requests exactly as the co-located server does (`server.create_app`
with its request building, admission, video index, artifacts, SSE): it holds a copy of the model for that (the
processors, the admission bounds, the media chain's fps, the card) and never runs it. Each request is a
`FleetProgram` (the VideoProgram's events and result, run by the router): encoder -> denoiser -> decoder on the
replicas the router picks, failover from the last completed stage when a replica dies; the gateway assembles the
`VideoResult` and the AsyncHandle writes its artifacts once, as for a co-located request.

Stages: each replica runs fleetcore's role body (`optimized.fleet.roles.RoleEngine`, the split of
`optimized/fleet/stages.py`) on its own resident Engine and scheduler: encoder = admission + the media chain's
image encode and conditioning, denoiser = the family's denoise loop (text encoding included, through the text
encoder's content-hash CacheStore on that replica), decoder = the chunked VAE decode (+ the sound decoder). State
crosses as TransferManifest + tensors (`transfer.pack` / `unpack`: every tensor checked against its entry, a cast or
a dropped chunk in transit is a TransferError naming the field). Same kernels, same inputs, same order: the fleet's
video is bitwise the co-located engine's on CPU fp32 (tests/test_fleet_router_serve.py, test_fleet_router_families.py
in-process, test_fleet_ray_serve.py on Ray). Affinity: a replica reports its cached stage outputs' keys and the
input hashes of its CacheStores' entries; a request's prompt (`text_ids:<sha256>`) goes to the denoiser already
holding its embedding, unless that one is far behind (cost).
Cancellation lands at the next stage boundary (inside a stage the replica's scheduler owns the step boundaries).
Progress: each replica counts its running stage's steps (its loop's trace.step events); the health probes read the
count and the gateway announces each step once as a `progress` event (as fine-grained as health_interval_s), plus
one when the stage completes. Decode chunks are not streamed (`on_output` is refused).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from optimized.fleet.deployment import ROLES, DeploymentError, DeploymentSpec, ModelSource, load_deployment
from optimized.fleet.transfer import pack, unpack
from optimized.fleet.router import (FleetRequestFailed, RequestCancelled, Router, StageCall, StageCostModel,
                                    StageError, StageOutput, StagePlan)

STAGE_OF_ROLE = {"encoder": "encode", "denoiser": "denoise", "decoder": "decode"}   # VideoProgram's stage names


# ================================================================================ the replica side (one per actor)
def load_model(model: ModelSource) -> Any:
    """The Engine the gateway holds for `model` (to build and admit requests; it never runs a stage)."""
    from optimized.serving.loading import load_engine
    return load_engine(model.family, model.path, model.variant, model.device, model.dtype, "none",
                       model.seed_weights)


CACHE_ENTRIES = {"encoder": 64, "denoiser": 16, "decoder": 0}   # stage outputs a replica keeps by input content key


class RoleEngineWorker:
    """fleetcore's role body (`optimized.fleet.roles.RoleEngine`: the role's stage on its own resident Engine and
    scheduler, TransferManifest + tensors in and out, checked against the manifest) as one replica's worker, in
    the replica's process; it counts its running stage's steps for the health probes."""

    def __init__(self, role: str, model: ModelSource, replica_id: str | None = None):
        from optimized.fleet.roles import RoleEngine, RoleSpec
        family, variant = model.family, model.variant
        if variant is not None and ":" in variant:
            family, variant = variant.split(":", 1)
        index = int(replica_id.rsplit("-", 1)[1]) if replica_id else 0
        self.body = RoleEngine(RoleSpec(role, family, variant=variant, model_dir=model.path, seed=model.seed_weights,
                                        device=model.device, dtype=model.dtype, replica=index,
                                        cache_entries=CACHE_ENTRIES[role]))
        self.stores = cache_stores(self.body.engine.model)  # the model's own caches (e.g. text embeddings)
        self.steps_done = 0                                 # steps of the running stage (read by health probes)
        self.body.engine.subscribe(self._on_step, prefix="trace.step")

    def _on_step(self, ev: Any) -> None:
        self.steps_done = int(ev.data.get("step", 0)) + 1

    def resident(self) -> tuple[str, ...]:
        """Affinity keys of what this replica holds: its cached stage outputs (input content keys), and "NAME:HASH"
        for every input hash of every entry in the model's CacheStores (a text embedding: "text_ids:<sha256>")."""
        held = dict.fromkeys(self.body.resident())
        for store in self.stores:
            for key in store.keys():
                held.update(dict.fromkeys(f"{name}:{h}" for name, h in key.input_hashes))
        return tuple(held)

    def run_stage(self, call: StageCall) -> StageOutput:
        import dataclasses

        from optimized.fleet.roles import input_key
        manifest, tensors = call.payload
        if self.body.spec.cache_entries > 0:
            # this stage's input key, from what arrived (a producer stamps its own input's key on its output, as
            # provenance; RoleEngine reads the field as the key of the input it serves): a resident entry serves the
            # call only if it was made for exactly these tensors
            manifest = dataclasses.replace(manifest, cache_key=input_key(manifest, tensors,
                                                                          self.body.weights_version))
        hit = call.cache_key is not None and call.cache_key in self.resident()
        self.steps_done = 0
        out_manifest, out_tensors, served = self.body.run_stage(manifest, tensors)
        return StageOutput((out_manifest, out_tensors), 0.0, cache_hit=hit or served, bytes_moved=out_manifest.nbytes)


def cache_stores(obj: Any, seen: set | None = None, depth: int = 0) -> list[Any]:
    """Every CacheStore an instance holds (attributes, dicts, lists of the runtime's objects), each once."""
    from optimized.runtime.cache import CacheStore
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 5:
        return []
    seen.add(id(obj))
    if isinstance(obj, CacheStore):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in cache_stores(v, seen, depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in cache_stores(v, seen, depth + 1)]
    if hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.startswith("optimized"):
        return [s for v in vars(obj).values() for s in cache_stores(v, seen, depth + 1)]
    return []


def make_stage_worker(model: ModelSource, role: str, replica_id: str | None = None) -> RoleEngineWorker:
    return RoleEngineWorker(role, model, replica_id)


# ==================================================================================== the gateway side
def text_key(request: Any) -> str | None:
    """The denoiser's affinity key: the content hash of the request's prompt token ids (what a text-embedding
    CacheKey carries as its `text_ids` input hash), None for a request without them."""
    ids = getattr(request, "text_ids", None)
    if ids is None:
        return None
    import torch

    from optimized.runtime.cache import content_hash
    return f"text_ids:{content_hash(torch.as_tensor(ids).reshape(-1).to(torch.int64).cpu())}"


def stage_plans(request: Any, first: tuple, weights_version: Any) -> list[StagePlan]:
    """The request's three stages, priced in the cost model's units (UNITS in optimized/fleet/card.py). Affinity
    keys: the encoder's is its input's content key (what its resident stage outputs are kept by), the denoiser's the
    prompt's (its text embedding is made and cached by the denoise loop's text encoder on the replica that ran
    it)."""
    from optimized.fleet.roles import input_key
    steps = getattr(request, "num_steps", None) or 1
    dims = [getattr(request, n, None) for n in ("latent_frames", "latent_height", "latent_width")]
    tokens = 1
    for d in dims:
        tokens *= d or 1
    return [StagePlan("encoder", 1.0, input_key(*first, weights_version)),
            StagePlan("denoiser", float(steps * tokens), text_key(request)), StagePlan("decoder", float(tokens))]


class FleetProgram:
    """A video request served by the fleet: VideoProgram's interface (status, stage, request, image, value,
    subscribe, start, cancel, fail; request.* / progress events), run by the router on its own thread."""

    def __init__(self, gateway: FleetGateway, request: Any, *, program_id: str, image: Any = None):
        self.gateway, self.engine, self.request, self.image = gateway, gateway.front, request, image
        self.id = program_id
        self.status, self.stage, self.error = "waiting", None, None
        self.value: Any = None
        self.ledger: Any = None
        self.events: list = []
        self._listeners: list[Callable[[Any], Any]] = []
        self._cancel = False
        self._steps_seen: dict[str, int] = {}               # stage -> the last step a progress event announced
        self.done = threading.Event()

    def subscribe(self, fn: Callable[[Any], Any], replay: bool = True) -> Callable[[], None]:
        for ev in list(self.events) if replay else ():
            try:
                fn(ev)
            except Exception:  # noqa: BLE001 - a listener's failure is its own
                pass
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def _emit(self, kind: str, **data: Any) -> None:
        from optimized.programs import VideoEvent
        ev = VideoEvent(kind, self.id, data)
        self.events.append(ev)
        for fn in list(self._listeners):
            try:
                fn(ev)
            except Exception:  # noqa: BLE001 - a listener's failure is its own
                pass

    def stage_names(self) -> list[str]:
        return [STAGE_OF_ROLE[r] for r in ROLES]

    def start(self) -> FleetProgram:
        from optimized.programs import VIDEO_PHASES
        self.engine.admit(self.request, VIDEO_PHASES)   # the co-located engine's admission, before any stage
        self.gateway.programs[self.id] = self
        self._emit("request.accepted", stages=self.stage_names())
        threading.Thread(target=self._run, name=f"fleet-{self.id}", daemon=True).start()
        return self

    def on_router_event(self, kind: str, data: dict) -> None:
        stage = STAGE_OF_ROLE[data["role"]]
        if kind == "stage.started":
            self.status, self.stage = "running", stage
            self._emit("request.stage", stage=stage, replica=data["replica"], attempt=data["attempt"])
        elif kind == "stage.completed":
            self._steps_seen[stage] = 1 << 62               # a probe read before this point is stale now
            done = self._total(stage) or 1
            self._emit("progress", stage=stage, step=done, total=done, replica=data["replica"])
        elif kind == "stage.failover":
            self._emit("request.failover", stage=stage, replica=data["replica"], error=data["error"])

    def _total(self, stage: str) -> int | None:
        return getattr(self.request, "num_steps", None) if stage == "denoise" else None

    def on_probe(self, stage: str, step: int, replica: str) -> None:
        """A health probe saw `step` steps of this request's running `stage` done on `replica`: one progress
        event per step not announced yet (as coarse as the probe interval)."""
        seen = self._steps_seen.get(stage, 0)
        total = self._total(stage)
        if self.status != "running" or self.stage != stage:
            return
        for s in range(seen + 1, step + 1 if total is None else min(step, total - 1) + 1):
            self._emit("progress", stage=stage, step=s, total=total, replica=replica)
        self._steps_seen[stage] = max(seen, step)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            first = pack({"request": self.request, "image": self.image}, request_id=self.id, stage="request",
                         producer="gateway", consumer="encoder", prefix="request")
            plans = stage_plans(self.request, first, getattr(self.engine.model, "weights_version", None))
            self.gateway.router.run(self.id, first, plans, finish=self._result,
                                    cancelled=lambda: self._cancel)   # the artifact: self.value (committed once)
        except RequestCancelled:
            return self._end("cancelled")
        except (FleetRequestFailed, StageError) as e:
            return self._end("failed", str(e))
        except Exception as e:  # noqa: BLE001 - a gateway bug fails this request only
            return self._end("failed", f"{type(e).__name__}: {e}")
        self.value.timings["total"] = time.perf_counter() - t0
        self._end("completed")

    def _result(self, decoded: tuple) -> Any:
        """The VideoResult a co-located VideoProgram makes, from the stages' manifests (each checked as it is
        unpacked); the router commits it once."""
        from optimized.programs import VideoResult
        ledger = self.gateway.router.ledgers[self.id]
        self.ledger = ledger
        media = self.gateway.media
        conditioned = unpack(*ledger.outputs["encoder"])["request"]
        den, dec = unpack(*ledger.outputs["denoiser"]), unpack(*decoded)
        timings = {STAGE_OF_ROLE[r]: rec.seconds for r, rec in ledger.completed.items()}
        self.value = VideoResult(
            frames=dec["frames"], audio=dec["audio"], latents=den["latents"], timings=timings, request_id=self.id,
            seed=den["seed"], weights_version=getattr(self.engine.model, "weights_version", None),
            fps=den["fps"], sample_rate=media.sample_rate, media_weights_version=media.weights_version,
            request=conditioned)
        return self.value

    def _end(self, status: str, error: str | None = None) -> None:
        if self.status in ("completed", "failed", "cancelled"):
            return
        self.status, self.error = status, error
        self.gateway.programs.pop(self.id, None)
        fleet = self.ledger.summary() if self.ledger is not None else None
        self._emit(f"request.{status}", **({"error": error} if error else {}),
                   **({"timings": self.value.timings, "fleet": fleet} if status == "completed" else {}))
        self.done.set()

    def cancel(self) -> None:
        self._cancel = True

    def fail(self, error: str) -> None:
        self._cancel = True
        self._end("failed", error)


class FleetGateway:
    """The router over the started role pools, the front Engine used to build and admit requests, health probes."""

    def __init__(self, spec: DeploymentSpec, front: Any, pools: dict[str, list[Any]], ray_pools: Any = None):
        from optimized.serving.families import media_chain
        self.spec, self.front, self.ray_pools = spec, front, ray_pools
        self.media = media_chain(front)
        self.programs: dict[str, FleetProgram] = {}
        self.router = Router(pools, spec.routing, StageCostModel(),
                             max_inflight={p.role: p.max_inflight for p in spec.roles}, on_event=self._on_router)
        self._stop = threading.Event()
        self._health = threading.Thread(target=self._probe, name="fleet-health", daemon=True)
        self._health.start()

    @classmethod
    def start(cls, spec: DeploymentSpec, front: Any | None = None,
              worker_factory: Callable[[str], Any] | None = None) -> FleetGateway:
        wired = {"ray": "ray_object_store", "local": "inprocess"}[spec.placement.backend]
        if spec.transport != wired:   # shared_memory / torch_dist move fleetcore's TransferManifests, not wired here
            raise DeploymentError("transport", f"{spec.transport!r} is not wired to placement.backend "
                                  f"{spec.placement.backend} by the fleet server yet; use {wired}")
        front = load_model(spec.model) if front is None else front
        factory = worker_factory or partial(make_stage_worker, spec.model)
        if spec.placement.backend == "ray":
            from optimized.fleet.ray_pool import RayRolePools
            ray_pools = RayRolePools.start(spec, factory)
            return cls(spec, front, ray_pools.replicas, ray_pools)
        from optimized.fleet.ray_pool import local_pools
        return cls(spec, front, local_pools(spec, factory))

    def _on_router(self, kind: str, request_id: str, data: dict) -> None:
        prog = self.programs.get(request_id)
        if prog is not None:
            prog.on_router_event(kind, data)

    def _probe(self) -> None:
        while not self._stop.wait(self.spec.routing.health_interval_s):
            try:
                self.router.check_health()
                self._announce_steps()
            except Exception:  # noqa: BLE001 - a probe bug must not stop the probes
                pass

    def _announce_steps(self) -> None:
        for role, pool in self.router.states.items():
            for rid, st in pool.items():
                request, _, rest = st.running.rpartition("/")
                prog = self.programs.get(request)
                if prog is not None and st.step and rest.startswith(f"{role}#"):
                    prog.on_probe(STAGE_OF_ROLE[role], st.step, rid)

    def card(self) -> dict:
        from optimized.fleet.card import fleet_card
        card = dict(type(self.front).deployment_card(self.front))   # the engine's own card (the instance's is this)
        card["extra"] = {**card.get("extra", {}), "fleet": fleet_card(self.spec, self.router, card).to_dict()}
        return card

    def close(self) -> None:
        self._stop.set()
        if self.ray_pools is not None:
            self.ray_pools.shutdown()


# ================================================================================ AsyncEngine over the fleet
def fleet_async_engine(gateway: FleetGateway, max_queue: int) -> Any:
    """An AsyncEngine whose video requests are FleetPrograms (its handles, events, artifact writing, retention
    and the server around it unchanged); the front engine's own scheduler never runs a stage."""
    from optimized.serving.async_engine import AsyncEngine, AsyncHandle, EngineClosed, QueueFull

    class FleetAsyncEngine(AsyncEngine):
        async def submit(self, request: Any = None, *, out: Any = None, image: Any = None,
                         request_id: str | None = None, on_output: Any = None, **fields: Any) -> Any:
            from optimized.programs import VideoEvent, check_out_path
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._expire()
            if len(self.active) >= self.max_queue:
                raise QueueFull(f"{len(self.active)} requests in flight (max_queue {self.max_queue}); retry later")
            if on_output is not None:
                raise ValueError("on_output: streamed decode chunks are not served by a fleet (the decoder role "
                                 "returns the whole video)")
            if out is not None:
                check_out_path(out)
            rid = self._request_id(request_id)
            req, img = request, image
            if req is None:
                from optimized.serving.requests import build_request
                req, img = build_request(self.engine, image=image, **fields)
            self._preflight(req)
            prog = FleetProgram(gateway, req, program_id=rid, image=img)
            handle = AsyncHandle(self, rid, out, prog)
            prog.subscribe(lambda ev: self.loop.call_soon_threadsafe(handle._deliver, ev))
            self.active.add(rid)
            self.handles[rid] = handle

            def start() -> None:
                if handle.cancel_requested:
                    self.loop.call_soon_threadsafe(handle._publish, VideoEvent("request.cancelled", rid, {}))
                    return
                try:
                    prog.start()
                except Exception as e:  # noqa: BLE001 - refused: this request ends, nothing else
                    error = f"rejected: {e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                    self.loop.call_soon_threadsafe(handle._publish, VideoEvent("request.failed", rid,
                                                                               {"error": error}))

            self._post(start)
            return handle

        def deployment_card(self) -> dict:
            return gateway.card()

    return FleetAsyncEngine(gateway.front, max_queue=max_queue)


def create_fleet_app(gateway: FleetGateway, *, output_dir: str | Path, max_queue: int | None = None,
                     api_key: str | None = None, **kw: Any) -> Any:
    """`server.create_app` serving the fleet: the same routes, index and artifacts; the card carries the fleet
    section (`extra.fleet`); /health adds the fleet's (`fleet`). The gateway is closed with the app."""
    from optimized.serving import server
    front = gateway.front
    front.__dict__["deployment_card"] = gateway.card   # the card every route serves (GET /v1/models, /health)
    queue = max_queue or gateway.spec.slo.max_queue
    app = server.create_app(front, output_dir=output_dir, max_queue=queue, api_key=api_key, **kw)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any):
        # the seam (REQUEST_ray.md): create_app builds `AsyncEngine(engine, max_queue=...)` as its lifespan starts;
        # until that has run, the name resolves to the fleet's (restored before the first request is served)
        real = server.AsyncEngine
        server.AsyncEngine = lambda engine, max_queue: fleet_async_engine(gateway, max_queue)
        try:
            async with inner(a) as state:
                server.AsyncEngine = real
                yield state
        finally:
            server.AsyncEngine = real
            await asyncio.to_thread(gateway.close)

    app.router.lifespan_context = lifespan

    @app.get("/v1/fleet")
    async def fleet_status():
        return {"object": "fleet", **gateway.router.health(), "cost_model": gateway.router.cost.to_dict()}

    app.state.fleet = gateway
    return app


# ====================================================================================================== CLI
def build_parser(prog: str = "fvgen serve --fleet") -> argparse.ArgumentParser:
    from optimized.serving.observability import add_log_args
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", required=True, metavar="deployment.yaml", help="the deployment (role pools, replicas, "
                   "transport, placement): optimized/fleet/deployment.py")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--output-dir", default="fv_videos")
    p.add_argument("--max-queue", type=int, default=None, help="requests in flight (default: the spec's slo.max_queue)")
    p.add_argument("--api-key", default=None)
    add_log_args(p)
    return p


def main(argv: list[str] | None = None, prog: str = "fvgen serve --fleet") -> int:
    from optimized.fleet.ray_pool import RayUnavailable
    from optimized.serving import server
    from optimized.serving.loading import UsageError
    from optimized.serving.observability import configure_logging
    args = build_parser(prog).parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get(server.API_KEY_ENV) or None
    try:
        spec = load_deployment(args.fleet)
        if args.max_queue is not None and args.max_queue < 1:
            raise UsageError(f"--max-queue must be >= 1, got {args.max_queue}")
        if not 0 <= args.port <= 65535:
            raise UsageError(f"--port {args.port} is out of range (0..65535)")
        server.check_output_dir(args.output_dir)
        server.check_port_free(args.host, args.port)
    except (DeploymentError, UsageError, server.SetupError) as e:
        print(f"error: --fleet {args.fleet}: {e}" if isinstance(e, DeploymentError) else f"error: {e}",
              file=sys.stderr)
        return 2
    warning = server.exposure_warning(args.host, api_key)
    if warning:
        print(warning, file=sys.stderr)
    try:
        gateway = FleetGateway.start(spec)
    except (UsageError, ValueError, RayUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn
    try:
        app = create_fleet_app(gateway, output_dir=args.output_dir, max_queue=args.max_queue, api_key=api_key)
    except Exception as e:  # noqa: BLE001 - the index cannot open: nothing served, the fleet stopped
        gateway.close()
        print(f"error: --output-dir {args.output_dir}: cannot open the video index ({e})", file=sys.stderr)
        return 2
    roles = ", ".join(f"{p.replicas} {p.role}{'s' if p.replicas > 1 else ''}" for p in spec.roles)

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                port = server._bound_port(self, args.port)
                print(server.startup_line(app.state.model_name, args.host, port) + f" [fleet {spec.name}: {roles}, "
                      f"{spec.placement.backend}]", file=sys.stderr, flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            loop = getattr(app.state, "loop", None)
            if loop is not None:
                loop.call_soon_threadsafe(app.state.begin_shutdown)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30,
                            **configure_logging(args.log_format))
    Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
