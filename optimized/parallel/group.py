"""Process groups for the v2 runtime: a ParallelPlan with named axes, validated at load, and a small SP group
wrapper over torch.distributed (NCCL on GPU, gloo on CPU). A degree-1 axis is a trivial group that never calls
torch.distributed, so single-device runs need no process group at all.

Collectives used by window-aligned SP: a variable-split all_to_all_single (gloo on CPU supports uneven splits, as
checked by tests/test_seedvr2_parallel.py; the same call runs on NCCL), a SUM all-reduce and a padded all-gather.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

AXES = ("dp", "tp", "sp", "cfgp")
SP_MODES = ("window", "ulysses", "ring", "allgather", "advanced_uaa", "ulysses_a2a_permute")


class ParallelPlanError(ValueError):
    """A ParallelPlan that a component or loop cannot run (raised at load time, never mid-run)."""


class CollectiveError(RuntimeError):
    """A peer failed or a collective timed out: the run ends with this error instead of hanging."""


@dataclass(frozen=True)
class ParallelPlan:
    """Named parallel axes and their degrees; `sp_mode` says how the sp axis is realised."""

    degrees: tuple[tuple[str, int], ...] = (("sp", 1),)
    sp_mode: str = "window"

    def degree(self, axis: str) -> int:
        return dict(self.degrees).get(axis, 1)

    @property
    def world_size(self) -> int:
        n = 1
        for _, d in self.degrees:
            n *= d
        return n

    def validate(self, supported_axes: tuple[str, ...] = AXES, supported_sp_modes: tuple[str, ...] = SP_MODES,
                 who: str = "model") -> "ParallelPlan":
        names = [a for a, _ in self.degrees]
        if len(set(names)) != len(names):
            raise ParallelPlanError(f"ParallelPlan: duplicate axes {names}")
        for axis, deg in self.degrees:
            if axis not in AXES:
                raise ParallelPlanError(f"ParallelPlan: unknown axis {axis!r}; known: {', '.join(AXES)}")
            if not isinstance(deg, int) or deg < 1:
                raise ParallelPlanError(f"ParallelPlan: axis {axis} degree must be a positive int, got {deg!r}")
            if deg > 1 and axis not in supported_axes:
                raise ParallelPlanError(f"{who} does not support parallel axis {axis!r} (degree {deg}); "
                                        f"supported: {', '.join(supported_axes)}")
        if self.sp_mode not in supported_sp_modes:
            raise ParallelPlanError(f"{who} rejects sp_mode {self.sp_mode!r}; supported: "
                                    f"{', '.join(supported_sp_modes)}")
        return self

    def signature(self) -> str:
        return ",".join(f"{a}={d}" for a, d in sorted(self.degrees)) + f";sp_mode={self.sp_mode}"


@dataclass
class SPGroup:
    """The sequence-parallel group of this rank. `group is None` means world size 1 (no collectives)."""

    rank: int = 0
    world_size: int = 1
    group: object | None = None
    backend: str = "none"
    stats: dict = field(default_factory=lambda: {"all_to_all": 0, "all_reduce": 0, "all_gather": 0,
                                                  "bytes_sent": 0})

    @classmethod
    def single(cls) -> "SPGroup":
        return cls()

    @classmethod
    def from_world(cls) -> "SPGroup":
        """The default (whole-world) process group as the SP group."""
        if not dist.is_initialized():
            return cls.single()
        return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, dist.get_backend())

    def _run(self, what: str, fn):
        try:
            return fn()
        except Exception as e:  # gloo/NCCL raise on a dead peer or a timeout; make it one clear error
            raise CollectiveError(f"rank {self.rank}/{self.world_size}: {what} failed ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from e

    def all_to_all(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Variable-split exchange of rows: send_counts[d] rows (in order) go to rank d; recv_counts[r] come from r."""
        out = rows.new_empty((sum(recv_counts),) + tuple(rows.shape[1:]))
        self.stats["all_to_all"] += 1
        self.stats["bytes_sent"] += (sum(send_counts) - send_counts[self.rank]) * rows[:1].numel() * rows.element_size()
        self._run("all_to_all_single", lambda: dist.all_to_all_single(
            out, rows.contiguous(), output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts),
            group=self.group))
        return out

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        x = x.contiguous()
        self.stats["all_reduce"] += 1
        self._run("all_reduce(SUM)", lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group))
        return x

    def all_gather_rows(self, rows: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """Every rank's rows (counts known to all), padded to the largest count for the collective."""
        if self.group is None:
            return [rows]
        most = max(counts)
        padded = rows.new_zeros((most,) + tuple(rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        bufs = [torch.empty_like(padded) for _ in range(self.world_size)]
        self.stats["all_gather"] += 1
        self._run("all_gather", lambda: dist.all_gather(bufs, padded, group=self.group))
        return [b[:n] for b, n in zip(bufs, counts)]


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
