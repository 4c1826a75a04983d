"""The memory plane: where a resident model's weights live, by component and tag, and how they move.

A model instance's weights are tensors held by its components (a DiT, a text encoder, a VAE). The plane manages each
tensor in place (`torch.utils.swap_tensors`: every reference the component holds, in dicts, block dataclasses or
lists, sees the move), so a component never has to be rebuilt and the checkpoint is never re-read to bring weights
back. A tensor is in one of three states:

    device     the run copy, on the engine's device (what the kernels read)
    host       the values in host memory only (pinned on CUDA, for async copies); the device tensor is swapped for
               a `meta` tensor of the same shape / dtype: no storage, so nothing is resident on the device
    unloaded   neither: `meta` only; `reload` reads the weights from the engine's source again

On a CPU engine "device" and "host" are both RAM, kept as distinct storages so the accounting is honest about what a
GPU engine would hold where: an offloaded tensor's device copy is freed (meta), a resident one's is its own clone.

What the plane offers (the engine's `sleep` / `wake` / `unload` / `reload` and `offload=` option):

  * tags: "weights" (every component), "weights:<component>" (one), "caches" (the family's cache stores: sleeping
    them evicts their entries; nothing to wake);
  * sleep / wake by tag (vLLM CuMem's level-1 sleep: weights to host, back on wake, bitwise the same);
  * unload / reload one component (the host copy dropped too; reload reads the engine's weights source);
  * offload modes: "idle" (diffusers `enable_model_cpu_offload`: a component is brought to the device when one of its
    entry points is called, every other component goes to host; the text / image encoders go back to host as soon as
    their call returns), "blockwise" (diffusers group offloading at block level, prefetch on: a component that
    declares its block list keeps only its non-block weights and a window of 1 + prefetch blocks on the device; the
    next blocks are copied while the current one runs, on a side CUDA stream from pinned host memory);
  * byte accounting: device / host / peak device bytes of the managed weights (`summary()`), and what admission must
    add for weights that have to be brought back (`admission_bytes()`).

A component is declared by its instance (`memory_components()` -> MemoryComponent); an instance that declares none
is one component (named by its family's single component id) with its class's `memory_blocks` / entry points.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import swap_tensors

OFFLOAD_MODES = ("none", "idle", "blockwise")
DEFAULT_PREFETCH_BLOCKS = 1


class MemoryStateError(RuntimeError):
    """A component used or moved in a state that does not allow it (asleep, unloaded, a block not resident)."""


@dataclass(frozen=True)
class MemoryComponent:
    """What a model instance declares about one component: its object, the methods that run it (idle offload wraps
    them), whether it goes back to host right after a call (encoders), and the attribute holding its per-block
    weights in run order (blockwise offload streams them)."""
    name: str
    obj: Any
    entry_points: tuple[str, ...] = ()
    release_after_use: bool = False
    blocks: str | None = None


class Slot:
    """One managed tensor: the object the component holds (moved in place) and its host copy when it has one."""
    __slots__ = ("tensor", "host", "nbytes", "path")

    def __init__(self, tensor: torch.Tensor, path: str = ""):
        self.tensor, self.host, self.nbytes, self.path = tensor, None, tensor.numel() * tensor.element_size(), path

    @property
    def on_device(self) -> bool:
        return not self.tensor.is_meta


def tensor_paths(obj: Any) -> dict[str, torch.Tensor]:
    """Every tensor reachable from `obj` through its attributes, dicts, lists, tuples and dataclasses, by the path
    that reaches it first (in walk order, each tensor once). Other objects (caches, compile caches, meshes, adapters)
    are not entered: they are not the weights."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen.add(id(v))
                out[path] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}[{k!r}]")
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, f"{path}[{i}]")
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name), f"{path}.{f.name}")

    if hasattr(obj, "__dict__") and not dataclasses.is_dataclass(obj):
        for name, value in vars(obj).items():
            walk(value, name)
    else:
        walk(obj, "")
    return out


def collect_tensors(obj: Any) -> list[torch.Tensor]:
    return list(tensor_paths(obj).values())


