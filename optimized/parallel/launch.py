"""Spawn N local ranks (gloo on CPU by default) running one function, with a deadline: a rank that raises, dies
or overruns ends the whole run with a CollectiveError naming it, never a hang. Used by tests and fvparity."""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optimized.parallel.group import CollectiveError, SPGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn: Callable, args: tuple,
            results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(SPGroup.from_world(), *args)
            buf = io.BytesIO()
            torch.save(value, buf)  # bytes, not shared-memory handles: the worker may exit before the parent reads
            results.put((rank, "ok", buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent as text
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout_s: float = 120.0,
              backend: str = "gloo") -> list[Any]:
    """Run fn(group, *args) on `world_size` spawned ranks; return the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout_s, fn, args, results),
                         daemon=True) for r in range(world_size)]
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s + 30
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in out]
                if dead:
                    raise CollectiveError(f"rank {dead[0]} of {world_size} died (exit code {procs[dead[0]].exitcode})")
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in out]
                    raise CollectiveError(f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s")
                continue
            if status == "error":
                raise CollectiveError(f"rank {rank} of {world_size} failed: {value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except BaseException:
        for p in procs:  # a failed run: stop the peers now, they may be blocked in a collective
            if p.is_alive():
                p.terminate()
        raise
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(world_size)]


if __name__ == "__main__":  # torchrun ... -m optimized.parallel.launch: the engine across ranks
    from optimized.parallel.launch_engine import main

    raise SystemExit(main())
