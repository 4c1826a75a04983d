"""One process group per mesh axis (`AxisGroup`; `SPGroup` is its earlier name) over torch.distributed (NCCL on GPU,
gloo on CPU). A degree-1 axis is a trivial group that never calls torch.distributed, so single-device runs need no
process group at all. The plan itself lives in optimized/parallel/plan.py (re-exported here).

Every collective goes through `_run`: counted (calls and bytes this rank sends, optionally logged per call for
tools/bench_parallel.py), announced to a watchdog when one is attached, and turned into one CollectiveError naming
this rank, the axis and (from the watchdog) the peer that died or stopped, instead of a hang or a raw gloo error.

Collectives: a variable-split all_to_all_single (gloo on CPU supports uneven splits, as checked by
tests/test_seedvr2_parallel.py; the same call runs on NCCL), a SUM all-reduce, padded and equal all-gathers and a
ring send/recv step.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from optimized.parallel.plan import AXES, SP_MODES, ParallelPlan, ParallelPlanError  # noqa: F401 (re-exported)


class CollectiveError(RuntimeError):
    """A peer failed or a collective timed out: the run ends with this error instead of hanging."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class AxisGroup:
    """This rank's process group along one mesh axis. `group is None` means degree 1 (no collectives).
    `rank` / `world_size` are within the axis; `ranks` are the members' global ranks in axis order."""

    rank: int = 0
    world_size: int = 1
    group: object | None = None
    backend: str = "none"
    axis: str = "sp"
    ranks: tuple[int, ...] = (0,)
    stats: dict = field(default_factory=lambda: {"all_to_all": 0, "all_reduce": 0, "all_gather": 0, "send": 0,
                                                  "bytes_sent": 0})
    log: list | None = None            # when a list: one (axis, op, tag, bytes sent) per collective (benchmarks)
    tag: str = ""                      # the caller's label for logged calls (e.g. "layer3.self_attn")
    watchdog: Any = None               # has .enter(what) and .diagnose() -> str (optimized/parallel/watchdog.py)

    @classmethod
    def single(cls, axis: str = "sp") -> "AxisGroup":
        return cls(axis=axis)

    @classmethod
    def from_world(cls, axis: str = "sp") -> "AxisGroup":
        """The default (whole-world) process group as one axis."""
        if not dist.is_initialized():
            return cls.single(axis)
        n = dist.get_world_size()
        return cls(dist.get_rank(), n, dist.group.WORLD, dist.get_backend(), axis, tuple(range(n)))

    # a compiled step body breaks its graph here: the collective runs eagerly, with its byte count, watchdog and
    # one clear error (traced into the graph, a failure would surface as a raw gloo / NCCL error)
    @torch.compiler.disable
    def _run(self, what: str, fn, sent: int = 0):
        self.stats["bytes_sent"] += sent
        if self.log is not None:
            self.log.append((self.axis, what, self.tag, sent))
        if self.watchdog is not None:
            self.watchdog.enter(f"{what} on axis {self.axis}")
        try:
            return fn()
        except Exception as e:  # gloo/NCCL raise on a dead peer or a timeout; make it one clear error
            why = self.watchdog.diagnose() if self.watchdog is not None else ""
            raise CollectiveError(f"rank {self.rank}/{self.world_size} of axis {self.axis}: {what} failed "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                                  + (f"; {why}" if why else "")) from e

    def all_to_all(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Variable-split exchange of rows: send_counts[d] rows (in order) go to rank d; recv_counts[r] come from r."""
        out = rows.new_empty((sum(recv_counts),) + tuple(rows.shape[1:]))
        self.stats["all_to_all"] += 1
        sent = (sum(send_counts) - send_counts[self.rank]) * rows[:1].numel() * rows.element_size()
        self._run("all_to_all_single", lambda: dist.all_to_all_single(
            out, rows.contiguous(), output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts),
            group=self.group), sent)
        return out

    def all_to_all_equal(self, chunks: torch.Tensor) -> torch.Tensor:
        """chunks [world_size, ...]: chunk d goes to rank d; returns [world_size, ...] with chunk r from rank r."""
        if self.group is None:
            return chunks
        chunks = chunks.contiguous()
        out = torch.empty_like(chunks)
        self.stats["all_to_all"] += 1
        self._run("all_to_all_single", lambda: dist.all_to_all_single(out, chunks, group=self.group),
                  _nbytes(chunks) // self.world_size * (self.world_size - 1))
        return out

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        x = x.contiguous()
        self.stats["all_reduce"] += 1
        # bytes of a direct (reduce-scatter + all-gather) all-reduce: 2 (n-1)/n of the tensor
        self._run("all_reduce(SUM)", lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group),
                  2 * _nbytes(x) * (self.world_size - 1) // self.world_size)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's same-shape tensor, in axis order."""
        if self.group is None:
            return [x]
        x = x.contiguous()
        bufs = [torch.empty_like(x) for _ in range(self.world_size)]
        self.stats["all_gather"] += 1
        self._run("all_gather", lambda: dist.all_gather(bufs, x, group=self.group),
                  _nbytes(x) * (self.world_size - 1))
        return bufs

    def all_gather_rows(self, rows: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """Every rank's rows (counts known to all), padded to the largest count for the collective."""
        if self.group is None:
            return [rows]
        most = max(counts)
        padded = rows.new_zeros((most,) + tuple(rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        return [b[:n] for b, n in zip(self.all_gather(padded), counts)]

    def ring_shift(self, x: torch.Tensor) -> torch.Tensor:
        """Send x to the next rank of the axis (rank + 1 mod n), receive the previous rank's (same shape)."""
        if self.group is None:
            return x
        x = x.contiguous()
        out = torch.empty_like(x)
        nxt, prv = self.ranks[(self.rank + 1) % self.world_size], self.ranks[(self.rank - 1) % self.world_size]
        self.stats["send"] += 1

        def step():
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, self.group),
                                           dist.P2POp(dist.irecv, out, prv, self.group)])
            for r in reqs:
                r.wait()
        self._run("ring send/recv", step, _nbytes(x))
        return out

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point-to-point to axis rank `dst` (blocking)."""
        self.stats["send"] += 1
        self._run("send", lambda: dist.send(x.contiguous(), self.ranks[dst], group=self.group), _nbytes(x))

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        out = torch.empty_like(like)
        self._run("recv", lambda: dist.recv(out, self.ranks[src], group=self.group))
        return out

    def isend_tensors(self, tensors: dict[str, torch.Tensor], dst: int) -> list:
        """Non-blocking send of named tensors to axis rank `dst` (names, shapes and dtype as a small header, then
        one flat payload). Wait on the returned handles (and keep `tensors` alive) before reusing them."""
        import pickle
        meta = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        header = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(device)
        size = torch.tensor([header.numel()], dtype=torch.int64, device=device)
        dtype = meta[0][2] if meta else torch.float32
        payload = torch.cat([t.reshape(-1).to(dtype) for t in tensors.values()]) if tensors else \
            torch.empty(0, dtype=dtype, device=device)
        self.stats["send"] += 1
        keep = (size, header, payload)
        return self._run("isend", lambda: [dist.isend(t, self.ranks[dst], group=self.group) for t in keep] + [keep],
                         _nbytes(header) + _nbytes(payload) + 8)

    def recv_tensors(self, src: int, device: Any = "cpu") -> dict[str, torch.Tensor]:
        """The named tensors `isend_tensors` sent from axis rank `src`."""
        import pickle

        def recv():
            size = torch.empty(1, dtype=torch.int64, device=device)
            dist.recv(size, self.ranks[src], group=self.group)
            header = torch.empty(int(size), dtype=torch.uint8, device=device)
            dist.recv(header, self.ranks[src], group=self.group)
            meta = pickle.loads(header.cpu().numpy().tobytes())
            total = sum(_numel(shape) for _, shape, _ in meta)
            payload = torch.empty(total, dtype=meta[0][2] if meta else torch.float32, device=device)
            dist.recv(payload, self.ranks[src], group=self.group)
            out, offset = {}, 0
            for k, shape, dtype in meta:
                n = _numel(shape)
                out[k] = payload[offset:offset + n].view(shape).to(dtype)
                offset += n
            return out
        return self._run("recv", recv)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """A picklable object from axis rank `src` to every rank (requests from the front rank)."""
        if self.group is None:
            return obj
        box = [obj if self.rank == src else None]
        self._run("broadcast_object", lambda: dist.broadcast_object_list(box, src=self.ranks[src], group=self.group))
        return box[0]


SPGroup = AxisGroup   # the earlier name (seedvr2's window SP group)


def init_sp_from_env(backend: str | None = None, timeout_s: float = 120.0) -> SPGroup:
    """Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set): init the default group with a timeout, so a dead peer
    ends the run with an error instead of a hang. Without those variables: world size 1."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return SPGroup.single()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return SPGroup.from_world()
