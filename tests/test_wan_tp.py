"""Tensor parallelism in the wan DiT (optimized/models/wan/parallelize.py): the per-key plan, shards cut from loaded
weights equal shards read from a canonical checkpoint (which reads only its slices), the DiT forward under tp2 and
composed plans vs one process on gloo ranks, `fvparity run wan --level C1 --plan tp2` passing, and the
tp-wrong-slice negative control failing with the layer named."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from manifests.checkpoint import load_state, read_checkpoint
from manifests.wan import dit_key_shapes, load_model_variant
from optimized.models.wan import PARALLELISM, parallelize
from optimized.models.wan.instance import WanModelInstance, load_sharded_instance
from optimized.models.wan.transformer import WanDiTFast
from optimized.parallel.group import AxisGroup
from optimized.parallel.launch import run_ranks
from optimized.parallel.mesh import build_mesh
from optimized.parallel.plan import ParallelPlan
from optimized.runtime.spec import apply_load_transforms
from parity.families.wan.common import resolve_models
from parity.families.wan.parallel import write_model_dir

T2V, I2V = "tiny-2.1-t2v", "tiny-2.1-i2v"


def rank_of(r: int, n: int = 2) -> AxisGroup:
    """A tp axis position for slicing only (no collective is called)."""
    return AxisGroup(rank=r, world_size=n, group=object(), axis="tp", ranks=tuple(range(n)))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def dit_inputs(cfg, frames: int = 2, hw: tuple[int, int] = (4, 6)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.in_channels, frames, *hw, generator=g)
    img = torch.randn(2, 3, cfg.image_dim, generator=g) if cfg.has_image_branch else None
    text = torch.randn(2, 512 if cfg.has_image_branch else 12, cfg.text_dim, generator=g)
    return x, torch.tensor([500.0, 900.0]), text, img


# ---- in-process ------------------------------------------------------------------------------------------------

def test_plan_of_every_key():
    cfg = load_model_variant(I2V).dit
    dims = {k: parallelize.tp_dim(k) for k in dit_key_shapes(cfg)}
    assert dims["blocks.0.attn1.to_q.weight"] == dims["blocks.1.attn2.to_v.bias"] == 0
    assert dims["blocks.0.attn2.add_k_proj.weight"] == dims["blocks.0.attn2.norm_added_k.weight"] == 0
    assert dims["blocks.0.attn1.norm_q.weight"] == dims["blocks.0.ffn.net.0.proj.bias"] == 0
    assert dims["blocks.0.attn1.to_out.0.weight"] == dims["blocks.1.ffn.net.2.weight"] == 1
    for replicated in ("blocks.0.attn1.to_out.0.bias", "blocks.0.ffn.net.2.bias", "blocks.0.norm2.weight",
                       "blocks.0.scale_shift_table", "proj_out.weight", "patch_embedding.weight"):
        assert dims[replicated] is None, replicated
    # per block: attn1 and attn2 q / k / v (weight, bias) + norm_q, norm_k; image k / v + norm_added_k; ffn up
    assert sum(d == 0 for d in dims.values()) == 2 * (8 + 8 + 5 + 2) and sum(d == 1 for d in dims.values()) == 6
    shapes = parallelize.sharded_key_shapes(cfg, rank_of(1))
    assert shapes["blocks.0.attn1.to_q.weight"] == (12, 24) and shapes["blocks.0.ffn.net.2.weight"] == (24, 24)
    with pytest.raises(ValueError, match="blocks.0.attn1.to_q.weight.*does not split over tp = 5"):
        parallelize.sharded_key_shapes(cfg, rank_of(0, 5))


def test_shards_of_loaded_weights_equal_shards_of_the_canonical_state():
    """Cutting the loaded (fused) params equals slicing the canonical keys and loading those; the ranks' column
    shards put back together are the whole tensor."""
    cfg = load_model_variant(I2V)
    state = WanModelInstance.random_weights(cfg, 0)["transformer"]
    full = WanDiTFast(cfg.dit, state)
    shards = []
    for r in range(2):
        tp = rank_of(r)
        cut = parallelize.shard_params(full.component, full.params, tp)
        sliced = {k: v if parallelize.tp_slice(k, tuple(v.shape), tp) is None else
                  v.narrow(*parallelize.tp_slice(k, tuple(v.shape), tp)) for k, v in state.items()}
        loaded = apply_load_transforms(parallelize.sharded_component(full.component, cfg.dit, tp), sliced,
                                       dtype=torch.float32)
        assert set(cut) == set(loaded) and all(torch.equal(cut[k], loaded[k]) for k in cut)
        shards.append(cut)
    qkv = full.params["blocks.1.attn1.qkv.weight"].chunk(3)                 # q | k | v rows, each split by heads
    got = [torch.cat([s["blocks.1.attn1.qkv.weight"].chunk(3)[i] for s in shards]) for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, qkv))
    assert torch.equal(torch.cat([s["blocks.0.ffn.net.2.weight"] for s in shards], 1),
                       full.params["blocks.0.ffn.net.2.weight"])


def test_checkpoint_shards_read_only_their_slices(tmp_path, monkeypatch):
    m = resolve_models([T2V], None, 0, kinds=("model",))[0]
    ckpt = read_checkpoint(write_model_dir(m, tmp_path))
    whole = load_state(ckpt, component="transformer")
    reads: list[tuple[tuple[int, ...], int, int]] = []
    from optimized.parallel import tp as tp_primitives   # the one sharded reader (both families)
    real = tp_primitives.read_slice

    def counting(file, offset, dtype, shape, dim, start, length):
        reads.append((tuple(shape), dim, length))
        return real(file, offset, dtype, shape, dim, start, length)
    monkeypatch.setattr(tp_primitives, "read_slice", counting)
    for r in range(2):
        tp = rank_of(r)
        got = parallelize.read_sharded_state(ckpt, "transformer", m.cfg.dit, tp)
        for k, v in whole.items():
            sl = parallelize.tp_slice(k, tuple(v.shape), tp)
            assert torch.equal(got[k], v if sl is None else v.narrow(*sl)), k
    sharded = [(s, d, n) for s, d, n in reads if n != s[d]]
    assert len(sharded) == 2 * sum(parallelize.tp_dim(k) is not None for k in whole)
    assert all(n * 2 == s[d] for s, d, n in sharded)                   # half of each sharded tensor, never all


# ---- on gloo ranks ---------------------------------------------------------------------------------------------

def _forward_worker(group, runs: list[tuple[str, str, dict, str | None]]) -> list[torch.Tensor]:
    """Per run (plan, variant, dit config changes, checkpoint dir or None): this rank's DiT output."""
    out = []
    for plan_name, variant, changes, ckpt in runs:
        mesh = build_mesh(ParallelPlan.parse(plan_name))
        cfg = load_model_variant(variant)
        cfg = replace(cfg, dit=replace(cfg.dit, **changes))
        instance = load_sharded_instance(ckpt, mesh) if ckpt else WanModelInstance.random(cfg, 0)
        PARALLELISM(instance, mesh)
        out.append(instance.dit.forward_batch(*dit_inputs(cfg.dit)))
    return out


