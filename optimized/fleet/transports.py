"""How a TransferManifest's tensors move between role workers: one `Transport` protocol, three implementations.

    handle = transport.send(manifest, tensors)      # the producer: copies each entry out in manifest.chunks pieces
    manifest, tensors = transport.recv(handle)      # the consumer: reassembles, manifest.check(tensors), releases
    transport.bytes_moved                           # tensor bytes sent through this transport object

A handle is small plain data (it crosses a process pipe); the data stays in the transport's medium until `recv`
consumes it, exactly once (a second recv of the same handle is a TransferError on `completion_event_id`).

  InProcessTransport     a dict in this process (threads, tests): the pieces are copies, never the producer's tensors
  SharedMemoryTransport  one `multiprocessing.shared_memory` segment per chunk; recv copies out, closes and unlinks
                         each (`live_segments()` is empty after consumption: no /dev/shm leak)
  TorchDistTransport     point-to-point torch.distributed send/recv (gloo on CPU, NCCL on GPU) between two ranks
                         of an initialised process group; the manifest travels as a pickled uint8 header

Faults are injected by wrapping (`FaultyTransport`): the parity harness's negative controls drop a chunk or cast a
tensor in transit, and the consumer's checks must name the manifest field.
"""

from __future__ import annotations

import itertools
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from optimized.fleet.transfer import (
    DEFAULT_CHUNK_BYTES,
    TransferError,
    TransferManifest,
    from_chunks,
    to_chunks,
)


class Transport(Protocol):
    bytes_moved: int

    def send(self, manifest: TransferManifest, tensors: dict[str, torch.Tensor]) -> Any: ...

    def recv(self, handle: Any) -> tuple[TransferManifest, dict[str, torch.Tensor]]: ...


def _pieces(manifest: TransferManifest, tensors: dict[str, torch.Tensor], chunk_bytes: int) -> dict[str, list]:
    manifest.check(tensors)           # the producer sends only what it declares
    return {e.name: to_chunks(e, tensors[e.name], chunk_bytes) for e in manifest.entries}


def _assemble(manifest: TransferManifest, pieces: dict[str, list]) -> dict[str, torch.Tensor]:
    out = {}
    for e in manifest.entries:
        if e.name not in pieces:
            raise TransferError(f"entries[{e.name}]", "missing from the received tensors")
        out[e.name] = from_chunks(manifest, e.name, pieces[e.name])
    manifest.check(out)
    return out


class InProcessTransport:
    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.chunk_bytes, self.bytes_moved = chunk_bytes, 0
        self._held: dict[int, tuple[TransferManifest, dict[str, list]]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def send(self, manifest, tensors):
        pieces = {n: [p.clone() for p in ps] for n, ps in _pieces(manifest, tensors, self.chunk_bytes).items()}
        with self._lock:
            handle = next(self._ids)
            self._held[handle] = (manifest, pieces)
            self.bytes_moved += manifest.nbytes
        return handle

    def recv(self, handle):
        with self._lock:
            if handle not in self._held:
                raise TransferError("completion_event_id", f"transfer {handle!r} was already consumed or never sent")
            manifest, pieces = self._held.pop(handle)
        return manifest, _assemble(manifest, pieces)

    def pending(self) -> int:
        return len(self._held)


@dataclass(frozen=True)
class ShmHandle:
    manifest: TransferManifest
    segments: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]   # (entry name, ((segment name, nbytes), ...))


def _untrack(name: str) -> None:
    """The consumer, not this process's resource tracker, releases a segment (the tracker would unlink it when the
    producer exits, or warn about a 'leak' the consumer already released)."""
    from multiprocessing import resource_tracker
    try:
        resource_tracker.unregister(f"/{name.lstrip('/')}", "shared_memory")
    except Exception:  # noqa: BLE001, S110 - not registered (a platform without the tracker)
        pass


class SharedMemoryTransport:
    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.chunk_bytes, self.bytes_moved = chunk_bytes, 0
        self._created: set[str] = set()          # segments this object created that no recv has released yet

    def send(self, manifest, tensors):
        from multiprocessing import shared_memory
        segments = []
        for name, pieces in _pieces(manifest, tensors, self.chunk_bytes).items():
            made = []
            for p in pieces:
                n = p.numel()
                shm = shared_memory.SharedMemory(create=True, size=max(1, n))
                _untrack(shm.name)
                if n:
                    torch.frombuffer(shm.buf, dtype=torch.uint8, count=n).copy_(p)
                made.append((shm.name, n))
                self._created.add(shm.name)
                shm.close()
            segments.append((name, tuple(made)))
        self.bytes_moved += manifest.nbytes
        return ShmHandle(manifest, tuple(segments))

    def recv(self, handle: ShmHandle):
        from multiprocessing import shared_memory
        pieces: dict[str, list] = {}
        try:
            for name, made in handle.segments:
                got = pieces[name] = []
                for seg, n in made:
                    try:
                        shm = shared_memory.SharedMemory(name=seg)
                    except FileNotFoundError:
                        raise TransferError("completion_event_id", f"segment {seg} of {name} was already consumed "
                                                                   f"or never sent") from None
                    got.append(torch.frombuffer(shm.buf, dtype=torch.uint8, count=n).clone() if n else
                               torch.empty(0, dtype=torch.uint8))
                    shm.close()
                    shm.unlink()
                    self._created.discard(seg)
        finally:
            release(handle)          # a failed recv still frees every segment of the transfer
        return handle.manifest, _assemble(handle.manifest, pieces)

    def live_segments(self) -> set[str]:
        """Segments this object created and no recv released (in this process; [] after every consume)."""
        return {s for s in self._created if segment_exists(s)}


