"""Run the engine across ranks under torchrun; rank 0 (the front rank) takes the requests and writes the results.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m optimized.parallel.launch \\
        --variant tiny-2.1-t2v --plan cfgp2 --requests reqs.pt --out out.pt

Every rank checks the plan against the family's contract before any process group exists (exit 2 with one message
naming the constraint), then joins the group with a collective timeout, builds the mesh, receives the requests
from rank 0, loads the same model (with `--checkpoint` and tp > 1 each rank reads only its tensor-parallel shards:
the family contract's `load_sharded`), attaches the mesh through the family's `parallelize` hook and runs the requests
on its own scheduler (the schedulers stay in lockstep: same requests, same order, deterministic planning). A rank
that dies or hangs ends the run: the waiting ranks' collectives time out or see the peer gone, and the error names
that rank (optimized/parallel/watchdog.py); torchrun then stops the rest. Exit codes: 0 ok, 1 run failed, 2 refused
(a plan the contract refuses, an unknown variant or family, a missing or invalid checkpoint or request file).

`--nproc-per-node N` launches the ranks itself (torch's elastic agent, as torchrun does) after checking the plan,
the model and the requests in this one process first: a refusal is one message and exit 2 before any rank starts,
and the launcher's exit code is the ranks' when they agree (1 when they differ), with one line naming the failed
ranks instead of the agent's traceback. Under a bare torchrun every rank still exits 2 on a setup error (only rank
0 prints it), but torchrun itself reports any failing rank as exit 1.

    python -m optimized.parallel.launch --nproc-per-node 2 --variant tiny-2.1-t2v --plan cfgp2 --requests reqs.pt

`--requests FILE` holds a torch.save'd list of request objects (a trusted local file: loaded with pickle);
`--request-json '{...}'` builds one request of the family's denoise type from JSON (lists become tensors).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

import torch

from optimized.parallel.plan import ParallelPlan, ParallelPlanError

TENSOR_FIELDS = ("text_ids", "negative_text_ids", "noise", "image", "image_embeds")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m optimized.parallel.launch", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--variant", help="a variant with seeded random weights (e.g. tiny-2.1-t2v)")
    src.add_argument("--checkpoint", help="a canonical checkpoint directory (fvconvert output)")
    p.add_argument("--family", help="which family's variant, when several share the name")
    p.add_argument("--seed", type=int, default=0, help="weights seed for --variant")
    p.add_argument("--plan", default="", help="e.g. cfgp2 or cfgp2,ulysses2 (default: one process)")
    p.add_argument("--requests", help="torch.save'd list of requests")
    p.add_argument("--request-json", help="one request of the family's denoise type as JSON")
    p.add_argument("--out", help="rank 0 writes {'results': [...], 'plan': ..., 'seconds': ...} here (torch.save)")
    p.add_argument("--cfg-policy", default="batched", help="CFG policy when cfgp is 1")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    p.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                   help="launch N local ranks (checked here first; exit code = the ranks' when they agree)")
    return p


class SetupError(Exception):
    """A launch refused before any rank computes (exit 2)."""


def _family_and_config(args):
    from optimized.registry import family, family_of_variant

    if args.variant:
        entry = family_of_variant(args.variant, args.family)
        return entry, entry.load_variant(args.variant)
    from manifests.checkpoint import read_checkpoint
    ckpt = read_checkpoint(args.checkpoint)
    return family(ckpt.family), ckpt.typed_config()


def _requests(args, entry) -> list:
    if args.requests:
        return list(torch.load(args.requests, weights_only=False))
    if args.request_json:
        data = json.loads(args.request_json)
        for k in TENSOR_FIELDS:
            if isinstance(data.get(k), list):
                data[k] = torch.tensor(data[k], dtype=torch.int64 if k.endswith("ids") else torch.float32)
        rtype = next(t for t, loop in entry.request_types.items() if loop == "denoise")
        return [rtype(**data)]
    raise SystemExit("error: give --requests FILE or --request-json JSON")


def _check(args, world: int):
    """(plan, family entry) for this launch, or SetupError: the plan against the family's contract, the model (a
    known variant, a readable checkpoint) and the requests, before any process group exists."""
    from manifests.errors import ManifestError
    from optimized.registry import UnknownFamily
    try:
        plan = ParallelPlan.parse(args.plan)
        entry, cfg = _family_and_config(args)
        if entry.parallelize is None:
            if plan.world_size > 1:
                raise ParallelPlanError(f"{entry.name} declares no parallelism; plan {plan.name()} refused")
        elif hasattr(entry.parallelize, "validate"):
            entry.parallelize.validate(plan, cfg, world)      # before any process group: every rank exits 2 alike
        elif plan.world_size != world:
            raise ParallelPlanError(f"plan {plan.name()} needs world size {plan.world_size}; the launch has {world}")
        if not (args.requests or args.request_json):
            raise SetupError("give --requests FILE or --request-json JSON")
        if args.requests and not os.path.isfile(args.requests):
            raise SetupError(f"--requests {args.requests}: no such file")
        _check_requests(args, entry, cfg)
    except (ParallelPlanError, UnknownFamily, ManifestError, OSError, ValueError) as e:
        raise SetupError(str(e).strip("'\"")) from None
    return plan, entry


def _check_requests(args, entry, cfg) -> None:
    """The requests as rank 0 will build them, each of a type the family serves and valid for the model: a bad
    request file is bad input (exit 2 on every rank alike), not a rank failure."""
    where = f"--requests {args.requests}" if args.requests else "--request-json"
    try:
        requests = _requests(args, entry)
    except Exception as e:  # noqa: BLE001 - unpickling / JSON / constructor errors: all bad input
        raise SetupError(f"{where}: not a list of requests ({type(e).__name__}: {e})") from None
    for i, request in enumerate(requests):
        if type(request) not in entry.request_types:
            known = ", ".join(t.__name__ for t in entry.request_types)
            raise SetupError(f"{where}: request {i} is a {type(request).__name__}; {entry.name} serves {known}")
        if hasattr(request, "validate"):
            request.validate(cfg)   # ManifestError (a bound, a shape) -> SetupError above


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    under_torchrun = "LOCAL_RANK" in os.environ
    if args.nproc_per_node and not under_torchrun:
        return launch(args, list(sys.argv[1:] if argv is None else argv))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        plan, entry = _check(args, world)
    except SetupError as e:
        if rank == 0:   # every rank refuses alike: one message
            print(f"error: {e}", file=sys.stderr)
        return 2
    return _run(args, plan, entry, rank, world)


def launch(args, argv: list[str]) -> int:
    """Check here, then run `--nproc-per-node` ranks of this launcher through torch's elastic agent; the ranks'
    exit code when they agree (1 when they differ), one line naming the failed ranks."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    n = args.nproc_per_node
    try:
        if n < 1:
            raise SetupError(f"--nproc-per-node must be >= 1, got {n}")
        _check(args, n)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    child = _without_option(argv, "--nproc-per-node")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)   # the one line below says it
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "optimized.parallel.launch", *child)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in sorted(e.failures.items())}
        agreed = set(codes.values())
        code = agreed.pop() if len(agreed) == 1 and len(codes) == n else 1
        code = code if 0 < code < 128 else 1   # a rank killed by a signal: the run failed
        print(f"launch: {len(codes)} of {n} rank(s) failed: "
              f"{', '.join(f'rank {r} exit {c}' for r, c in codes.items())} (exit {code})", file=sys.stderr)
        return code
    return 0