def declared_components(instance: Any, component_ids: Sequence[str]) -> list[MemoryComponent]:
    """The instance's declaration, or the instance itself as its family's single component."""
    declare = getattr(instance, "memory_components", None)
    if callable(declare):
        return list(declare())
    if len(component_ids) != 1:   # undeclared: each attribute holding tensors is one component (no entry points)
        return [MemoryComponent(name, value) for name, value in getattr(instance, "__dict__", {}).items()
                if not isinstance(value, torch.Tensor) and hasattr(value, "__dict__") and tensor_paths(value)]
    return [MemoryComponent(component_ids[0], instance, tuple(getattr(instance, "memory_entry_points", ())),
                            blocks=getattr(instance, "memory_blocks", None))]


@dataclass
class MemoryStats:
    onloads: int = 0              # tensors copied host -> device
    offloads: int = 0             # tensors moved device -> host
    bytes_to_device: int = 0
    bytes_to_host: int = 0
    block_fetches: int = 0        # blocks brought in by blockwise offload (prefetched or on demand)


@dataclass
class _Managed:
    spec: MemoryComponent
    slots: list[Slot]                                # every tensor of the component
    block_slots: list[list[Slot]] = field(default_factory=list)   # per block (blockwise)
    state: str = "device"                            # device | host | unloaded (the non-block / whole component)
    asleep: bool = False
    streamed: "StreamedBlocks | None" = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def non_block_slots(self) -> list[Slot]:
        inside = {id(s) for b in self.block_slots for s in b}
        return [s for s in self.slots if id(s) not in inside]