def segment_exists(name: str) -> bool:
    from multiprocessing import shared_memory
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    _untrack(shm.name)
    shm.close()
    return True


def release(handle: ShmHandle) -> None:
    """Unlink every segment of a transfer that still exists (abandoned transfers, failed receives)."""
    from multiprocessing import shared_memory
    for _, made in handle.segments:
        for seg, _n in made:
            try:
                shm = shared_memory.SharedMemory(name=seg)
            except FileNotFoundError:
                continue
            shm.close()
            shm.unlink()              # unlink also unregisters the attach's tracker entry


@dataclass(frozen=True)
class DistHandle:
    src: int
    seq: int


class TorchDistTransport:
    """Between ranks of an initialised process group: `send(manifest, tensors, dst=...)` on the producer rank, then
    `recv(DistHandle(src, seq))` on the consumer (messages between two ranks arrive in send order)."""

    def __init__(self, peer: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.peer, self.chunk_bytes, self.bytes_moved = peer, chunk_bytes, 0
        self._seq = itertools.count()
        self._expect = 0

    def send(self, manifest, tensors):
        import torch.distributed as dist
        header = torch.frombuffer(bytearray(pickle.dumps(manifest)), dtype=torch.uint8)
        dist.send(torch.tensor([header.numel()], dtype=torch.int64), self.peer)
        dist.send(header, self.peer)
        for e in manifest.entries:
            for p in to_chunks(e, tensors[e.name], self.chunk_bytes):
                if p.numel():
                    dist.send(p.contiguous(), self.peer)
        self.bytes_moved += manifest.nbytes
        return DistHandle(dist.get_rank(), next(self._seq))

    def recv(self, handle: DistHandle | None = None):
        import torch.distributed as dist
        src = self.peer if handle is None else handle.src
        if handle is not None and handle.seq != self._expect:
            raise TransferError("completion_event_id", f"transfer #{handle.seq} from rank {src} is out of order "
                                                       f"(next is #{self._expect})")
        n = torch.zeros(1, dtype=torch.int64)
        dist.recv(n, src)
        header = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(header, src)
        manifest: TransferManifest = pickle.loads(header.numpy().tobytes())
        pieces: dict[str, list] = {}
        for e in manifest.entries:
            step = -(-e.nbytes // e.chunks) if e.nbytes else 0
            got = pieces[e.name] = []
            for i in range(e.chunks):
                size = min(step, e.nbytes - i * step)
                buf = torch.empty(max(0, size), dtype=torch.uint8)
                if size > 0:
                    dist.recv(buf, src)
                got.append(buf)
        self._expect += 1
        return manifest, _assemble(manifest, pieces)


# ------------------------------------------------------------------------------------------- planted faults
class FaultyTransport:
    """A transport that damages what it carries (negative controls): `drop_last_chunk` of the named entry (or the
    largest), or `cast` an entry to another dtype in transit. The manifest is untouched: the consumer must notice."""

    def __init__(self, inner: Any, *, drop_last_chunk: str | None = None, cast: tuple[str, torch.dtype] | None = None,
                 only_stage: str | None = None):
        self.inner, self.drop_last_chunk, self.cast, self.only_stage = inner, drop_last_chunk, cast, only_stage

    @property
    def bytes_moved(self) -> int:
        return self.inner.bytes_moved

    def send(self, manifest, tensors):
        return self.inner.send(manifest, tensors)

    def recv(self, handle):
        if not isinstance(self.inner, InProcessTransport):
            raise TypeError("FaultyTransport damages in-process transfers only")
        manifest, pieces = self.inner._held[handle]
        if self.only_stage in (None, manifest.stage):
            target = lambda want: want if want != "*" else max(manifest.entries, key=lambda e: e.nbytes).name
            if self.drop_last_chunk is not None:
                name = target(self.drop_last_chunk)
                pieces[name] = pieces[name][:-1]
            if self.cast is not None:
                # the tensor arrives under its new dtype (a transport that "helpfully" converts); the manifest is
                # the producer's: the consumer's check must catch it
                name, dtype = target(self.cast[0]), self.cast[1]
                self.inner._held.pop(handle)
                out = {e.name: from_chunks(manifest, e.name, pieces[e.name]) for e in manifest.entries}
                out[name] = out[name].to(dtype)
                manifest.check(out)
                return manifest, out
        return self.inner.recv(handle)
