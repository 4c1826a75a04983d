"""Unit tests of the optimized cosmos3 side on its own (no reference, no upstream): runtime caches and
specs, the strict loader and its declared transforms, the packer against hand-computed ids, batching
invariance, the und-stream cache, conditioned outputs, traces and the fault-planting seams."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from manifests.cosmos3.config import load_variant
from manifests.cosmos3.io import Cosmos3ForwardInputs
from manifests.cosmos3.keys import canonical_key_shapes
from optimized.models.cosmos3 import Cosmos3Fast, cosmos3_model_spec, ops, pack_layout, packing, run_layer
from optimized.runtime import (
    CacheContract, CacheEvent, CacheKey, CacheStore, CheckpointError, MissingKeyError, ShapeMismatchError, SpecError,
    UnexpectedKeyError, apply_load_transforms, content_hash,
)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("tiny", "tiny-edge")


# ---------------------------------------------------------------- helpers (test-only)
def random_canonical_state_dict(cfg, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in canonical_key_shapes(cfg).items():
        if k.endswith("norm.weight"):
            sd[k] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            sd[k] = 0.2 * torch.randn(shape, generator=g)
    return sd


def make_inputs(cfg, seed, L, T, H, W, *, cond=(), sound_T=None, action_T=None, arows=(), dom=1, t=937.0,
                fps=24.0, fps_sound=25.0) -> Cosmos3ForwardInputs:
    g = torch.Generator().manual_seed(seed)
    return Cosmos3ForwardInputs(
        text_ids=torch.randint(0, cfg.vocab_size, (L,), generator=g),
        vision_latents=torch.randn(1, cfg.latent_channels, T, H, W, generator=g),
        timestep=t, fps_vision=fps, vision_condition_frames=tuple(cond),
        sound_latents=torch.randn(cfg.sound_dim, sound_T, generator=g) if sound_T else None,
        fps_sound=fps_sound if sound_T else None,
        action_latents=torch.randn(action_T, cfg.action_dim, generator=g) if action_T else None,
        action_condition_rows=tuple(arows), action_domain_id=dom if action_T else None)


def three_samples(cfg):
    snd = cfg.has_sound
    return [
        make_inputs(cfg, 1, 11, 3, 5, 6, cond=(0,), sound_T=7 if snd else None, action_T=4, arows=(0, 1), dom=2),
        make_inputs(cfg, 2, 5, 1, 4, 4, t=999.0),
        make_inputs(cfg, 3, 17, 4, 3, 7, cond=(0, 2), fps=16.0, action_T=5, dom=3, sound_T=3 if snd else None, t=12.0),
    ]


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module", params=VARIANTS)
def setup(request):
    cfg = load_variant(request.param)
    sd = random_canonical_state_dict(cfg, 0)
    return cfg, sd


# ---------------------------------------------------------------- runtime: CacheKey / CacheStore
def _key(**kw):
    base = dict(model_id="m", component_id="c", weights_version="w1", precision="float32", shape_signature="s",
                layout_signature="l", cache_contract_version="v1")
    base.update(kw)
    return CacheKey(**base)


def test_cache_key_sorted_hashable_and_validated():
    a = _key(input_hashes={"b": "2", "a": "1"})
    b = _key(input_hashes=[("a", "1"), ("b", "2")])
    assert a == b and hash(a) == hash(b) and a.input_hashes == (("a", "1"), ("b", "2"))
    assert _key(step_index=3) != _key(step_index=4)
    with pytest.raises(ValueError, match="weights_version"):
        _key(weights_version="")
    with pytest.raises(ValueError, match="step_index"):
        _key(step_index=-1)


def test_content_hash_sees_bytes_dtype_and_shape():
    x = torch.arange(6, dtype=torch.int64)
    assert content_hash(x) == content_hash(x.clone())
    assert content_hash(x) != content_hash(x.to(torch.int32))
    assert content_hash(x) != content_hash(x.view(2, 3))
    y = x.clone()
    y[3] = 7
    assert content_hash(x) != content_hash(y)
    assert content_hash(torch.ones(3, dtype=torch.bfloat16)) != content_hash(torch.ones(3, dtype=torch.float16))


def test_cache_store_lru_by_bytes_counters_and_events():
    store = CacheStore(max_bytes=3 * 400, name="t")
    events: list[CacheEvent] = []
    unsubscribe = store.subscribe(events.append)
    k = [_key(input_hashes={"x": str(i)}) for i in range(4)]
    v = [torch.zeros(100) for _ in range(4)]  # 400 bytes each
    for i in range(3):
        assert store.put(k[i], v[i])
    assert store.get(k[0]) is v[0]          # k0 becomes most recent -> k1 is LRU
    assert store.get(k[3]) is None
    store.put(k[3], v[3])                   # evicts k1
    assert k[1] not in store and k[0] in store and store.stats.bytes == 1200
    assert (store.stats.hits, store.stats.misses, store.stats.puts, store.stats.evictions) == (1, 1, 4, 1)
    assert [e.op for e in events] == ["put", "put", "put", "hit", "miss", "evict", "put"]
    assert all(e.kind == "trace.cache" and e.store == "t" for e in events)
    assert events[5].key == k[1] and events[5].nbytes == 400
    assert store.evict_where(lambda key: key.input_hashes[0][1] in ("0", "2")) == 2
    assert len(store) == 1 and store.stats.bytes == 400
    assert not store.put(k[0], torch.zeros(1000))  # larger than the whole store: refused, nothing evicted
    assert len(store) == 1
    unsubscribe()
    store.get(k[3])
    assert events[-1].op == "evict"


# ---------------------------------------------------------------- runtime + cosmos3 spec
def test_model_spec_validates_and_covers_every_canonical_key():
    for name in ("tiny", "tiny-edge", "nano", "super", "edge"):
        cfg = load_variant(name)
        spec = cosmos3_model_spec(cfg)
        comp = spec.component("transformer")
        consumed = {s for t in comp.transforms for s in t.sources}
        assert consumed == set(canonical_key_shapes(cfg))
        targets = comp.target_shapes()
        D, H, K, d, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        assert targets["layers.0.gen.qkv.weight"] == ((H + 2 * K) * d, D)
        assert ("layers.0.und.mlp.gate_up.weight" in targets) == (cfg.hidden_act == "silu")
        if cfg.hidden_act == "silu":
            assert targets["layers.0.und.mlp.gate_up.weight"] == (2 * I, D)
        assert {t.dtype for t in comp.transforms if t.target.startswith("time_embed.")} == {"float32"}
        assert {t.dtype for t in comp.transforms if not t.target.startswith("time_embed.")} == {None}
        assert spec.caches[0].cache_id == "und_kv"


def test_spec_rejects_double_consumption_and_bad_contracts():
    from optimized.runtime import ComponentSpec, LoadTransform
    shapes = (("a", (2, 3)), ("b", (2, 3)))
    with pytest.raises(SpecError, match="consumed by both"):
        ComponentSpec("c", "k", shapes, (LoadTransform("f", ("a", "b"), "ab", "fuse_rows"),
                                         LoadTransform("g", ("a",), "a", "cast"))).validate()
    with pytest.raises(SpecError, match="no transform"):
        ComponentSpec("c", "k", shapes, (LoadTransform("g", ("a",), "a", "cast"),)).validate()
    with pytest.raises(SpecError, match="not CacheKey fields"):
        CacheContract("x", "c", ("model_id", "colour"), ("weights_version",)).validate()


# ---------------------------------------------------------------- loader strictness + transforms
def test_loader_errors_name_the_key(setup):
    cfg, sd = setup
    comp = cosmos3_model_spec(cfg).component("transformer")
    bad = dict(sd)
    del bad["layers.1.gen.k_proj.weight"]
    with pytest.raises(MissingKeyError, match=r"layers\.1\.gen\.k_proj\.weight") as e:
        Cosmos3Fast(cfg, bad)
    assert isinstance(e.value, ValueError) and e.value.keys == ("layers.1.gen.k_proj.weight",)

    bad = dict(sd, **{"layers.0.und.extra.weight": torch.zeros(3)})
    with pytest.raises(UnexpectedKeyError, match=r"layers\.0\.und\.extra\.weight"):
        apply_load_transforms(comp, bad, dtype=torch.float32)

    bad = dict(sd)
    bad["vision_in.weight"] = torch.zeros(cfg.hidden_size, cfg.patch_latent_dim + 1)
    with pytest.raises(ShapeMismatchError, match=r"vision_in\.weight.*expected") as e:
        Cosmos3Fast(cfg, bad)
    assert isinstance(e.value, CheckpointError) and isinstance(e.value, ValueError)


def test_fused_transforms_equal_unfused_math(setup):
    cfg, sd = setup
    comp = cosmos3_model_spec(cfg).component("transformer")
    p = apply_load_transforms(comp, sd, dtype=torch.float32)
    H, K, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for i in range(cfg.num_layers):
        for path in ("und", "gen"):
            pre = f"layers.{i}.{path}."
            q, k, v = F.linear(x, p[pre + "qkv.weight"]).split([H * d, K * d, K * d], dim=-1)
            for name, got in (("q", q), ("k", k), ("v", v)):
                want = F.linear(x, sd[f"{pre}{name}_proj.weight"])
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            down = sd[pre + "mlp.down_proj.weight"]
            if cfg.hidden_act == "silu":
                got = ops.mlp_silu(x, p[pre + "mlp.gate_up.weight"], p[pre + "mlp.down_proj.weight"])
                want = F.linear(F.silu(F.linear(x, sd[pre + "mlp.gate_proj.weight"]))
                                * F.linear(x, sd[pre + "mlp.up_proj.weight"]), down)
            else:
                got = ops.mlp_relu2(x, p[pre + "mlp.up_proj.weight"], p[pre + "mlp.down_proj.weight"])
                want = F.linear(torch.relu(F.linear(x, sd[pre + "mlp.up_proj.weight"])) ** 2, down)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the loader never aliases the caller's tensors
    assert p["vision_in.weight"].data_ptr() != sd["vision_in.weight"].data_ptr()


def test_attention_bias_fuses_biases():
    cfg = dataclasses.replace(load_variant("tiny"), attention_bias=True)
    sd = random_canonical_state_dict(cfg, 3)
    p = apply_load_transforms(cosmos3_model_spec(cfg).component("transformer"), sd, dtype=torch.float32)
    want = torch.cat([sd[f"layers.2.gen.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(p["layers.2.gen.qkv.bias"], want)


def test_bf16_load_keeps_time_embed_fp32(setup):
    cfg, sd = setup
    m = Cosmos3Fast(cfg, sd, dtype=torch.bfloat16)
    for k, v in m.params.items():
        assert v.dtype == (torch.float32 if k.startswith("time_embed.") else torch.bfloat16), k
    out = m.forward_batch(three_samples(cfg)[:1])[0]
    assert out.vision.dtype == torch.bfloat16 and torch.isfinite(out.vision.float()).all()


# ---------------------------------------------------------------- packing, by hand
def test_packing_positions_by_hand_fps_modulated():
    cfg = load_variant("tiny")  # margin 15000, base_fps 24, vae tcf 4, patch 2
    x = make_inputs(cfg, 0, 3, 2, 3, 4, cond=(0,), sound_T=2, action_T=2, arows=(0,), fps=12.0, fps_sound=25.0)
    lay = pack_layout(cfg, x)
    off = 3 + 15000
    # text 0..2; vision T=2 on a 2x2 patch grid (ceil(3/2)=2, 4/2=2): t = i/(12/4)*(24/4) + off = off + 2i
    # sound: t = i/25*24 + off; action: t = (i+1)/(12/1)*(24/4) + off = off + 0.5(i+1)
    t = [0, 1, 2] + [off] * 4 + [off + 2] * 4 + [off, off + 0.96] + [off + 0.5, off + 1.0]
    h = [0, 1, 2] + [0, 0, 1, 1] * 2 + [0, 0] + [0, 0]
    w = [0, 1, 2] + [0, 1, 0, 1] * 2 + [0, 0] + [0, 0]
    assert lay.position_ids.dtype == torch.float32 and lay.position_ids.shape == (3, 15)
    torch.testing.assert_close(lay.position_ids, torch.tensor([t, h, w], dtype=torch.float32), rtol=0, atol=1e-3)
    assert lay.position_ids[0, 12] != off + 1  # the sound step really is 0.96
    assert lay.vision_sequence_indexes.tolist() == list(range(3, 11))
    assert lay.vision_mse_loss_indexes.tolist() == [7, 8, 9, 10]        # frame 0 is conditioned
    assert lay.sound_sequence_indexes.tolist() == [11, 12] == lay.sound_mse_loss_indexes.tolist()
    assert lay.action_sequence_indexes.tolist() == [13, 14]
    assert lay.action_mse_loss_indexes.tolist() == [14]                 # row 0 is conditioned
    assert (lay.text_len, lay.seq_len, lay.vision_grid) == (3, 15, (2, 2, 2))
    assert packing.timestep_embedding_rows(lay).tolist() == [7, 8, 9, 10, 11, 12, 14]


def test_packing_positions_by_hand_integer_and_no_reset():
    cfg = dataclasses.replace(load_variant("tiny"), enable_fps_modulation=False, reset_spatial_ids=False)
    x = make_inputs(cfg, 0, 2, 2, 2, 3, sound_T=2, action_T=2, fps=12.0)
    lay = pack_layout(cfg, x)
    off = 2 + 15000
    # no fps modulation: t = i + off (+1 for action); h/w get + off without the spatial reset; grid 1x2
    t = [0, 1] + [off, off, off + 1, off + 1] + [off, off + 1] + [off + 1, off + 2]
    h = [0, 1] + [off] * 4 + [off] * 4
    w = [0, 1] + [off, off + 1] * 2 + [off] * 4
    assert lay.position_ids.dtype == torch.int64
    assert lay.position_ids.tolist() == [t, h, w]


def test_packing_image_is_never_fps_modulated():
    cfg = load_variant("tiny")
    lay = pack_layout(cfg, make_inputs(cfg, 0, 4, 1, 2, 2, fps=10.0, action_T=1, arows=(0,)))
    off = 4 + 15000
    # T=1 vision and T=1 action: integer rule (action start 1), all cast to float32 with the text
    assert lay.position_ids.tolist() == [[0, 1, 2, 3, off, off + 1], [0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 0, 0]]
    assert lay.action_mse_loss_indexes.numel() == 0
    assert packing.timestep_embedding_rows(lay).tolist() == [4]  # all action rows clean: none get t


# ---------------------------------------------------------------- the fast model
def test_batching_invariance(setup):
    cfg, sd = setup
    m = Cosmos3Fast(cfg, sd)
    xs = three_samples(cfg)
    batch = m.forward_batch(xs, use_und_cache=False)
    for x, b in zip(xs, batch):
        solo = m.forward_batch([x], use_und_cache=False)[0]
        for name in ("vision", "sound", "action"):
            a, s = getattr(b, name), getattr(solo, name)
            assert (a is None) == (s is None), name
            if a is not None:
                assert a.shape == s.shape
                assert rel_l2(a, s) <= 1e-6, (name, rel_l2(a, s))


def test_conditioned_outputs_are_exactly_zero(setup):
    cfg, sd = setup
    m = Cosmos3Fast(cfg, sd)
    x0, _, x2 = three_samples(cfg)
    p0, p2 = m.forward_batch([x0, x2])
    assert p0.vision.shape == (1, cfg.latent_channels, 3, 5, 6)
    assert torch.count_nonzero(p0.vision[:, :, 0]) == 0 and bool((p0.vision[:, :, 1:] != 0).all())
    assert torch.count_nonzero(p2.vision[:, :, [0, 2]]) == 0 and bool((p2.vision[:, :, [1, 3]] != 0).all())
    assert p0.action.shape == (4, cfg.action_dim)
    assert torch.count_nonzero(p0.action[:2]) == 0 and bool((p0.action[2:] != 0).all())
    assert bool((p2.action != 0).all())
    if cfg.has_sound:
        assert p0.sound.shape == (cfg.sound_dim, 7) and bool((p0.sound != 0).all())
    else:
        assert p0.sound is None


def test_und_cache_hit_skips_und_and_matches_recompute(setup):
    cfg, sd = setup
    m = Cosmos3Fast(cfg, sd)
    events = []
    m.und_cache.subscribe(events.append)
    x = three_samples(cfg)[0]
    first = m.forward_batch([x])[0]
    assert first.extras["und_cache"] == "miss"
    assert (m.stats.und_cache_misses, m.stats.und_cache_hits, m.stats.und_prompts_computed) == (1, 0, 1)
    passes = m.stats.und_layers_run
    assert passes == cfg.num_layers
    second = m.forward_batch([dataclasses.replace(x, timestep=500.0)])[0]   # next denoise step, same prompt
    assert m.stats.und_cache_hits == 1 and m.stats.und_layers_run == passes  # no und layer ran
    assert second.extras["und_cache"] == "hit"
    assert [e.op for e in events] == ["miss", "put", "hit"]
    assert (m.und_cache.hits, m.und_cache.misses) == (1, 1)
    again = m.forward_batch([x])[0]
    assert torch.equal(again.vision, first.vision) and torch.equal(again.action, first.action)
    recomputed = m.forward_batch([dataclasses.replace(x, timestep=500.0)], use_und_cache=False)[0]
    assert recomputed.extras["und_cache"] == "off"
    assert m.stats.und_layers_run == 2 * passes
    assert rel_l2(second.vision, recomputed.vision) <= 1e-6
    assert not torch.equal(second.vision, first.vision)  # the timestep really changed the output
    # a different prompt misses; the same prompt twice in one batch is computed once
    other = dataclasses.replace(x, text_ids=(x.text_ids + 1) % cfg.vocab_size)
    before = m.stats.und_prompts_computed
    m.forward_batch([other, other, x])
    assert m.stats.und_prompts_computed == before + 1
    assert [e.op for e in events[-3:]] == ["miss", "hit", "put"]
    assert len(m.und_cache) == 2


def test_und_cache_key_tracks_numerics(setup):
    cfg, sd = setup
    ids = torch.arange(5)
    m32 = Cosmos3Fast(cfg, sd)
    k = m32.und_cache_key(ids)
    assert k == m32.und_cache_key(ids.clone())
    assert k != m32.und_cache_key(torch.arange(6))
    shared = CacheStore(name="shared")
    mb = Cosmos3Fast(cfg, sd, dtype=torch.bfloat16, und_cache=shared)
    assert mb.und_cache_key(ids) != k and mb.und_cache_key(ids).precision == "bfloat16"
    sd2 = dict(sd)
    sd2["layers.0.und.v_proj.weight"] = sd["layers.0.und.v_proj.weight"] + 1e-3
    assert Cosmos3Fast(cfg, sd2).und_cache_key(ids).weights_version != k.weights_version
    assert Cosmos3Fast(cfg, sd, weights_version="v7").und_cache_key(ids).weights_version == "v7"
    assert dict(k.input_hashes) == {"text_ids": content_hash(ids)}


def test_cache_disabled_recomputes_every_time(setup):
    cfg, sd = setup
    m = Cosmos3Fast(cfg, sd, use_und_cache=False)
    x = three_samples(cfg)[1]
    a = m.forward_batch([x])[0]
    b = m.forward_batch([x])[0]
    assert torch.equal(a.vision, b.vision)
    assert len(m.und_cache) == 0 and m.und_cache.stats.misses == 0
    assert m.stats.und_layers_run == 2 * cfg.num_layers


def test_trace_names_shapes_and_cache_hits(setup):
    cfg, sd = setup
    m = Cosmos3Fast(cfg, sd)
    xs = three_samples(cfg)[:2]
    rec: list[tuple[int, str, tuple]] = []
    m.forward_batch(xs, trace=lambda s, n, t: rec.append((s, n, tuple(t.shape))))
    names0 = [n for s, n, _ in rec if s == 0]
    expect = ["embed"] + [f"layers.{i}.{p}" for i in range(cfg.num_layers) for p in ("und", "gen")] + \
             ["gen_norm", "pred.vision"] + (["pred.sound"] if cfg.has_sound else []) + ["pred.action"]
    assert names0 == expect
    lay = pack_layout(cfg, xs[0])
    shapes0 = {n: sh for s, n, sh in rec if s == 0}
    D = cfg.hidden_size
    assert shapes0["embed"] == (lay.seq_len, D) and shapes0["layers.0.und"] == (lay.text_len, D)
    assert shapes0["layers.1.gen"] == (lay.gen_len, D) == shapes0["gen_norm"]
    assert [n for s, n, _ in rec if s == 1][-1] == "pred.vision"  # no sound/action in sample 1
    rec.clear()
    m.forward_batch(xs, trace=lambda s, n, t: rec.append((s, n, tuple(t.shape))))  # und from the cache
    assert not any(n.endswith(".und") for _, n, _ in rec) and ("embed" in [n for _, n, _ in rec])


def test_trace_matches_outputs(setup):
    cfg, sd = setup
    m = Cosmos3Fast(cfg, sd)
    x = three_samples(cfg)[0]
    got = {}
    out = m.forward(x, trace=lambda s, n, t: got.__setitem__(n, t.clone()))
    assert torch.equal(got["pred.vision"], out.vision) and torch.equal(got["pred.action"], out.action)
    L = x.text_ids.numel()
    assert torch.equal(got["embed"][:L], m.params["embed_tokens.weight"][x.text_ids])


def test_run_layer_matches_the_full_forward(setup):
    cfg, sd = setup
    m = Cosmos3Fast(cfg, sd, use_und_cache=False)
    x = three_samples(cfg)[0]
    got = {}
    m.forward(x, trace=lambda s, n, t: got.__setitem__(n, t.clone()))
    L = x.text_ids.numel()
    pos = pack_layout(cfg, x).position_ids
    u, g = m.run_layer(0, got["embed"][:L], got["embed"][L:], pos)
    assert rel_l2(u, got["layers.0.und"]) <= 1e-6 and rel_l2(g, got["layers.0.gen"]) <= 1e-6
    u1, g1 = run_layer(m, 1, u, g, pos)
    assert rel_l2(g1, got["layers.1.gen"]) <= 1e-6


# ---------------------------------------------------------------- fault-planting seams
def test_swapped_mrope_interleave_changes_output(setup, monkeypatch):
    cfg, sd = setup
    x = three_samples(cfg)[0]
    good = Cosmos3Fast(cfg, sd).forward(x).vision
    real = ops.mrope_axis_of_column

    def swapped(half, axes):
        a = real(half, axes)
        return torch.where(a == 1, 2, torch.where(a == 2, 1, a))  # H <-> W

    monkeypatch.setattr(ops, "mrope_axis_of_column", swapped)
    bad = Cosmos3Fast(cfg, sd).forward(x).vision
    assert rel_l2(bad, good) > 1e-4


def test_timestep_rows_fault_changes_output(setup, monkeypatch):
    cfg, sd = setup
    x = three_samples(cfg)[0]
    m = Cosmos3Fast(cfg, sd)
    good = m.forward(x).vision
    monkeypatch.setattr(packing, "timestep_embedding_rows",
                        lambda lay: torch.cat([lay.vision_sequence_indexes]))  # also the conditioned frame
    bad = m.forward(x)
    assert rel_l2(bad.vision, good) > 1e-4
    assert torch.count_nonzero(bad.vision[:, :, 0]) == 0  # the decode contract still holds


def test_rms_norm_variants():
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(16)).to(torch.bfloat16)
    var = x.float().pow(2).mean(-1, keepdim=True)
    want_silu = (x.float() * torch.rsqrt(var + 1e-6)).to(torch.bfloat16) * w
    assert torch.equal(ops.rms_norm_silu(x, w, 1e-6), want_silu)
    want_relu2 = (w.float() * (x.float() * torch.rsqrt(var + 1e-5))).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm_relu2(x, w, 1e-5), want_relu2)
    assert ops.rms_norm_silu(x.float(), w.float(), 1e-6).dtype == torch.float32


def test_mrope_columns_and_time_embedding():
    # head_dim 16 / axes (4, 2, 2): H at k%3==1 & k<6 -> 1, 4; W at k%3==2 & k<6 -> 2, 5; T elsewhere
    assert ops.mrope_axis_of_column(8, (4, 2, 2)).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    a = ops.mrope_axis_of_column(64, (24, 20, 20))
    assert (a == 1).nonzero().flatten().tolist() == list(range(1, 60, 3)) and int((a == 0).sum()) == 24
    e = ops.timestep_sinusoid(torch.tensor([0.5]))
    k = torch.arange(128, dtype=torch.float64)
    f = torch.exp(-torch.log(torch.tensor(10000.0, dtype=torch.float64)) * k / 128)
    want = torch.cat([torch.cos(0.5 * f), torch.sin(0.5 * f)])[None]
    torch.testing.assert_close(e.double(), want, rtol=0, atol=1e-6)


def test_optimized_imports_neither_reference_nor_upstream():
    banned = ("reference", "diffusers", "transformers")
    for path in (ROOT / "optimized").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in banned, f"{path}: imports {n}"