def _without_option(argv: list[str], name: str) -> list[str]:
    """argv without `name VALUE` / `name=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def _run(args, plan: ParallelPlan, entry, rank: int, world: int) -> int:
    import torch.distributed as dist

    from optimized.engine import Engine
    from optimized.parallel.cfg_parallel import CFGParallel
    from optimized.parallel.group import AxisGroup
    from optimized.parallel.mesh import build_mesh
    from optimized.parallel.watchdog import Watchdog

    watchdog = None
    try:
        if world > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
            watchdog = Watchdog.from_default_group()
        mesh = build_mesh(plan, watchdog=watchdog)
        world_group = AxisGroup.from_world("world")
        world_group.watchdog = watchdog
        requests = _requests(args, entry) if rank == 0 else None
        requests = world_group.broadcast_object(requests, src=0)
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        policy = CFGParallel(mesh.axis("cfgp")) if plan.cfgp > 1 else args.cfg_policy
        kw = dict(cfg_policy=policy, group=mesh.axis("sp_window") if plan.sp_window > 1 else None)
        load_sharded = getattr(entry.parallelize, "load_sharded", None)
        if args.checkpoint and plan.tp > 1 and load_sharded is not None:   # read this rank's tp shards only
            engine = Engine(load_sharded(args.checkpoint, mesh, device), entry, **kw)
        elif args.variant:
            engine = Engine.from_variant(args.variant, args.seed, device=device, family=args.family, **kw)
        else:
            engine = Engine.from_checkpoint(args.checkpoint, device=device, **kw)
        if entry.parallelize is not None:
            entry.parallelize(engine.model, mesh)
        start = time.perf_counter()
        handles = [engine.submit(r) for r in requests]
        engine.run_until_idle()
        results = [h.result() for h in handles]
        seconds = time.perf_counter() - start
        if rank == 0 and args.out:
            torch.save({"results": _to_cpu(results), "plan": plan.name(), "world_size": world, "seconds": seconds,
                        "bytes_sent_rank0": mesh.bytes_sent()}, args.out)
        if rank == 0:
            print(f"ok: {len(results)} request(s), plan {plan.name()} on {world} rank(s), {seconds:.2f} s")
        if watchdog is not None:
            watchdog.mark_exit("ok")
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure leaves one line naming this rank
        msg = f"{type(e).__name__}: {e}"
        if watchdog is not None:
            watchdog.mark_exit(f"failed: {msg.splitlines()[0][:200]}")
        print(f"rank {rank}: error: {msg}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x
