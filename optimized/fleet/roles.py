"""Role workers and a local fleet: the engine as encoder / denoiser / decoder roles, each a resident Engine with its
own scheduler, state crossing between them as TransferManifests over a transport.

    spec = RoleSpec("denoiser", family="wan", variant="tiny-2.1-t2v")
    worker = RoleWorker(spec, transport="shared_memory").start()     # its own process (multiprocessing spawn)
    manifest, tensors = worker.run_stage(manifest, tensors)          # the role's stage on that input
    worker.close()

    with LocalFleet("wan", "tiny-2.1-t2v", denoisers=2, processes=True) as fleet:
        result = fleet.generate(request)                             # FleetResult: frames, audio, latents, bytes

A `RoleWorker` is one replica: `processes=False` runs the same `RoleEngine` body in this process (the default test
suite); otherwise a spawned child loads its own engine (same variant + seed: the same weights) and serves stage
calls from a pipe; tensors move through the transport (shared memory), only handles through the pipe. The input of
every stage is checked against its manifest (`TransferError` naming the field) before the stage runs, the output
packed into a new manifest (producer = the replica id, consumer = the next role).

Cache: a replica with `cache_entries > 0` keeps its stage outputs by the input's content key (`content_key` over the
input tensors, the value's structure and the weights version: what the manifest's `cache_key` says). A call whose
key is resident is served from the entry after `check_cache_entry` (the entry must have been produced for that key:
a stale entry routed to the wrong replica is a TransferError on `cache_key`). The fleet routes a denoiser call to
the replica holding its key (affinity), else to the least used one.

Nothing here names a family: the stages are `stages.STAGE_OF_ROLE`, split where the program splits.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from optimized.fleet.stages import NEXT_ROLE, ROLES, STAGE_OF_ROLE
from optimized.fleet.transfer import (
    DEFAULT_CHUNK_BYTES,
    TransferError,
    TransferManifest,
    content_key,
    pack,
    unpack,
)
from optimized.fleet.transports import InProcessTransport, SharedMemoryTransport

STAGE_NAME = {"gateway": "request", "encoder": "encode", "denoiser": "denoise", "decoder": "decode"}


class RoleFailed(RuntimeError):
    """A role's stage raised (not a transfer fault); the message is the worker's."""


@dataclass(frozen=True)
class RoleSpec:
    role: str                          # encoder | denoiser | decoder
    family: str
    variant: str | None = None         # random weights of a named variant (seeded) ...
    model_dir: str | None = None       # ... or a converted checkpoint
    seed: int = 0
    device: str = "cpu"
    dtype: str = "fp32"
    replica: int = 0
    cache_entries: int = 0             # resident stage outputs kept by input content key (0: none)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {self.role!r}")
        if (self.variant is None) == (self.model_dir is None):
            raise ValueError("give exactly one of variant or model_dir")

    @property
    def replica_id(self) -> str:
        return f"{self.role}-{self.replica}"


def load_role_engine(spec: RoleSpec) -> Any:
    from optimized.serving.loading import load_engine
    return load_engine(spec.family, spec.model_dir, spec.variant, spec.device, spec.dtype, "none", spec.seed)


def input_key(manifest: TransferManifest, tensors: dict[str, torch.Tensor], weights_version: Any) -> str:
    """The content key of a stage input: its tensors, the value around them, the weights that will consume it."""
    return content_key(tensors, manifest.stage, repr(manifest.structure), weights_version)


class RoleEngine:
    """The body of one replica: its engine, its stage, its resident cache (in whichever process holds it)."""

    def __init__(self, spec: RoleSpec, engine: Any = None):
        self.spec = spec
        self.engine = engine if engine is not None else load_role_engine(spec)
        self.stage = STAGE_OF_ROLE[spec.role]
        self.cache: OrderedDict[str, tuple[TransferManifest, dict[str, torch.Tensor]]] = OrderedDict()
        self.calls = 0

    @property
    def weights_version(self) -> Any:
        return getattr(self.engine.model, "weights_version", None)

    def resident(self) -> tuple[str, ...]:
        return tuple(self.cache)

    def plant(self, key: str, entry: tuple[TransferManifest, dict[str, torch.Tensor]]) -> None:
        """Put `entry` under `key` (negative controls: a stale entry)."""
        self.cache[key] = entry

    def run_stage(self, manifest: TransferManifest,
                  tensors: dict[str, torch.Tensor]) -> tuple[TransferManifest, dict[str, torch.Tensor], bool]:
        if manifest.consumer != self.spec.role:
            raise TransferError("consumer", f"manifest is for {manifest.consumer}, this replica is "
                                            f"{self.spec.replica_id}")
        value = unpack(manifest, tensors)              # checks every entry against the manifest
        self.calls += 1
        key = None
        if self.spec.cache_entries > 0:
            key = input_key(manifest, tensors, self.weights_version)
            if manifest.cache_key is not None and manifest.cache_key != key:
                raise TransferError("cache_key", f"manifest says {manifest.cache_key}, its tensors hash to {key}")
            if key in self.cache:
                resident_manifest, resident_tensors = self.cache[key]
                manifest.check_cache_entry(resident_manifest)
                self.cache.move_to_end(key)
                return resident_manifest, {n: t.clone() for n, t in resident_tensors.items()}, True
        out = self.stage(self.engine, value, manifest.request_id)
        out_manifest, out_tensors = pack(out, request_id=manifest.request_id, stage=STAGE_NAME[self.spec.role],
                                         producer=self.spec.replica_id, consumer=NEXT_ROLE[self.spec.role],
                                         lifetime="cached" if key else "consume_once", cache_key=key,
                                         chunk_bytes=self.spec.chunk_bytes, prefix=STAGE_NAME[self.spec.role])
        if key is not None:
            self.cache[key] = (out_manifest, {n: t.clone() for n, t in out_tensors.items()})
            while len(self.cache) > self.spec.cache_entries:
                self.cache.popitem(last=False)
        return out_manifest, out_tensors, False


def make_transport(kind: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Any:
    if kind == "inprocess":
        return InProcessTransport(chunk_bytes)
    if kind == "shared_memory":
        return SharedMemoryTransport(chunk_bytes)
    raise ValueError(f"transport: a role process uses inprocess or shared_memory, got {kind!r}")


def _serve(spec: RoleSpec, conn: Any, transport_kind: str, threads: int) -> None:
    """The child process: load the role's engine, then answer stage calls until "stop"."""
    # the parent's intra-op thread count: CPU kernels split their reductions by thread, so a role on another
    # count is not bitwise the co-located engine (seen on cosmos3: 6e-7 with 1 thread)
    torch.set_num_threads(threads)
    try:
        body = RoleEngine(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        conn.send(("error", "", f"{spec.replica_id} failed to start: {type(e).__name__}: {e}"))
        return
    transport = make_transport(transport_kind, spec.chunk_bytes)
    conn.send(("ready", body.weights_version, None))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            conn.send(("stopped", None, None))
            return
        try:
            if msg[0] == "plant":
                body.plant(msg[1], msg[2])
                conn.send(("ok", None, body.resident()))
                continue
            manifest, tensors = transport.recv(msg[1])
            t0 = time.perf_counter()
            out_m, out_t, hit = body.run_stage(manifest, tensors)
            handle = transport.send(out_m, out_t)
            conn.send(("ok", (handle, hit, time.perf_counter() - t0), body.resident()))
        except TransferError as e:
            conn.send(("transfer_error", e.field, str(e).split(": ", 1)[1]))
        except Exception as e:  # noqa: BLE001 - the stage's own error, one line for the parent
            conn.send(("error", "", f"{type(e).__name__}: {e}"))


class RoleWorker:
    """One replica of one role. `processes=True`: a spawned child process with its own engine; False: this process."""

    def __init__(self, spec: RoleSpec, *, transport: str = "shared_memory", processes: bool = True,
                 engine: Any = None):
        self.spec, self.processes, self.transport_kind = spec, processes, transport if processes else "inprocess"
        self.transport = make_transport(self.transport_kind, spec.chunk_bytes)
        self._engine, self.body, self.proc, self.conn = engine, None, None, None
        self.resident: tuple[str, ...] = ()
        self.calls = 0
        self.last_hit = False
        self.weights_version: Any = None
        self._lock = threading.Lock()                # one stage at a time per replica (one engine, one pipe)

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    def start(self) -> RoleWorker:
        return self.launch().wait_ready()

    def launch(self) -> RoleWorker:
        """Spawn the replica's process (or build its body here); `wait_ready` then waits for its engine."""
        if not self.processes:
            self.body = RoleEngine(self.spec, self._engine)
            self.weights_version = self.body.weights_version
            return self
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(self.spec, child, self.transport_kind, torch.get_num_threads()),
                                daemon=True,
                                name=f"fleet-{self.replica_id}")
        self.proc.start()
        child.close()
        return self

    def wait_ready(self) -> RoleWorker:
        if self.proc is None:
            return self
        try:
            kind, version, detail = self.conn.recv()
        except EOFError:
            kind, version, detail = "error", None, f"{self.replica_id} exited before it was ready"
        if kind != "ready":
            self.close()
            raise RoleFailed(detail)
        self.weights_version = version
        return self

    def _reply(self) -> Any:
        kind, value, extra = self.conn.recv()
        if kind == "transfer_error":
            raise TransferError(value, extra)
        if kind == "error":
            raise RoleFailed(f"{self.replica_id}: {extra}")
        self.resident = extra
        return value

    def plant(self, key: str, entry: tuple[TransferManifest, dict[str, torch.Tensor]]) -> None:
        if self.body is not None:
            self.body.plant(key, entry)
            self.resident = self.body.resident()
            return
        self.conn.send(("plant", key, entry))
        self._reply()

    def run_stage(self, manifest: TransferManifest,
                  tensors: dict[str, torch.Tensor]) -> tuple[TransferManifest, dict[str, torch.Tensor]]:
        """The role's stage on (manifest, tensors): the input crosses the transport to the replica, the output back."""
        with self._lock:
            return self._run_stage(manifest, tensors)

    def _run_stage(self, manifest: TransferManifest,
                   tensors: dict[str, torch.Tensor]) -> tuple[TransferManifest, dict[str, torch.Tensor]]:
        handle = self.transport.send(manifest, tensors)
        if self.body is not None:
            m, t = self.transport.recv(handle)
            out_m, out_t, self.last_hit = self.body.run_stage(m, t)
            self.resident = self.body.resident()
            return self.transport.recv(self.transport.send(out_m, out_t))
        self.conn.send(("run", handle, None))
        out_handle, self.last_hit, _seconds = self._reply()
        return self.transport.recv(out_handle)

    def close(self) -> None:
        if self.proc is not None:
            try:
                if self.proc.is_alive():
                    self.conn.send(("stop", None, None))
                    self.conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            self.proc = None


