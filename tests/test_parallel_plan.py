"""The parallel runtime outside the models: named plans, family contracts (refused at load with the constraint
named), the plan hash in cache keys, the device mesh, the launcher (exit 2 on a refused plan; torchrun on CPU gives
one process's latents; a rank that dies or hangs fails the run naming it, in bounded time) and the split VAE decode
(exact vs one process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from manifests.cosmos3 import load_variant as cosmos3_variant
from manifests.wan import WanGenerateRequest, load_model_variant
from optimized.models.cosmos3 import PARALLELISM as COSMOS3
from optimized.models.seedvr2 import PARALLELISM as SEEDVR2
from optimized.models.seedvr2.spec import validate_parallel_plan
from optimized.models.wan import FAMILY as WAN_FAMILY
from optimized.models.wan import PARALLELISM as WAN
from optimized.models.wan.instance import WanModelInstance
from optimized.parallel import ParallelMesh, ParallelPlan, ParallelPlanError, build_mesh
from optimized.parallel.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]


# ---- plans -------------------------------------------------------------------------------------------------------

def test_parse_name_hash():
    p = ParallelPlan.parse("cfgp2,ulysses2")
    assert (p.dp, p.cfgp, p.sp_ulysses, p.sp_ring, p.tp) == (1, 2, 2, 1, 1) and p.world_size == 4
    assert p.name() == "cfgp2,ulysses2" and ParallelPlan.parse(p.name()) == p
    assert ParallelPlan.parse("ulysses2xring2") == ParallelPlan(sp_ulysses=2, sp_ring=2)
    assert ParallelPlan.parse("ring2,ulysses2").name() == "ring2,ulysses2"       # mesh order: ring outside ulysses
    assert ParallelPlan.parse("").hash() == "single" == ParallelPlan.parse("cfgp1").hash()
    assert p.hash() != ParallelPlan.parse("cfgp2,ring2").hash() and p.hash().startswith("cfgp2,ulysses2@")
    for bad, why in (("cfgp2,cfgp2", "given twice"), ("foo2", "cannot read"), ("tp0", "positive int")):
        with pytest.raises(ParallelPlanError, match=why):
            ParallelPlan.parse(bad)
    with pytest.raises(ParallelPlanError, match="window SP"):
        ParallelPlan(sp_window=2, sp_ulysses=2)


def test_legacy_form_is_the_same_plan():
    """seedvr2 writes ParallelPlan(((axis, degree), ...), sp_mode=...): read into the named fields."""
    assert ParallelPlan((("sp", 4),)) == ParallelPlan(sp_window=4)
    assert ParallelPlan((("sp", 2),), sp_mode="ulysses").sp_ulysses == 2
    assert ParallelPlan((("sp", 2), ("tp", 2))).degree("tp") == 2
    with pytest.raises(ParallelPlanError, match="window"):
        validate_parallel_plan(ParallelPlan.parse("ulysses2"))                   # seedvr2 keeps refusing Ulysses
    validate_parallel_plan(ParallelPlan.parse("window4"))


# ---- family contracts --------------------------------------------------------------------------------------------

def test_wan_contract_at_released_sizes():
    small, big = load_model_variant("wan2.1-t2v-1.3b"), load_model_variant("wan2.1-t2v-14b")   # 12 and 40 heads
    for plan in ("ulysses2", "ulysses4", "ring2", "tp2", "cfgp2,ulysses2", "ulysses2,ring2"):
        WAN.validate(ParallelPlan.parse(plan), small, require_implemented=False)
    with pytest.raises(ParallelPlanError, match=r"dit.self: 12 heads are not divisible by ulysses x tp = 8 x 1"):
        WAN.validate(ParallelPlan.parse("ulysses8"), small, require_implemented=False)
    WAN.validate(ParallelPlan.parse("ulysses8"), big, require_implemented=False)
    with pytest.raises(ParallelPlanError, match="ffn width 8960 is not divisible by tp = 3"):
        WAN.validate(ParallelPlan.parse("tp3"), small, require_implemented=False)
    WAN.validate(ParallelPlan.parse("tp2"), small)
    with pytest.raises(ParallelPlanError, match="axis dp is admitted by the model's shapes but not wired"):
        WAN.validate(ParallelPlan.parse("dp2"), small)          # admitted, not run yet
    with pytest.raises(ParallelPlanError, match="needs world size 4"):
        WAN.validate(ParallelPlan.parse("cfgp2,ulysses2"), small, world_size=2, require_implemented=False)
    with pytest.raises(ParallelPlanError, match="cfgp=4 exceeds the 2 CFG branches"):
        WAN.validate(ParallelPlan.parse("cfgp4"), small)
    a14b = load_model_variant("wan2.2-t2v-a14b")
    assert {a.name for a in WAN.shapes(a14b).attentions} >= {"dit.self", "dit_2.cross"}       # both experts


def test_cosmos3_gqa_replication_rule_and_seedvr2():
    nano = cosmos3_variant("nano")                                      # 32 heads, 8 KV heads
    for plan in ("ulysses4", "ulysses4,tp2", "ulysses4,tp4"):             # 16 > 8 KV heads: each replicated twice
        COSMOS3.validate(ParallelPlan.parse(plan), nano, require_implemented=False)
    tiny = cosmos3_variant("tiny")                                      # 4 heads, 2 KV heads
    COSMOS3.validate(ParallelPlan.parse("ulysses4"), tiny, require_implemented=False)
    with pytest.raises(ParallelPlanError, match="und: 2 KV heads are not divisible by ulysses x tp = 3, nor"):
        COSMOS3.validate(ParallelPlan.parse("ulysses3"), tiny, require_implemented=False)
    with pytest.raises(ParallelPlanError, match="seedvr2 does not support axis sp_ulysses"):
        SEEDVR2.validate(ParallelPlan.parse("ulysses2"))
    SEEDVR2.validate(ParallelPlan.parse("window4"), world_size=4)
    assert WAN.padded_sequence(13, ParallelPlan.parse("ulysses2,ring2")) == 16


def test_hook_puts_the_plan_hash_in_cache_keys():
    cfg = load_model_variant("tiny-2.1-t2v")
    instance = WanModelInstance.random(cfg, 0)
    ids = torch.tensor([3, 4, 5])
    assert instance.text_encoder.cache_key(ids).parallel_plan_hash == "single"
    plan = ParallelPlan.parse("cfgp2")
    assert WAN_FAMILY.parallelize(instance, SimpleNamespace(plan=plan, world_size=2)) is instance
    key = instance.text_encoder.cache_key(ids)
    assert key.parallel_plan_hash == plan.hash() and key.input_hashes   # the rest of the key is untouched
    with pytest.raises(ParallelPlanError, match="heads are not divisible"):
        WAN_FAMILY.parallelize(instance, SimpleNamespace(plan=ParallelPlan.parse("cfgp2,tp3"), world_size=6))


def test_mesh_at_world_size_1():
    mesh = build_mesh(ParallelPlan())
    assert isinstance(mesh, ParallelMesh) and mesh.axis("ulysses").world_size == 1 and mesh.device_mesh is None
    with pytest.raises(ParallelPlanError, match="launch it with torchrun"):
        build_mesh(ParallelPlan.parse("cfgp2"))


def _launch(*args: str, ranks: int = 0, timeout: float = 180, fault: str = "") -> subprocess.CompletedProcess:
    """The launcher (under torchrun with `ranks`); `fault`: each rank runs it through parity/parallel_faults.py's
    entry, which plants the named patch in that rank first."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks \
        else [sys.executable]
    entry = ["-m", "parity.parallel_faults", fault, "optimized.parallel.launch"] if fault else \
        ["-m", "optimized.parallel.launch"]
    return subprocess.run(cmd + entry + list(args), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_launch_refuses_an_invalid_plan_with_exit_2():
    out = _launch("--variant", "tiny-2.1-t2v", "--plan", "ulysses3", "--request-json", "{}")
    assert out.returncode == 2, out.stderr
    assert "2 heads are not divisible by ulysses x tp = 3" in out.stderr


# ---- torchrun and spawned ranks (dist) ---------------------------------------------------------------------------

def _requests_file(tmp_path: Path) -> str:
    cfg = load_model_variant("tiny-2.1-t2v")
    s, g = cfg.vae.spatial_compression * 2, torch.Generator().manual_seed(1)
    reqs = [WanGenerateRequest(text_ids=torch.randint(1, 128, (7,), generator=g),
                               negative_text_ids=torch.randint(1, 128, (4,), generator=g), num_frames=5, height=2 * s,
                               width=2 * s, num_steps=3, guidance_scale=5.0, seed=7)]
    torch.save(reqs, tmp_path / "requests.pt")
    return str(tmp_path / "requests.pt")


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_cfgp2_generates_the_latents_of_one_process(tmp_path):
    reqs = _requests_file(tmp_path)
    one = _launch("--variant", "tiny-2.1-t2v", "--requests", reqs, "--out", str(tmp_path / "one.pt"))
    two = _launch("--variant", "tiny-2.1-t2v", "--plan", "cfgp2", "--requests", reqs, "--out", str(tmp_path / "two.pt"),
                  "--timeout", "60", ranks=2)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = (torch.load(tmp_path / f, weights_only=False) for f in ("one.pt", "two.pt"))
    assert b["plan"] == "cfgp2" and b["world_size"] == 2 and b["bytes_sent_rank0"] > 0
    x, y = b["results"][0]["latents"]["vision"], a["results"][0]["latents"]["vision"]
    assert float((x - y).norm() / y.norm()) <= 1e-5


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_tp2_from_a_checkpoint_generates_the_latents_of_one_process(tmp_path):
    """--checkpoint with tp2: each rank reads only its DiT shards (the contract's load_sharded)."""
    from parity.families.wan.common import resolve_models
    from parity.families.wan.parallel import write_model_dir

    ckpt = str(write_model_dir(resolve_models(["tiny-2.1-t2v"], None, 0, kinds=("model",))[0], tmp_path / "m"))
    reqs = _requests_file(tmp_path)
    one = _launch("--checkpoint", ckpt, "--requests", reqs, "--out", str(tmp_path / "one.pt"))
    two = _launch("--checkpoint", ckpt, "--plan", "tp2", "--requests", reqs, "--out", str(tmp_path / "two.pt"),
                  "--timeout", "60", ranks=2)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = (torch.load(tmp_path / f, weights_only=False) for f in ("one.pt", "two.pt"))
    assert b["plan"] == "tp2" and b["bytes_sent_rank0"] > 0
    x, y = b["results"][0]["latents"]["vision"], a["results"][0]["latents"]["vision"]
    assert float((x - y).norm() / y.norm()) <= 1e-5


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("fault, named", [("rank-exit:1", "local_rank: 1"),
                                          ("rank-hang:1", "rank 1 is alive but behind")])
def test_a_rank_that_dies_or_hangs_fails_the_run_naming_it(tmp_path, fault, named):
    start = time.monotonic()
    out = _launch("--variant", "tiny-2.1-t2v", "--plan", "cfgp2", "--requests", _requests_file(tmp_path),
                  "--timeout", "8", ranks=2, timeout=120, fault=fault)
    assert out.returncode != 0
    assert named in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    assert time.monotonic() - start < 90


def _vae_worker(group, plan_name: str, axis_name: str) -> dict:
    from optimized.parallel.vae_split import decode_split

    mesh = build_mesh(ParallelPlan.parse(plan_name))
    axis = mesh.axis(axis_name)
    vae = WanModelInstance.random(load_model_variant("tiny-2.1-t2v"), 0).vae
    g = torch.Generator().manual_seed(5)
    zs = [torch.randn(1, vae.cfg.z_dim, t, 4, 4, generator=g) for t in (5, 3)]   # 3 latent frames < 4 ranks
    got = decode_split(vae, zs, axis)
    want = decode_split(vae, zs, mesh.axis("dp")) if axis.rank == 0 else None   # degree 1: the plain chain
    return {"axis_rank": axis.rank, "exact": None if got is None else all(map(torch.equal, got, want)),
            "coords": {a: (x.rank, x.ranks) for a, x in mesh.groups.items()}}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan, axis, ws", [("cfgp2", "cfgp", 2), ("ulysses4", "sp_ulysses", 4),
                                            ("cfgp2,ulysses2", "sp_ulysses", 4)])
def test_split_vae_decode_is_exact_and_mesh_axes(plan, axis, ws):
    res = run_ranks(_vae_worker, ws, (plan, axis), timeout_s=180)
    for r in res:   # the videos land on axis rank 0 of each group, bit-identical to the one-process chain
        assert r["exact"] is (True if r["axis_rank"] == 0 else None), r
    if plan == "cfgp2,ulysses2":   # row-major mesh: ulysses peers adjacent, cfgp peers 2 apart
        assert res[1]["coords"] == {"cfgp": (0, (1, 3)), "sp_ulysses": (1, (0, 1))}
