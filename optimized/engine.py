"""The engine API: one resident model instance of any family, the WorkUnit scheduler, requests in, results and
events out. It names no family: everything family-specific comes from the family's entry (`optimized.registry`).

    from optimized import Engine
    engine = Engine.from_variant("cosmos3:tiny", seed=0)   # any family's variant ("wan:tiny-2.1-t2v", ...)
    engine = Engine.from_checkpoint("OUT")              # the family is read from the checkpoint
    result = engine.generate(request)                   # blocking; the request's type picks the loop
    handle = engine.submit(request); handle.cancel()    # streaming / cancellable
    handle = engine.submit_built("video", num_frames=9, ...)   # a family's request builder ("video") -> submit
    prog = engine.run_program("reason_then_generate", r, g)    # a family's program; engine.loop("denoise"): a loop
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from optimized.programs import VIDEO_PHASES, start_video
from optimized.registry import UnknownFamily, family, family_of_config, family_of_variant
from optimized.runtime.events import Event, EventBus
from optimized.runtime.family import FamilyEntry, LoopOptions
from optimized.runtime.loop import LoopKernel
from optimized.runtime.scheduler import RequestRecord, RequestRejected, UnknownRequest, WorkUnitScheduler

__all__ = ["Engine", "RequestHandle", "RequestRejected", "UnknownRequest", "check_finite_weights", "check_dtype",
           "default_memory_budget"]

ENGINE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what every family's kernels run in
HOST_MEMORY_BUDGET = 8 << 30     # a CPU engine's default budget (pass memory_budget_bytes to change it)


def check_dtype(dtype: Any) -> torch.dtype:
    """The engine's compute dtype, refused at construction (ValueError) unless the kernels run in it."""
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"dtype {dtype!r}: the engine runs in one of "
                         f"{', '.join(str(d).replace('torch.', '') for d in ENGINE_DTYPES)}")
    return dtype