@dataclass
class FleetResult:
    request_id: str
    frames: torch.Tensor               # uint8 [F, H, W, 3]
    audio: torch.Tensor | None
    latents: dict                      # the denoiser's final latents by modality (C1)
    denoiser_input: dict               # the tensors the denoiser received (the conditioned request's)
    fps: float
    seed: int | None
    bytes_moved: int                   # tensor bytes of every transfer of this request
    bytes_by_transfer: dict = field(default_factory=dict)   # "gateway->encoder" ... -> bytes
    manifests: list = field(default_factory=list)          # every TransferManifest the request crossed, in order
    replicas: dict = field(default_factory=dict)           # role -> replica id that ran it
    cache_hits: dict = field(default_factory=dict)         # role -> served from a resident entry
    seconds: float = 0.0


class LocalFleet:
    """One RoleWorker per role (N for the denoiser), on this machine, wired by a transport."""

    def __init__(self, family: str, variant: str | None = None, *, model_dir: str | None = None, seed: int = 0,
                 denoisers: int = 1, processes: bool = True, transport: str = "shared_memory",
                 denoiser_cache_entries: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES, engines: dict | None = None):
        base = {"family": family, "variant": variant, "model_dir": model_dir, "seed": seed, "chunk_bytes": chunk_bytes}
        engines = engines or {}
        self.workers: dict[str, list[RoleWorker]] = {
            "encoder": [RoleWorker(RoleSpec("encoder", **base), transport=transport, processes=processes,
                                   engine=engines.get("encoder"))],
            "denoiser": [RoleWorker(RoleSpec("denoiser", replica=i, cache_entries=denoiser_cache_entries, **base),
                                    transport=transport, processes=processes, engine=engines.get("denoiser"))
                         for i in range(denoisers)],
            "decoder": [RoleWorker(RoleSpec("decoder", **base), transport=transport, processes=processes,
                                   engine=engines.get("decoder"))]}
        self.chunk_bytes = chunk_bytes
        self._ids = itertools.count()
        self._pick_lock = threading.Lock()
        self.route_to: dict[str, str] = {}             # input key -> denoiser replica id holding it (affinity)

    def start(self) -> LocalFleet:
        try:
            for ws in self.workers.values():       # every process loads its engine at once, then each is awaited
                for w in ws:
                    w.launch()
            for ws in self.workers.values():
                for w in ws:
                    w.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for ws in self.workers.values():
            for w in ws:
                w.close()

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _pick(self, role: str, key: str | None) -> RoleWorker:
        """The replica holding `key` (affinity), else the one with the fewest calls placed (concurrent generate
        calls from threads spread over the replicas; a replica runs one stage at a time)."""
        ws = self.workers[role]
        with self._pick_lock:
            pick = None
            if key is not None:
                pick = next((w for w in ws if key in w.resident or self.route_to.get(key) == w.replica_id), None)
            pick = pick or min(ws, key=lambda w: w.calls)
            pick.calls += 1
            return pick

    def generate(self, request: Any, image: Any = None, request_id: str | None = None) -> FleetResult:
        """The request through encoder -> denoiser -> decoder. With denoiser caches, the denoiser call carries its
        input's content key and goes to the replica holding it (affinity), else to the least used replica."""
        rid = request_id or f"fleet-{next(self._ids)}"
        t0 = time.perf_counter()
        result = FleetResult(rid, None, None, {}, {}, 0.0, None, 0)
        manifest, tensors = pack({"request": request, "image": image}, request_id=rid, stage="request",
                                 producer="gateway", consumer="encoder", chunk_bytes=self.chunk_bytes,
                                 prefix="request")
        outputs = {}
        for role in ROLES:
            key = None
            if role == "denoiser" and self.workers[role][0].spec.cache_entries > 0:
                key = input_key(manifest, tensors, self.workers[role][0].weights_version)
            if key is not None:
                manifest = _with_key(manifest, key)
            worker = self._pick(role, key)
            result.manifests.append(manifest)
            result.bytes_by_transfer[f"{manifest.producer}->{role}"] = manifest.nbytes
            if role == "denoiser":
                result.denoiser_input = dict(tensors)
            manifest, tensors = worker.run_stage(manifest, tensors)
            result.replicas[role] = worker.replica_id
            result.cache_hits[role] = bool(getattr(worker, "last_hit", False))
            if key is not None:
                self.route_to[key] = worker.replica_id
            outputs[role] = unpack(manifest, tensors)
        result.manifests.append(manifest)
        result.bytes_by_transfer[f"{manifest.producer}->gateway"] = manifest.nbytes
        result.bytes_moved = sum(m.nbytes for m in result.manifests)
        den, dec = outputs["denoiser"], outputs["decoder"]
        result.latents, result.fps, result.seed = den["latents"], den["fps"], den["seed"]
        result.frames, result.audio = dec["frames"], dec["audio"]
        result.seconds = time.perf_counter() - t0
        return result


def _with_key(manifest: TransferManifest, key: str) -> TransferManifest:
    import dataclasses
    return dataclasses.replace(manifest, cache_key=key)
