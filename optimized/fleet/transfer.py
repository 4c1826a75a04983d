"""What crosses between two role processes: a typed `TransferManifest` (the contract) and its tensors (the data).

A stage's output is any plain Python value (a request dataclass, a dict of latents, ...). `pack` cuts it into

    tensors     {dotted name: contiguous tensor}         every tensor inside the value ("request.text_ids", ...)
    structure   the value with each tensor replaced by a TensorRef(name) (plain data, picklable)
    manifest    TransferManifest(request_id, stage, producer, consumer, entries, lifetime, cache_key,
                                 completion_event_id, structure)

and `unpack(manifest, tensors)` puts it back together after `manifest.check(tensors)`: every entry present, no
extra tensor, and shape / dtype / layout / nbytes as declared; a disagreement is one `TransferError` whose message
starts with the field (`entries[latents.vision].dtype: declared torch.float32, received torch.bfloat16`). A
transport moves each entry in `chunks` pieces of at most `chunk_bytes`; it calls `check_chunks` before reassembling
(a dropped chunk is `entries[NAME].chunks`, never a short tensor).

`cache_key` is the content hash of the stage input the manifest's tensors were computed from (`content_key`): a
consumer that serves the stage from a resident entry checks that the entry was produced for the same key
(`check_cache_entry`), so a stale entry routed to the wrong replica is `cache_key`, not a wrong video.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

LAYOUT = "contiguous"                 # the only layout that crosses: row-major, no strides, no views
LIFETIMES = ("consume_once", "cached")  # consume_once: released by the consumer's recv; cached: also held resident
DEFAULT_CHUNK_BYTES = 1 << 20


class TransferError(ValueError):
    """A transfer that does not match its manifest; `.field` is the manifest field that disagrees."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor was in a packed value."""
    name: str


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str                        # "torch.float32": a string so the manifest pickles without torch objects
    layout: str
    nbytes: int
    chunks: int                       # pieces the transport moves it in

    @staticmethod
    def of(name: str, t: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TensorEntry:
        nbytes = t.numel() * t.element_size()
        return TensorEntry(name, tuple(t.shape), str(t.dtype), LAYOUT, nbytes, max(1, -(-nbytes // chunk_bytes)))


@dataclass(frozen=True)
class TransferManifest:
    request_id: str
    stage: str                        # the program stage that produced it ("encode", "denoise", "decode", "request")
    producer: str                     # role (or replica id) that sent it
    consumer: str                     # role that must receive it
    entries: tuple[TensorEntry, ...]
    lifetime: str = "consume_once"
    cache_key: str | None = None
    completion_event_id: str = ""     # the producer's "<request>/<stage>.done": the consumer may start after it
    structure: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.lifetime not in LIFETIMES:
            raise TransferError("lifetime", f"must be one of {LIFETIMES}, got {self.lifetime!r}")
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names):
            raise TransferError("entries", f"duplicate tensor names {sorted(n for n in names if names.count(n) > 1)}")

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def entry(self, name: str) -> TensorEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise TransferError(f"entries[{name}]", "not in the manifest")

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise TransferError naming the first field the received tensors disagree with."""
        for e in self.entries:
            where = f"entries[{e.name}]"
            t = tensors.get(e.name)
            if t is None:
                raise TransferError(where, "missing from the received tensors")
            if tuple(t.shape) != e.shape:
                raise TransferError(f"{where}.shape", f"declared {list(e.shape)}, received {list(t.shape)}")
            if str(t.dtype) != e.dtype:
                raise TransferError(f"{where}.dtype", f"declared {e.dtype}, received {t.dtype}")
            if not t.is_contiguous():
                raise TransferError(f"{where}.layout", f"declared {e.layout}, received strides {t.stride()}")
            if t.numel() * t.element_size() != e.nbytes:
                raise TransferError(f"{where}.nbytes", f"declared {e.nbytes}, received {t.numel() * t.element_size()}")
        extra = sorted(set(tensors) - {e.name for e in self.entries})
        if extra:
            raise TransferError("entries", f"received tensors the manifest does not declare: {extra}")

    def check_chunks(self, name: str, received: int) -> None:
        e = self.entry(name)
        if received != e.chunks:
            raise TransferError(f"entries[{name}].chunks", f"declared {e.chunks}, received {received}")

    def check_cache_entry(self, resident: TransferManifest) -> None:
        """A resident entry may serve this manifest's stage only when it was produced for the same input."""
        if resident.cache_key != self.cache_key:
            raise TransferError("cache_key", f"resident entry was produced for {resident.cache_key}, the request's "
                                             f"input hashes to {self.cache_key} (stale entry on this replica)")


# ------------------------------------------------------------------------------------------- pack / unpack a value
def _flatten(value: Any, prefix: str, out: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().contiguous()
        return TensorRef(prefix)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            s = _flatten(v, f"{prefix}.{f.name}", out)
            if s is not v:
                changed[f.name] = s
        if not changed:
            return value
        clone = object.__new__(type(value))       # no __init__ / __post_init__: a frozen request is copied as is
        clone.__dict__.update(value.__dict__)
        clone.__dict__.update(changed)
        return clone
    if isinstance(value, dict):
        return {k: _flatten(v, f"{prefix}.{k}", out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_flatten(v, f"{prefix}.{i}", out) for i, v in enumerate(value)]
        return type(value)(items) if type(value) in (list, tuple) else type(value)(*items)
    return value


def _fill(structure: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(structure, TensorRef):
        return tensors[structure.name]
    if dataclasses.is_dataclass(structure) and not isinstance(structure, type):
        changed = {f.name: _fill(getattr(structure, f.name), tensors) for f in dataclasses.fields(structure)}
        clone = object.__new__(type(structure))
        clone.__dict__.update(structure.__dict__)
        clone.__dict__.update(changed)
        return clone
    if isinstance(structure, dict):
        return {k: _fill(v, tensors) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        items = [_fill(v, tensors) for v in structure]
        return type(structure)(items) if type(structure) in (list, tuple) else type(structure)(*items)
    return structure


def content_key(tensors: dict[str, torch.Tensor], *salt: Any) -> str:
    """sha256 over the tensors' names, shapes, dtypes and bytes (+ salt: e.g. the weights version)."""
    h = hashlib.sha256(repr(salt).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{list(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


def pack(value: Any, *, request_id: str, stage: str, producer: str, consumer: str, lifetime: str = "consume_once",
         cache_key: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         prefix: str = "out") -> tuple[TransferManifest, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(value, prefix, tensors)
    entries = tuple(TensorEntry.of(n, t, chunk_bytes) for n, t in tensors.items())
    return TransferManifest(request_id, stage, producer, consumer, entries, lifetime, cache_key,
                            f"{request_id}/{stage}.done", structure), tensors


def unpack(manifest: TransferManifest, tensors: dict[str, torch.Tensor]) -> Any:
    manifest.check(tensors)
    return _fill(manifest.structure, tensors)


# ------------------------------------------------------------------------------ chunks: what a transport moves
def to_chunks(entry: TensorEntry, t: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    """The tensor's bytes in `entry.chunks` uint8 pieces (views: the transport copies them)."""
    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    step = max(1, -(-entry.nbytes // entry.chunks)) if entry.nbytes else 1
    pieces = [flat[i:i + step] for i in range(0, entry.nbytes, step)] or [flat]
    return pieces


def from_chunks(manifest: TransferManifest, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    manifest.check_chunks(name, len(pieces))
    e = manifest.entry(name)
    data = torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
    if data.numel() != e.nbytes:
        raise TransferError(f"entries[{name}].nbytes", f"declared {e.nbytes}, received {data.numel()}")
    dtype = getattr(torch, e.dtype.removeprefix("torch."))
    return data.view(dtype).reshape(e.shape) if e.nbytes else torch.empty(e.shape, dtype=dtype)