class MemoryPlane:
    """The weights of one resident instance, by component (see the module docstring)."""

    def __init__(self, instance: Any, component_ids: Sequence[str], caches: Callable[[], Sequence[Any]] = tuple,
                 device: Any = None):
        self.instance = instance
        self.device = torch.device(device if device is not None else getattr(instance, "device", "cpu"))
        self._caches = caches
        self.mode, self.budget, self.prefetch_blocks = "none", None, DEFAULT_PREFETCH_BLOCKS
        self.stats = MemoryStats()
        self.device_bytes = 0
        self.peak_device_bytes = 0
        self.in_use: str | None = None
        self.components: dict[str, _Managed] = {}
        for spec in declared_components(instance, component_ids):
            self.components[spec.name] = _Managed(spec, [Slot(t, path) for path, t in tensor_paths(spec.obj).items()
                                                         if not t.is_meta])
        self.device_bytes = sum(c.nbytes for c in self.components.values())
        self.peak_device_bytes = self.device_bytes
        self._stream = None   # the CUDA copy stream of blockwise prefetch (made on first use)

    # ------------------------------------------------------------------ moves (one tensor)
    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cuda":   # pinned: the async copy back needs page-locked memory
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        return t.clone()

    def _offload(self, slot: Slot, keep_host: bool = True) -> None:
        """device -> host (or -> nothing when keep_host is False and the slot has no host copy)."""
        if not slot.on_device:
            return
        if slot.host is None and keep_host:
            if slot.tensor.device.type == "cpu":   # the device storage itself becomes the host copy (no copy)
                stand_in = torch.empty_like(slot.tensor, device="meta")
                swap_tensors(slot.tensor, stand_in)
                slot.host = stand_in
                self._moved(slot, to_device=False)
                return
            slot.host = self._host_copy(slot.tensor)
        swap_tensors(slot.tensor, torch.empty_like(slot.tensor, device="meta"))
        self._moved(slot, to_device=False)

    def _onload(self, slot: Slot, keep_host: bool = True) -> None:
        """host -> device: a fresh device copy (the host copy kept for the next offload), or the host copy itself
        handed back on CPU when it is not kept (wake after sleep)."""
        if slot.on_device:
            return
        if slot.host is None:
            raise MemoryStateError("a weight with no host copy cannot be brought back (unloaded: reload it)")
        if self.device.type == "cpu" and not keep_host:
            run, slot.host = slot.host, None
        elif self.device.type == "cuda":
            run = slot.host.to(self.device, non_blocking=True)
        else:
            run = slot.host.clone()
        if not keep_host:
            slot.host = None
        swap_tensors(slot.tensor, run)
        self._moved(slot, to_device=True)

    def _moved(self, slot: Slot, to_device: bool) -> None:
        if to_device:
            self.device_bytes += slot.nbytes
            self.stats.onloads += 1
            self.stats.bytes_to_device += slot.nbytes
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        else:
            self.device_bytes -= slot.nbytes
            self.stats.offloads += 1
            self.stats.bytes_to_host += slot.nbytes

    # ------------------------------------------------------------------ component states
    def _bring_in(self, c: _Managed) -> None:
        if c.state == "unloaded":
            raise MemoryStateError(f"component {c.spec.name!r} is unloaded: Engine.reload({c.spec.name!r}) first")
        for s in (c.non_block_slots() if c.streamed is not None else c.slots):
            self._onload(s, keep_host=self.mode != "none")
        c.state = "device"

    def _send_out(self, c: _Managed) -> None:
        if c.streamed is not None:
            c.streamed.evict_all()
        for s in c.slots:
            self._offload(s)
        if c.state == "device":
            c.state = "host"

    @staticmethod
    def _check_movable(c: _Managed, what: str) -> None:
        """Captured CUDA graphs replay fixed weight addresses: a moved weight would be read from freed memory."""
        if getattr(c.spec.obj, "graph_mode", "eager") == "cuda":
            raise MemoryStateError(f"{what}: component {c.spec.name!r} replays captured CUDA graphs (graph mode "
                                   f"'cuda'), which hold its weights' addresses; configure_graph('eager' or "
                                   f"'compile') first")

    def use(self, name: str) -> None:
        """Component `name` is about to run: under idle / blockwise offload it comes to the device and every other
        component goes to host first (the lower peak). Asleep or unloaded components refuse to run."""
        c = self.components[name]
        if c.asleep:
            raise MemoryStateError(f"component {name!r} is asleep: Engine.wake() first")
        if self.mode == "none":
            if c.state != "device":
                raise MemoryStateError(f"component {name!r} is {c.state}: Engine.reload({name!r}) first")
            return
        if self.in_use == name and c.state == "device":
            return
        self._check_movable(c, f"offload={self.mode!r}")
        for other in self.components.values():
            if other is not c and other.state == "device" and other.spec.entry_points:
                self._send_out(other)
        self._bring_in(c)
        self.in_use = name

    def done(self, name: str) -> None:
        """A call into `name` returned: an encoder (release_after_use) goes back to host at once."""
        c = self.components[name]
        if self.mode != "none" and c.spec.release_after_use and c.state == "device":
            self._send_out(c)
            if self.in_use == name:
                self.in_use = None

    # ------------------------------------------------------------------ offload modes
    def set_offload(self, mode: str, budget_bytes: int | None = None,
                    prefetch_blocks: int = DEFAULT_PREFETCH_BLOCKS) -> "MemoryPlane":
        """Turn on "idle" or "blockwise" offload (once, on a plane in mode "none"). `budget_bytes`: the device bytes
        the managed weights may take at once; refused (ValueError) when a component cannot run inside it."""
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {mode!r}")
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
            raise ValueError(f"offload_budget_bytes must be a positive int, got {budget_bytes!r}")
        if not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be an int >= 0, got {prefetch_blocks!r}")
        if mode == "none":
            if budget_bytes is not None:
                raise ValueError("offload_budget_bytes needs offload='idle' or 'blockwise'")
            return self
        if self.mode != "none":
            raise ValueError(f"offload is already {self.mode!r}")
        windows = {}
        for name, c in self.components.items():
            blocks = getattr(c.spec.obj, c.spec.blocks) if mode == "blockwise" and c.spec.blocks else None
            if blocks is not None:
                self._check_streamable(name, c.spec.obj)
                c.block_slots = self._block_slots(c, blocks)
                fixed = sum(s.nbytes for s in c.non_block_slots())
                largest = max(sum(s.nbytes for s in b) for b in c.block_slots)
                fit = len(blocks) if budget_bytes is None else (budget_bytes - fixed) // largest
                if fit < 1:
                    raise ValueError(f"offload_budget_bytes {budget_bytes} is below what {name!r} needs to run "
                                     f"blockwise: {fixed} non-block bytes + {largest} for its largest block")
                windows[name] = (blocks, max(1, min(1 + prefetch_blocks, fit, len(blocks))))
            elif budget_bytes is not None and c.nbytes > budget_bytes:
                raise ValueError(f"component {name!r} holds {c.nbytes} bytes, more than offload_budget_bytes "
                                 f"{budget_bytes}" + (" (it declares no block list to stream)" if mode == "blockwise"
                                                      else "; offload='blockwise' streams it by blocks"))
        self.mode, self.budget, self.prefetch_blocks = mode, budget_bytes, prefetch_blocks
        for name, (blocks, window) in windows.items():
            c = self.components[name]
            c.streamed = StreamedBlocks(self, name, list(blocks), c.block_slots, window)
            setattr(c.spec.obj, c.spec.blocks, c.streamed)
        for name, c in self.components.items():
            if c.spec.entry_points:   # brought in when called
                self._guard(name, c)
                self._send_out(c)
            elif c.streamed is not None:   # no entry point: its non-block weights stay, its blocks stream
                c.streamed.evict_all()
        self.reset_peak()   # the peak from here on is the offloaded one
        return self

    @staticmethod
    def _check_streamable(name: str, obj: Any) -> None:
        """A captured / compiled stack holds fixed weight addresses, a parallel one its own sharded lists."""
        if getattr(obj, "graph_mode", "eager") != "eager":
            raise ValueError(f"offload='blockwise' runs {name!r} eagerly: its graph mode is {obj.graph_mode!r}")
        if getattr(obj, "tp", None) is not None or getattr(obj, "sp_mesh", None) is not None \
                or getattr(obj, "sequence_parallel", None) is not None:
            raise ValueError(f"offload='blockwise' is single-device: {name!r} runs a parallel plan")

    @staticmethod
    def _block_slots(c: _Managed, blocks: Sequence[Any]) -> list[list[Slot]]:
        by_id = {id(s.tensor): s for s in c.slots}
        seen: set[int] = set()
        out = []
        for b in blocks:
            mine = [t for t in collect_tensors(b) if id(t) in by_id and id(t) not in seen]   # each in one block
            seen.update(id(t) for t in mine)
            out.append([by_id[id(t)] for t in mine])
        return out

    def _guard(self, name: str, c: _Managed) -> None:
        """Wrap the component's entry points (instance attributes shadowing its methods): use before, done after."""
        for method in c.spec.entry_points:
            fn = getattr(c.spec.obj, method)
            if getattr(fn, "memory_guarded", False):
                continue

            def guarded(*a, _fn=fn, _name=name, **kw):
                self.use(_name)
                try:
                    return _fn(*a, **kw)
                finally:
                    self.done(_name)
            guarded.memory_guarded = True
            setattr(c.spec.obj, method, guarded)

    # ------------------------------------------------------------------ tags
    def tags(self) -> list[str]:
        return ["weights"] + [f"weights:{n}" for n in self.components] + ["caches"]

    def _resolve(self, tags: Sequence[str] | str) -> tuple[list[_Managed], bool]:
        tags = (tags,) if isinstance(tags, str) else tuple(tags)
        unknown = [t for t in tags if t not in self.tags()]
        if unknown or not tags:
            raise ValueError(f"unknown memory tag(s) {unknown or list(tags)}; tags: {', '.join(self.tags())}")
        names = list(self.components) if "weights" in tags else \
            [t.split(":", 1)[1] for t in tags if t.startswith("weights:")]
        return [self.components[n] for n in names], "caches" in tags

    def sleep(self, tags: Sequence[str] | str = ("weights",)) -> int:
        """Tagged weights to host (kept there until `wake`); "caches": evict the cache stores. Bytes freed on the
        device (weights) plus entries' bytes evicted (caches)."""
        comps, caches = self._resolve(tags)
        before, freed = self.device_bytes, 0
        for c in comps:
            self._check_movable(c, "sleep")
        for c in comps:
            if c.state == "unloaded":
                continue
            self._send_out(c)
            c.asleep = True
            if self.in_use == c.spec.name:
                self.in_use = None
        if caches:
            for cache in self._caches():
                freed += int(getattr(getattr(cache, "stats", None), "bytes", 0) or 0)
                cache.clear()
        return before - self.device_bytes + freed

    def wake(self, tags: Sequence[str] | str = ("weights",)) -> int:
        """Tagged weights back: to the device (offload "none": the host copies are dropped, bitwise the same
        tensors), or to the offload mode's host state (brought in on use). Bytes brought to the device."""
        comps, _ = self._resolve(tags)
        before = self.device_bytes
        for c in comps:
            if c.asleep and c.state != "unloaded":
                c.asleep = False
                if self.mode == "none" or not c.spec.entry_points:   # nothing would bring it in on use
                    self._bring_in(c)
        return self.device_bytes - before

    def asleep(self) -> list[str]:
        return [n for n, c in self.components.items() if c.asleep]

    def unloaded(self) -> list[str]:
        return [n for n, c in self.components.items() if c.state == "unloaded"]

    # ------------------------------------------------------------------ unload / reload
    def unload(self, name: str) -> int:
        """Drop component `name` from the device and host (meta only); device bytes freed."""
        c = self._component(name)
        self._check_movable(c, "unload")
        before = self.device_bytes
        if c.streamed is not None:
            c.streamed.evict_all()
        for s in c.slots:
            self._offload(s, keep_host=False)
            s.host = None
        c.state, c.asleep = "unloaded", False
        if self.in_use == name:
            self.in_use = None
        return before - self.device_bytes

    def reload(self, name: str, fresh: Any) -> int:
        """Component `name` from `fresh`, the same component built anew from the weights source: its tensors, in
        the same place (attribute path), fill this component's slots (shapes and dtypes checked). Device bytes brought in (0
        under offload: the reloaded weights wait on host until used)."""
        c = self._component(name)
        if c.state != "unloaded":
            raise ValueError(f"component {name!r} is not unloaded (it is {c.state})")
        new = tensor_paths(fresh)
        wrong = [s.path for s in c.slots if s.path not in new or new[s.path].shape != s.tensor.shape
                 or new[s.path].dtype != s.tensor.dtype]
        if wrong:
            raise ValueError(f"reload {name!r}: the weights source builds a different component ({len(wrong)} "
                             f"tensors differ or are missing, first {wrong[0]})")
        for s in c.slots:
            s.host = new[s.path].to(self.device)
        c.state = "host"
        before = self.device_bytes
        if self.mode == "none" or not c.spec.entry_points:
            self._bring_in(c)
        else:
            for s in c.slots:   # host copies pinned as offload keeps them
                if s.host.device.type != "cpu":
                    s.host = self._host_copy(s.host)
        return self.device_bytes - before

    def _component(self, name: str) -> _Managed:
        if name not in self.components:
            raise ValueError(f"unknown component {name!r}; components: {', '.join(self.components)}")
        return self.components[name]

    # ------------------------------------------------------------------ admission / accounting
    def working_set_bytes(self) -> int:
        """The most device bytes the managed weights take while a request runs, in this mode."""
        if self.mode == "none":
            return sum(c.nbytes for c in self.components.values() if c.state != "unloaded")
        most = 0
        for c in self.components.values():
            if c.streamed is not None:
                blocks = sorted((sum(s.nbytes for s in b) for b in c.block_slots), reverse=True)
                most = max(most, sum(s.nbytes for s in c.non_block_slots()) + sum(blocks[:c.streamed.window]))
            else:
                most = max(most, c.nbytes)
        return most

    def admission_bytes(self) -> int:
        """Device bytes that must be brought back before a request can run (slept weights): admission adds them to
        the request's peak."""
        slept = [c for c in self.components.values() if c.asleep]
        if not slept:
            return 0
        if self.mode == "none":
            return sum(c.nbytes for c in slept)
        return max(0, self.working_set_bytes() - self.device_bytes)

    def reset_peak(self) -> None:
        self.peak_device_bytes = self.device_bytes

    def summary(self) -> dict:
        """JSON-ready: mode, budget, device / host / peak bytes of the weights, per component state."""
        host = sum(s.nbytes for c in self.components.values() for s in c.slots if s.host is not None)
        return {"offload": self.mode, "offload_budget_bytes": self.budget,
                "weights_device_bytes": self.device_bytes, "weights_host_bytes": host,
                "weights_peak_device_bytes": self.peak_device_bytes,
                "components": {n: {"bytes": c.nbytes, "state": c.state, "asleep": c.asleep,
                                   **({"blocks": len(c.block_slots), "window": c.streamed.window}
                                      if c.streamed is not None else {})}
                               for n, c in self.components.items()},
                "moves": dataclasses.asdict(self.stats)}