def _one_process(variant: str, changes: dict, ckpt: str | None = None) -> torch.Tensor:
    cfg = load_model_variant(variant)
    cfg = replace(cfg, dit=replace(cfg.dit, **changes))
    if ckpt:
        dit = WanDiTFast(cfg.dit, load_state(read_checkpoint(ckpt), component="transformer"))
    else:
        dit = WanModelInstance.random(cfg, 0).dit
    return dit.forward_batch(*dit_inputs(cfg.dit))


@pytest.mark.dist
def test_tp2_dit_forward_equals_one_process(tmp_path):
    """tp2 on 2 gloo ranks: the t2v DiT re-sharded from loaded weights, and the i2v DiT (image K/V too) read as
    shards from a canonical checkpoint; every rank's output equals one process within fp32 noise."""
    m = resolve_models([I2V], None, 0, kinds=("model",))[0]
    ckpt = str(write_model_dir(m, tmp_path))
    runs = [("tp2", T2V, {}, None), ("tp2", I2V, {}, ckpt)]
    res = run_ranks(_forward_worker, 2, (runs,), timeout_s=240)
    want = [_one_process(T2V, {}), _one_process(I2V, {}, ckpt)]
    for rank in res:
        for got, w in zip(rank, want):
            assert rel(got, w) < 1e-6, rel(got, w)


@pytest.mark.dist
@pytest.mark.slow
def test_four_rank_plans_dit_forward_equals_one_process():
    """World size 4 (a 4-head DiT where heads must split 4 ways): ulysses4, ulysses2 x tp2, ulysses2 x ring2,
    cfgp2 x tp2 (cfgp ranks run the whole batch here), tp2 x ring2."""
    four = {"num_heads": 4, "head_dim": 6}
    plans = ["ulysses4", "ulysses2,tp2", "ulysses2,ring2", "cfgp2,tp2", "ring2,tp2"]
    res = run_ranks(_forward_worker, 4, ([(p, T2V, four, None) for p in plans],), timeout_s=400)
    want = _one_process(T2V, four)
    for rank in res:
        for plan, got in zip(plans, rank):
            assert rel(got, want) < 1e-6, (plan, rel(got, want))


def c1(plan: str, fault: str | None = None):
    from parity.families.wan.c1 import run_c1
    return run_c1([T2V], None, "cpu", ["fp32"], 0, fault, lambda msg: None, plan=plan)


@pytest.mark.dist
@pytest.mark.slow
def test_c1_tp2_passes_and_wrong_slice_fails_naming_the_layer():
    report = c1("tp2")
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    assert any("/rank1/" in c.name and c.name.endswith("/vs_one_process") for c in report.checks)
    bad = [c for c in c1("tp2", fault="tp-wrong-slice").checks if not c.passed]
    assert bad, "C1 passed with a TP shard from the wrong slice"
    assert any("step 0, cond branch, layer blocks.1" in (c.divergence or "") for c in bad), \
        [(c.name, c.divergence) for c in bad][:6]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["ulysses2,ring2", "cfgp2,tp2"])
def test_c1_four_rank_plans_pass(plan):
    report = c1(plan)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    assert any("/rank3/" in c.name for c in report.checks)


@pytest.mark.dist
@pytest.mark.slow
def test_c1_ulysses4_on_a_four_head_checkpoint(tmp_path):
    """The checkpoint path at world size 4 (the variant path is tests/test_wan_sp.py, tiny-2.1-t2v-4h): a 4-head model
    written as a canonical checkpoint runs `fvparity run wan --level C1 --checkpoint DIR --plan ulysses4` on 4 ranks."""
    from parity.families.wan.c1 import run_c1
    from parity.families.wan.common import ModelUnderTest, random_model_weights

    cfg = load_model_variant(T2V)
    cfg = replace(cfg, dit=replace(cfg.dit, num_heads=4, head_dim=6))
    ckpt = write_model_dir(ModelUnderTest("tiny-2.1-t2v-4heads", "model", cfg, random_model_weights(cfg, 0)), tmp_path)
    report = run_c1([], str(ckpt), "cpu", ["fp32"], 0, None, lambda msg: None, plan="ulysses4")
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed][:5]
    assert any("/rank3/" in c.name and "/dit_step" in c.name for c in report.checks)