def default_memory_budget(device: Any) -> int:
    """The bytes one engine may plan to use: the device's memory on CUDA, HOST_MEMORY_BUDGET on the host."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(dev).total_memory)
    return HOST_MEMORY_BUDGET


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB"


def check_finite_weights(weights: dict[str, dict[str, torch.Tensor]], where: str = "weights") -> None:
    """Refuse NaN / Inf in any floating-point tensor, naming the component and key (ValueError)."""
    for component, state in weights.items():
        for key, t in state.items():
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{where}: component {component!r} key {key!r} holds NaN/Inf values")


@dataclass
class RequestHandle:
    """The owner of a submitted request: `result()` takes the result from the scheduler's record (which then holds
    no tensors), so the result lives as long as the handle does."""
    engine: "Engine"
    record: RequestRecord
    _result: Any = None
    _taken: bool = False

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def status(self) -> str:
        return self.record.status

    @property
    def events(self) -> list[Event]:
        return list(self.record.events)

    @property
    def weights_version(self) -> str | None:
        """The weights version this request is computed with (the one resident when it was submitted)."""
        return self.record.weights_version

    def cancel(self) -> None:
        self.engine.scheduler.cancel(self.request_id)

    def result(self) -> Any:
        """Drive the engine until this request ends; its result, or an error saying why there is none."""
        self.engine.scheduler.run_until(lambda: self.record.status in ("completed", "cancelled", "failed"))
        if self.record.status != "completed":
            raise RuntimeError(f"request {self.request_id} {self.record.status}"
                               + (f": {self.record.error}" if self.record.error else ""))
        if not self._taken:   # held once: by this handle from now on
            self._result, self.record.result, self._taken = self.record.result, None, True
        return self._result


class Engine:
    def __init__(self, instance: Any, entry: FamilyEntry, cfg_policy: str = "batched",
                 memory_budget_bytes: int | None = None, tick_budget_seconds: float = float("inf"),
                 max_batch: int = 16, kv_blocks: int = 512, kv_block_size: int = 16, group: Any = None,
                 batching: str = "measured", offload: str = "none", offload_budget_bytes: int | None = None,
                 prefetch_blocks: int = 1):
        if getattr(instance, "dtype", None) is not None:
            check_dtype(instance.dtype)
        if memory_budget_bytes is None:
            memory_budget_bytes = default_memory_budget(getattr(instance, "device", None))
        self.model = instance
        self.family = entry
        self.options = LoopOptions(cfg_policy, kv_blocks, kv_block_size, group)
        self.bus = EventBus()
        self.bus.attach(self)   # every event names this engine's model, instance, worker and versions
        self.scheduler = WorkUnitScheduler(memory_budget_bytes, tick_budget_seconds, max_batch, self.bus,
                                           batching=batching)
        self._loops: dict[str, LoopKernel] = {}   # built on first use, one kernel per loop name
        for cache in entry.caches(instance):      # cache decisions join the engine's event stream
            cache.subscribe(lambda ev: self.bus.emit(Event(
                "trace.cache", None, self.scheduler.tick_count,
                {"store": ev.store, "op": ev.op, "key": ev.key.short(), "nbytes": ev.nbytes})))
        # the memory plane (optimized/runtime/memory.py): made now, so it manages the weights as loaded (not the
        # tables a forward builds later)
        self.memory.set_offload(offload, offload_budget_bytes, prefetch_blocks)

    # ---- construction
    @classmethod
    def from_weights(cls, cfg: Any, weights: dict[str, dict[str, torch.Tensor]], device: str = "cpu",
                     dtype: torch.dtype = torch.float32, weights_version: str | None = None, **kw) -> "Engine":
        """Canonical weights by component (the family is the one whose config class `cfg` is); NaN / Inf refused."""
        check_dtype(dtype)
        entry = family_of_config(cfg)
        check_finite_weights(weights)
        engine = cls(entry.load(cfg, weights, device=device, dtype=dtype, weights_version=weights_version), entry, **kw)
        engine.base_weights = weights   # what a LoRA merge fuses into (optimized/adapters)
        return engine

    @classmethod
    def from_state_dict(cls, cfg: Any, state: dict[str, torch.Tensor], device: str = "cpu",
                        dtype: torch.dtype = torch.float32, weights_version: str | None = None, **kw) -> "Engine":
        """A single-component family's canonical state dict (e.g. the cosmos3 transformer)."""
        entry = family_of_config(cfg)
        comps = [c.component_id for c in entry.components(cfg)]
        if len(comps) != 1:
            raise ValueError(f"{entry.name} has components {comps}: use Engine.from_weights(cfg, {{component: "
                             f"state}})")
        return cls.from_weights(cfg, {comps[0]: state}, device, dtype, weights_version, **kw)

    @classmethod
    def from_variant(cls, variant: str, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                     family: str | None = None, **kw) -> "Engine":
        """Seeded random weights at a variant's shapes (benchmarks at released sizes; smoke runs). The family is
        the one whose variants include the name; `family=` picks one when several do."""
        check_dtype(dtype)
        entry = family_of_variant(variant, family)
        engine = cls(entry.random_variant(variant, seed, device, dtype), entry, **kw)
        engine.weights_source = ("random", variant, seed)   # what Engine.reload regenerates a component from
        return engine

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        **kw) -> "Engine":
        """A canonical checkpoint written by fvconvert (single-component dir or whole-model dir). The family and
        the weights version are read from it (tensors are never hashed); partial checkpoints are refused."""
        from manifests.checkpoint import CheckpointError, load_state, read_checkpoint

        check_dtype(dtype)
        ckpt = read_checkpoint(path)
        try:
            entry = family(ckpt.family)
        except UnknownFamily as e:
            raise CheckpointError(f"{path}: {e}") from None
        if ckpt.partial:
            holes = {name: list(c.parts_unfilled) for name, c in ckpt.components.items() if c.partial}
            raise CheckpointError(f"{path}: a partial checkpoint (missing parts {holes}); the engine needs every "
                                  f"part of every component")
        cfg = ckpt.typed_config()
        if entry.instance_config is not None and ckpt.is_model and not isinstance(cfg, entry.config_class):
            cfg = entry.instance_config(cfg)   # the whole model's config -> what the resident instance loads
        if not isinstance(cfg, entry.config_class):
            raise CheckpointError(f"{path}: holds a {type(cfg).__name__} ({', '.join(ckpt.components)}), not a "
                                  f"whole {entry.name} model ({entry.config_class.__name__}); convert the whole "
                                  f"model directory")
        need = [c.component_id for c in entry.components(cfg)]
        missing = [n for n in need if n not in ckpt.components]
        if missing:
            raise CheckpointError(f"{path}: {entry.name} needs components {need}; missing {missing}")
        weights = {n: load_state(ckpt, component=n if ckpt.is_model else None, check_finite=True) for n in need}
        engine = cls(entry.load(cfg, weights, device=device, dtype=dtype, weights_version=ckpt.weights_version),
                     entry, **kw)
        engine.checkpoint, engine.checkpoint_path = ckpt, str(path)   # the rest of a model directory (media, tokenizer)
        if ckpt.is_model and entry.media is not None:   # load the media components (VAE, sound decoder) now
            from optimized.serving.families import media_chain
            media_chain(engine)
        return engine

    # ---- loops
    def loop(self, name: str) -> LoopKernel:
        """The family's loop kernel `name`, built once per engine (one kernel per loop: the scheduler batches by it)."""
        if name not in self._loops:
            if name not in self.family.loops:
                raise KeyError(f"{self.family.name} has no loop {name!r}; loops: {sorted(self.family.loops)}")
            self._loops[name] = self.family.loops[name](self.model, self.options)
        return self._loops[name]

    # ---- requests
    def submit(self, request: Any, *, request_id: str | None = None, **options: Any) -> RequestHandle:
        """Validate and queue; the request's type picks the loop (`options` go to the loop's job, e.g.
        record_trajectory=True). Raises RequestRejected (one clear message) for an invalid or impossible request."""
        try:
            name = self.family.loop_for(request)
            job = self.family.make_job(name, request, **options)
        except TypeError as e:
            raise RequestRejected(str(e)) from None
        self.admit(request, (name,))
        handle = RequestHandle(self, self.scheduler.submit(self.loop(name), job, request_id))
        handle.record.weights_version = getattr(self.model, "weights_version", None)
        return handle

    def admit(self, request: Any, phases: tuple[str, ...] = VIDEO_PHASES) -> None:
        """Refuse `request` before anything is allocated (RequestRejected naming the field): its contract's bounds
        (`request.validate`), the family's size limits, then its peak bytes over `phases` (the family's
        `request_cost`, from the request's fields) against this engine's memory budget."""
        validate = getattr(request, "validate", None)
        if callable(validate):
            try:
                validate(self.model.cfg)
            except TypeError:
                pass  # a request validated another way: its loop's init_state checks it
            except ValueError as e:
                raise RequestRejected(str(e), getattr(e, "field", None)) from None
        if getattr(request, "lora", ()):   # per-request LoRA adapters must be loaded (optimized/adapters)
            try:
                self.loras.check_refs(request.lora)
            except ValueError as e:
                raise RequestRejected(str(e), "lora") from None
        too_big = self.family.capabilities.oversized(request, self.family.name)
        if too_big:
            raise RequestRejected(*too_big)
        cost = self.family.request_cost(self, request, phases) if self.family.request_cost is not None else None
        budget = self.scheduler.memory_budget_bytes
        if cost is not None and cost.phases and cost.peak[1] > budget:
            phase, peak = cost.peak
            raise RequestRejected(
                f"{self.family.name} request: needs about {_gib(peak)} at its peak ({phase}), more than this "
                f"engine's memory budget of {_gib(budget)}; it can never fit (reduce {', '.join(cost.fields)})",
                cost.fields[0] if cost.fields else None)
        self._admit_memory(cost)   # slept weights must come back for it: counted, then woken (memory plane)

    def cancel(self, request_id: str) -> None:
        """Cancel a request at its next step boundary; UnknownRequest (a ValueError) for an id never accepted."""
        self.scheduler.cancel(request_id)

    def generate(self, request: Any = None, *, prompt: str | None = None, **options: Any) -> Any:
        """`generate(request)`: the loop's result. `generate(prompt=..., image=..., out=..., ...)`: the family's
        processor builds the request, then the video program runs it (a VideoResult)."""
        if prompt is not None:
            from optimized.serving.requests import request_from_prompt
            out, image = options.pop("out", None), options.pop("image", None)
            request, image = request_from_prompt(self, prompt, image=image, **options)
            return self.generate_video(request, out, image=image)
        return self.submit(request, **options).result()

    def start_video(self, request: Any, out: Any = None, **kw: Any) -> Any:
        """[encode] -> denoise -> decode as scheduled work; a VideoProgram (`.result()`, `.cancel()`, events)."""
        return start_video(self, request, out=out, **kw)

    def generate_video(self, request: Any, out: Any = None, **kw: Any) -> Any:
        """Blocking: a VideoResult (frames [F, H, W, 3] uint8, audio, latents, timings, ids); artifacts written
        atomically when `out` is given (OUT.mp4 + OUT.json sidecar, or a directory of PNG frames + video.json)."""
        return self.start_video(request, out, **kw).result()

    def deployment_card(self) -> dict:
        """What this instance serves, as JSON-ready data (family, variant, weights version, capabilities, dtypes,
        buckets captured, parallel plan, memory reserved)."""
        from optimized.serving.card import deployment_card
        return deployment_card(self).to_dict()

    submit_reasoning = submit     # the request's type picks the loop: reasoning requests go to the reasoning loop
    reason = generate

    def build(self, kind: str, **kw: Any) -> Any:
        """A request from the family's builder `kind` (e.g. "video": from pixel sizes); RequestRejected if invalid."""
        if kind not in self.family.request_builders:
            raise AttributeError(f"{self.family.name} has no request builder {kind!r}; builders: "
                                 f"{sorted(self.family.request_builders)}")
        try:
            return self.family.request_builders[kind](self.model, **kw)
        except (ValueError, TypeError) as e:
            raise RequestRejected(str(e)) from None

    def run_program(self, name: str, *args: Any, **kw: Any) -> Any:
        if name not in self.family.programs:
            raise AttributeError(f"{self.family.name} has no program {name!r}; programs: "
                                 f"{sorted(self.family.programs)}")
        return self.family.programs[name](self, *args, **kw)

    def submit_built(self, kind: str, **kw: Any) -> "RequestHandle":
        """`submit(build(kind, **kw))`: a request from the family's builder `kind` (e.g. "video"), submitted."""
        return self.submit(self.build(kind, **kw))

    def subscribe(self, fn: Callable[[Event], Any], prefix: str = "") -> Callable[[], None]:
        return self.bus.subscribe(fn, prefix)

    def step(self) -> None:
        """One scheduler iteration (for callers that interleave their own work)."""
        self.scheduler.tick()

    def run_until_idle(self) -> None:
        self.scheduler.run_until_idle()

    @property
    def loras(self) -> Any:
        """This engine's LoRA adapters: load / unload / list, merge / unmerge (optimized/adapters/manager.py)."""
        if "_loras" not in self.__dict__:
            from optimized.adapters import AdapterManager
            self._loras = AdapterManager(self)
        return self._loras

    def update_weights(self, weights: Any, version: str | None = None, policy: str = "finish") -> Any:
        """New weights for the resident instance (a checkpoint path, {component: state} or a state dict) under a new
        version: in-flight requests finish on their version ("finish") or are drained first ("drain"), every cache
        keyed by the old version is invalidated, later records carry the new one. See optimized/training/weights.py."""
        from optimized.training.weights import update_weights
        return update_weights(self, weights, version, policy)

    # ---- memory plane (optimized/runtime/memory.py): sleep / wake by tag, unload / reload, offload modes
    @property
    def memory(self) -> Any:
        """The memory plane of the resident instance (made on first use; follows `update_weights` to a new one)."""
        from optimized.runtime.memory import MemoryPlane
        plane = self.__dict__.get("_memory")
        if plane is None or plane.instance is not self.model:
            try:   # an instance without a typed config (a test double) is managed attribute by attribute
                ids = [c.component_id for c in self.family.components(self.model.cfg)]
            except Exception:  # noqa: BLE001
                ids = []
            fresh = MemoryPlane(self.model, ids, caches=lambda: self.family.caches(self.model))
            if plane is not None and plane.mode != "none":
                fresh.set_offload(plane.mode, plane.budget, plane.prefetch_blocks)
            self._memory = plane = fresh
        return plane

    def _admit_memory(self, cost: Any) -> None:
        unloaded = self.memory.unloaded()
        if unloaded:
            raise RequestRejected(f"{self.family.name} request: component(s) {', '.join(unloaded)} are unloaded; "
                                  f"Engine.reload() them first")
        extra = self.memory.admission_bytes()
        if not extra:
            return
        peak = cost.peak[1] if cost is not None and cost.phases else 0
        budget = self.scheduler.memory_budget_bytes
        if peak + extra > budget:
            raise RequestRejected(
                f"{self.family.name} request: needs about {_gib(peak)} at its peak plus {_gib(extra)} of slept "
                f"weights ({', '.join(self.memory.asleep())}) to bring back, more than this engine's memory budget "
                f"of {_gib(budget)}")
        self.memory.wake(("weights",))

    def _check_quiet(self, what: str) -> None:
        if self.scheduler.running or self.scheduler.waiting:
            raise RuntimeError(f"Engine.{what}: {len(self.scheduler.running) + len(self.scheduler.waiting)} "
                               f"request(s) in flight; {what} once they end (or cancel them)")

    def sleep(self, tags: Any = ("weights",)) -> int:
        """Tagged memory to host ("weights", "weights:<component>") or evicted ("caches"), with no request in flight;
        device bytes freed. A later request wakes the weights (its admission counts their bytes)."""
        self._check_quiet("sleep")
        return self.memory.sleep(tags)

    def wake(self, tags: Any = ("weights",)) -> int:
        """Slept weights back, bitwise the same, without reading the checkpoint again; device bytes brought back."""
        return self.memory.wake(tags)

    def unload(self, component: str) -> int:
        """Drop one component's weights from the device and host (no request in flight); bytes freed."""
        self._check_quiet("unload")
        return self.memory.unload(component)

    def reload(self, component: str) -> int:
        """An unloaded component read again from this engine's weights source (its checkpoint, the weights it was
        built from, or the seeded random weights of its variant)."""
        from optimized.runtime.memory import declared_components

        m, entry = self.model, self.family
        self.memory._component(component)
        source = getattr(self, "weights_source", None)
        if getattr(self, "checkpoint", None) is not None:
            from manifests.checkpoint import load_state
            weights = {c.component_id: load_state(self.checkpoint, component=c.component_id if self.checkpoint.is_model
                                                  else None, check_finite=True) for c in entry.components(m.cfg)}
        elif getattr(self, "base_weights", None) is not None:
            weights = self.base_weights
        elif source is not None and source[0] == "random":
            weights = entry.random_weights(entry.load_variant(source[1]), source[2])
        else:
            raise ValueError(f"Engine.reload({component!r}): this engine keeps no weights source to read again")
        fresh = entry.load(m.cfg, weights, device=str(m.device), dtype=m.dtype, weights_version=m.weights_version)
        ids = [c.component_id for c in entry.components(m.cfg)]
        obj = {c.name: c.obj for c in declared_components(fresh, ids)}[component]
        return self.memory.reload(component, obj)