class StreamedBlocks(Sequence):
    """A component's block list under blockwise offload: reading block i (iteration or index) makes blocks
    i .. i + window - 1 resident (the ones ahead copied while block i runs: a side stream on CUDA) and sends every
    other block to host, so at most `window` blocks are ever on the device. Reading a block that is not resident
    (a prefetch that did not happen) raises instead of running on a stand-in."""

    def __init__(self, plane: MemoryPlane, name: str, blocks: list, slots: list[list[Slot]], window: int):
        self.plane, self.name, self.blocks, self.slots, self.window = plane, name, blocks, slots, window
        self.resident: set[int] = {j for j, b in enumerate(slots) if any(s.on_device for s in b)}
        self.ready: dict[int, Any] = {}   # block -> its copy's CUDA event

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        self._ensure(i)
        return self.blocks[i]

    def __iter__(self) -> Iterator[Any]:
        try:
            for i in range(len(self)):
                self._ensure(i)
                yield self.blocks[i]
        finally:
            self.evict_all()   # between forwards no block is held on the device

    def _ensure(self, i: int) -> None:
        plane = self.plane
        if plane.components[self.name].asleep:
            raise MemoryStateError(f"component {self.name!r} is asleep: Engine.wake() first")
        wanted = set(range(i, min(len(self), i + self.window)))
        for j in sorted(self.resident - wanted):
            self._evict(j)
        for j in sorted(wanted - self.resident):
            self._fetch(j)
        self._wait(i)

    def _fetch(self, j: int) -> None:
        plane = plane_ = self.plane   # (host copies never change: no wait on the compute stream)
        if plane.device.type == "cuda":
            if plane_._stream is None:
                plane_._stream = torch.cuda.Stream(plane.device)
            with torch.cuda.stream(plane_._stream):
                for s in self.slots[j]:
                    plane._onload(s)
                event = torch.cuda.Event()
                event.record(plane_._stream)
            self.ready[j] = event
        else:
            for s in self.slots[j]:
                plane._onload(s)
        self.resident.add(j)
        plane.stats.block_fetches += 1

    def _wait(self, i: int) -> None:
        event = self.ready.pop(i, None)
        if event is not None:
            stream = torch.cuda.current_stream(self.plane.device)
            stream.wait_event(event)
            for s in self.slots[i]:   # allocated on the copy stream, read on this one
                s.tensor.record_stream(stream)
        missing = [k for k, s in enumerate(self.slots[i]) if not s.on_device]
        if missing:
            raise MemoryStateError(f"blockwise offload: block {i} of {self.name!r} is not resident "
                                   f"({len(missing)} of its tensors are on host)")

    def _evict(self, j: int) -> None:
        self.ready.pop(j, None)
        for s in self.slots[j]:
            self.plane._offload(s)
        self.resident.discard(j)

    def evict_all(self) -> None:
        for j in sorted(self.resident):
            self._evict(j)
