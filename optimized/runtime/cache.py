"""Structured cache keys and a byte-bounded LRU cache store with typed events.

A `CacheKey` names every field that can change the numerics of a cached value (designv2 "CacheKey"):
if two computations could differ, their keys must differ. `CacheStore` is a plain in-process store:
LRU by bytes, hit/miss/put/evict counters, and `CacheEvent(kind="trace.cache", ...)` delivered to
subscribers so the engine's event stream (and tests) can see every cache decision.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

log = logging.getLogger("optimized.runtime.cache")

CacheOp = str  # "hit" | "miss" | "put" | "evict"
_OPS = ("hit", "miss", "put", "evict")


class CacheKeyError(ValueError):
    """A malformed CacheKey (empty required field, unsorted/duplicate input hashes, ...)."""


def content_hash(tensor: torch.Tensor) -> str:
    """sha256 over dtype, shape and raw bytes: equal iff the tensors are bitwise equal (same dtype/shape)."""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256()
    h.update(str(t.dtype).encode())
    h.update(repr(tuple(t.shape)).encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _pairs(value: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), str(v)) for k, v in items))


@dataclass(frozen=True)
class CacheKey:
    model_id: str
    component_id: str
    weights_version: str
    precision: str
    shape_signature: str
    layout_signature: str
    cache_contract_version: str
    parallel_plan_hash: str = "single"
    input_hashes: tuple[tuple[str, str], ...] = ()   # sorted (name, hash) pairs; a dict is accepted and sorted
    seed: int | None = None                          # for values that depend on sampled noise
    step_index: int | None = None                    # for per-step values (e.g. a denoise-step cache)
    # sorted (adapter name, adapter version) pairs of the LoRA adapters the value was computed with (designv2):
    # () = the base weights alone; a dict is accepted and sorted
    adapter_versions: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_hashes", _pairs(self.input_hashes))
        object.__setattr__(self, "adapter_versions", _pairs(self.adapter_versions))
        self.validate()

    def validate(self) -> "CacheKey":
        for name in ("model_id", "component_id", "weights_version", "precision", "shape_signature",
                     "layout_signature", "cache_contract_version", "parallel_plan_hash"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise CacheKeyError(f"CacheKey.{name} must be a non-empty string, got {v!r}")
        names = [k for k, _ in self.input_hashes]
        if len(set(names)) != len(names):
            raise CacheKeyError(f"CacheKey.input_hashes has duplicate names: {names}")
        adapters = [k for k, _ in self.adapter_versions]
        if len(set(adapters)) != len(adapters) or any(not k or not v for k, v in self.adapter_versions):
            raise CacheKeyError(f"CacheKey.adapter_versions must name each adapter once with a version: "
                                f"{self.adapter_versions}")
        if self.step_index is not None and self.step_index < 0:
            raise CacheKeyError(f"CacheKey.step_index must be >= 0, got {self.step_index}")
        return self

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def short(self) -> str:
        """A compact human-readable id for logs (not for equality)."""
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:12]
        return f"{self.model_id}/{self.component_id}@{digest}"


@dataclass(frozen=True)
class CacheEvent:
    op: CacheOp
    key: CacheKey
    nbytes: int = 0
    store: str = ""
    kind: str = "trace.cache"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


def tensor_nbytes(value: Any) -> int:
    """Bytes held by the tensors inside `value` (tensor, dataclass, tuple/list, dict; nested)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return sum(tensor_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_nbytes(v) for v in value.values())
    return 0


class CacheStore:
    """LRU cache keyed by `CacheKey`, bounded by the bytes of the tensors it holds."""

    def __init__(self, max_bytes: int = 1 << 30, name: str = "cache") -> None:
        if max_bytes <= 0:
            raise ValueError(f"CacheStore max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.name = name
        self._entries: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()
        self._subscribers: list[Callable[[CacheEvent], None]] = []
        self.stats = CacheStats()
        self.subscriber_failures: dict[int, int] = {}   # id(subscriber) -> exceptions raised

    @property
    def hits(self) -> int:
        return self.stats.hits

    @property
    def misses(self) -> int:
        return self.stats.misses

    # ---- events ----
    def subscribe(self, fn: Callable[[CacheEvent], None]) -> Callable[[], None]:
        """Deliver every CacheEvent to `fn`; returns an unsubscribe function."""
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn) if fn in self._subscribers else None

    def _emit(self, op: CacheOp, key: CacheKey, nbytes: int = 0) -> None:
        """Subscribers are isolated: one that raises is kept, its first failure logged once, later ones counted
        (`subscriber_failures`); the cache operation and the request that caused it go on."""
        if self._subscribers:
            event = CacheEvent(op=op, key=key, nbytes=nbytes, store=self.name)
            for fn in list(self._subscribers):
                try:
                    fn(event)
                except Exception as e:  # noqa: BLE001 - a subscriber's bug is its own
                    n = self.subscriber_failures.get(id(fn), 0)
                    self.subscriber_failures[id(fn)] = n + 1
                    if n == 0:
                        log.warning("cache %s: subscriber %s raised on %s (kept; reported once): %s: %s", self.name,
                                    getattr(fn, "__qualname__", type(fn).__name__), op, type(e).__name__, e)

    # ---- access ----
    def get(self, key: CacheKey) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            self._emit("miss", key)
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        self._emit("hit", key, entry[1])
        return entry[0]

    def peek(self, key: CacheKey) -> Any | None:
        """Look up without counting, reordering or emitting."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[CacheKey]:
        return list(self._entries)

    def put(self, key: CacheKey, value: Any, nbytes: int | None = None) -> bool:
        """Store `value`, evicting least-recently-used entries to fit. Returns False (stores nothing)
        when the value alone exceeds `max_bytes`."""
        if not isinstance(key, CacheKey):
            raise TypeError(f"CacheStore keys must be CacheKey, got {type(key).__name__}")
        size = tensor_nbytes(value) if nbytes is None else int(nbytes)
        if size > self.max_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        while self.stats.bytes + size > self.max_bytes and self._entries:
            self.evict(next(iter(self._entries)))
        self._entries[key] = (value, size)
        self.stats.bytes += size
        self.stats.entries = len(self._entries)
        self.stats.puts += 1
        self._emit("put", key, size)
        return True

    def _drop(self, key: CacheKey) -> int:
        _, size = self._entries.pop(key)
        self.stats.bytes -= size
        self.stats.entries = len(self._entries)
        return size

    def evict(self, key: CacheKey) -> bool:
        if key not in self._entries:
            return False
        size = self._drop(key)
        self.stats.evictions += 1
        self._emit("evict", key, size)
        return True

    def evict_where(self, predicate: Callable[[CacheKey], bool]) -> int:
        doomed = [k for k in self._entries if predicate(k)]
        for k in doomed:
            self.evict(k)
        return len(doomed)

    def clear(self) -> int:
        return self.evict_where(lambda _k: True)

    def reset_stats(self) -> None:
        self.stats = CacheStats(entries=len(self._entries), bytes=self.stats.bytes)


def state_dict_hash(state_dict: Mapping[str, torch.Tensor]) -> str:
    """A weights version: sha256 over sorted key names and each tensor's `content_hash`."""
    h = hashlib.sha256()
    for k in sorted(state_dict):
        h.update(k.encode())
        h.update(content_hash(state_dict[k]).encode())
    return "sha256:" + h.hexdigest()[:32]
