"""Capture-safe step bodies: shape buckets, the CompileCache (eager / compiled / replayed), the packed-attention seam,
bucket edges and the negative controls that must fail (stale static buffer, unmasked pad). Timings never appear here.

Compile-heavy tests are marked `slow` except one small representative compile (a 1-layer tiny model); real CUDA
capture is marked `gpu`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from manifests.cosmos3 import canonical_key_shapes, load_variant
from manifests.cosmos3.io import Cosmos3ForwardInputs
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig
from optimized.attention import BACKENDS, attend, check_backend, key_padding_mask
from optimized.models.cosmos3.model import Cosmos3Fast
from optimized.runtime.compile import CompileCache, EmulatedGraph, CapturedStep, GraphKey, ShapeBuckets
from parity.families.cosmos3 import faults
from parity.families.cosmos3.common import load_reference, run_reference
from parity.graph_faults import stale_static_buffer
from parity.metrics import compare
from parity.weights import random_state_dict

FP32_TOL = 1e-5  # the C0 fp32 tolerance (manifests/cosmos3/parity.json)


@pytest.fixture(scope="module")
def tiny():
    cfg = load_variant("tiny")
    state = random_state_dict(canonical_key_shapes(cfg), 0)
    return cfg, state, load_reference(cfg, state, "cpu", torch.float32)


def sample(cfg, seed: int, text_len: int, T: int, H: int, W: int, t: int = 700) -> Cosmos3ForwardInputs:
    g = torch.Generator().manual_seed(seed)
    return Cosmos3ForwardInputs(text_ids=torch.randint(0, cfg.vocab_size, (text_len,), generator=g),
                                vision_latents=torch.randn(1, cfg.latent_channels, T, H, W, generator=g),
                                timestep=t, fps_vision=24.0)


def worst(preds, refs) -> float:
    return max(compare(p.vision, r.vision).rel_l2 for p, r in zip(preds, refs))


# ---------------------------------------------------------------------------------------------------- buckets
def test_bucket_edges_exactly_full_and_one_over():
    b = ShapeBuckets(edges={"gen": (16, 64)}, multiple={"gen": 64, "text": 16})
    assert [b.pad("gen", n) for n in (1, 16, 17, 64, 65, 128, 129)] == [16, 16, 64, 64, 128, 128, 192]
    assert [b.pad("text", n) for n in (16, 17)] == [16, 32]
    assert ShapeBuckets.exact().pad("gen", 37) == 37


def test_graph_key_names_every_field_and_refuses_bad_modes():
    base = dict(family="cosmos3", variant="tiny", weights_version="w", dtype="float32", device="cpu",
                bucket="B=2;text=16;gen=64", batch_size=2, cfg_policy="batched", attention="auto", mode="eager")
    k = GraphKey(**base)
    for field, other in (("attention", "math"), ("mode", "compile"), ("cfg_policy", "two-forward"),
                         ("bucket", "B=2;text=16;gen=128"), ("weights_version", "w2"), ("parallel_plan_hash", "sp2")):
        assert GraphKey(**{**base, field: other}) != k
    with pytest.raises(ValueError):
        GraphKey(**{**base, "mode": "turbo"})
    with pytest.raises(ValueError):
        check_backend("fastest")


# ---------------------------------------------------------------------------------------------------- capture logic
def _body(x, y):
    return (x * 2 + y, x.sum(0, keepdim=True))


def test_captured_step_copies_in_replays_and_copies_out():
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    step = CapturedStep(_body, (a, b), EmulatedGraph())
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    out = step(x, y)
    assert all(torch.equal(o, e) for o, e in zip(out, _body(x, y)))
    held = out[0].clone()
    step(torch.zeros(4, 3), torch.zeros(4, 3))
    assert torch.equal(out[0], held), "a later replay changed what a caller holds (no copy-out)"
    with pytest.raises(ValueError, match="captured bucket"):
        step(torch.randn(5, 3), torch.randn(5, 3))


def test_negative_control_stale_static_buffer_gives_the_old_answer():
    from optimized.runtime import compile as graph
    from parity.graph_faults import patched

    a, b = torch.randn(4, 3), torch.randn(4, 3)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    with patched(graph, "copy_in", lambda original: lambda static, inputs: None):  # the planted fault's seam
        got = CapturedStep(_body, (a, b), EmulatedGraph())(x, y)
    assert torch.equal(got[0], _body(a, b)[0]) and not torch.allclose(got[0], _body(x, y)[0])
    clean = CapturedStep(_body, (a, b), EmulatedGraph())(x, y)  # restored on exit
    assert torch.equal(clean[0], _body(x, y)[0])


def test_compile_cache_hits_misses_and_kinds():
    cache = CompileCache(emulate_capture=True)
    key = GraphKey("f", "v", "w", "float32", "cpu", "B=1", 1, "batched", "auto", "eager")
    args = (torch.randn(2, 2), torch.randn(2, 2))
    r1, i1 = cache.step(key, _body, args)
    r2, i2 = cache.step(key, _body, args)
    assert r1 is r2 and (i1.graph_cache, i2.graph_cache) == ("miss", "hit") and i1.graph == "eager"
    _, i3 = cache.step(replace(key, mode="cuda"), _body, args)
    assert i3.graph == "replayed" and cache.stats.misses == 2 and cache.stats.hits == 1
    with pytest.raises(ValueError, match="CUDA"):
        CompileCache().step(replace(key, mode="cuda"), _body, args)


# ---------------------------------------------------------------------------------------------------- attention seam
@pytest.mark.parametrize("backend", ["auto", "math", "flex"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_attention_equals_a_loop_of_unpadded_sdpa(backend, causal):
    g = torch.Generator().manual_seed(3)
    H, K, d, lens = 4, 2, 16, [5, 11, 8]
    Lm = max(lens)
    q = torch.randn(len(lens), H, Lm, d, generator=g)
    k = torch.randn(len(lens), K, Lm, d, generator=g)
    v = torch.randn(len(lens), K, Lm, d, generator=g)
    mask = key_padding_mask([(n, 0) for n in lens], Lm, 0)
    out = attend(q, k, v, key_mask=mask, causal=causal, backend=backend)
    for s, n in enumerate(lens):
        want = F.scaled_dot_product_attention(q[s:s + 1, :, :n], k[s:s + 1, :, :n], v[s:s + 1, :, :n],
                                              is_causal=causal, enable_gqa=True)
        assert compare(out[s:s + 1, :, :n], want).rel_l2 <= 1e-6
    assert torch.isfinite(out).all(), "pad query rows must not produce NaN"


def test_backends_are_listed():
    assert {"math", "efficient", "flash", "cudnn", "flex"} <= set(BACKENDS)


# ---------------------------------------------------------------------------------------------------- cosmos3 buckets
def test_bucket_edges_exactly_full_and_one_token_over_match_the_reference(tiny):
    cfg, state, ref = tiny
    fast = Cosmos3Fast(cfg, state).configure_graph("eager", buckets=ShapeBuckets(multiple={"gen": 24, "text": 8}))
    full = sample(cfg, 1, 8, 2, 4, 6)        # 2 x 2 x 3 = 12 gen tokens, text 8: exactly one text bucket
    over = sample(cfg, 2, 9, 2, 4, 6)        # text one over (-> 16)
    big = sample(cfg, 3, 5, 4, 4, 6)         # 24 gen tokens: exactly full
    bigger = sample(cfg, 4, 5, 3, 6, 6)      # 27 gen tokens: one bucket up (48)
    for batch in ([full], [over], [big], [bigger], [full, over, big, bigger]):
        preds = fast.forward_batch(batch)
        assert worst(preds, [run_reference(ref, x) for x in batch]) <= FP32_TOL
    assert fast.last_step_info["bucket"] == "B=4;text=16;gen=48"


def test_row_blocked_layers_match_the_reference(tiny):
    cfg, state, ref = tiny
    fast = Cosmos3Fast(cfg, state)
    fast.row_block = 7  # blocks that straddle sample boundaries and end mid-sample
    batch = [sample(cfg, 11, 7, 2, 4, 6), sample(cfg, 12, 5, 3, 4, 6)]
    assert worst(fast.forward_batch(batch), [run_reference(ref, x) for x in batch]) <= FP32_TOL


def test_negative_control_pad_without_mask_fails(tiny):
    cfg, state, ref = tiny
    x = sample(cfg, 5, 7, 2, 4, 6)  # text 7 -> 16, gen 12 -> 32: both padded
    fast = Cosmos3Fast(cfg, state).configure_graph("eager", buckets=ShapeBuckets(multiple={"gen": 32, "text": 16}))
    want = run_reference(ref, x)
    assert worst(fast.forward_batch([x]), [want]) <= FP32_TOL
    with faults.COSMOS3_C1_FAULTS["pad-not-masked"](None):  # the declared seam packing.real_key_lengths
        assert worst(fast.forward_batch([x]), [want]) > 1e-3  # a patched builder never reuses a clean geometry
    assert worst(fast.forward_batch([x]), [want]) <= FP32_TOL


def test_replayed_body_is_bitwise_eager_and_stale_buffers_fail(tiny):
    cfg, state, ref = tiny
    a, b = sample(cfg, 6, 7, 2, 4, 6, t=900), sample(cfg, 7, 7, 2, 4, 6, t=300)  # same bucket, other content
    eager = Cosmos3Fast(cfg, state)
    captured = Cosmos3Fast(cfg, state)
    captured.graph_cache = CompileCache(emulate_capture=True)
    captured.configure_graph("cuda")
    for x in (a, b):
        e, c = eager.forward_batch([x])[0], captured.forward_batch([x])[0]
        assert torch.equal(e.vision, c.vision)
    assert captured.last_step_info == {"graph": "replayed", "bucket": "B=1;text=16;gen=64", "graph_cache": "hit"}
    stale = Cosmos3Fast(cfg, state)
    with stale_static_buffer([stale]):  # emulated capture, copy-in skipped
        stale.forward_batch([a])
        assert worst(stale.forward_batch([b]), [run_reference(ref, b)]) > 1e-3
    assert stale.graph_mode == "eager" and worst(stale.forward_batch([b]), [run_reference(ref, b)]) <= FP32_TOL


def test_trace_step_reports_graph_bucket_and_cache_hits(tiny):
    import optimized

    cfg, state, _ = tiny
    eng = optimized.Engine.from_state_dict(cfg, state)
    eng.model.graph_cache = CompileCache(emulate_capture=True)
    eng.model.configure_graph("cuda", cfg_policy="batched")
    g = torch.Generator().manual_seed(9)
    req = Cosmos3GenerateRequest(text_ids=torch.randint(0, cfg.vocab_size, (7,), generator=g),
                                 negative_text_ids=torch.randint(0, cfg.vocab_size, (3,), generator=g),
                                 latent_frames=2, latent_height=4, latent_width=6, num_steps=3, guidance_scale=4.0,
                                 seed=1, scheduler=UniPCConfig(flow_shift=10.0))
    h = eng.submit(req)
    eng.run_until_idle()
    steps = [e.data for e in h.events if e.kind == "trace.step"]
    assert [(s["graph"], s["graph_cache"]) for s in steps] == [("replayed", "miss"), ("replayed", "hit"),
                                                               ("replayed", "hit")]
    assert all(s["bucket"] == "B=2;text=16;gen=64" for s in steps)


# ---------------------------------------------------------------------------------------------------- compiled
def test_compiled_body_matches_eager_small(tiny):
    """The one compile test of the default run: a 1-layer tiny model, one bucket."""
    cfg, _, _ = tiny
    cfg1 = replace(cfg, num_layers=1).validate()
    state = random_state_dict(canonical_key_shapes(cfg1), 1)
    x = sample(cfg1, 8, 7, 2, 4, 6)
    want = Cosmos3Fast(cfg1, state).forward_batch([x])[0]
    fast = Cosmos3Fast(cfg1, state).configure_graph("compile")
    got = fast.forward_batch([x])[0]
    assert fast.last_step_info["graph"] == "compiled"
    assert compare(got.vision, want.vision).rel_l2 <= FP32_TOL


@pytest.mark.slow
def test_fvparity_c1_graph_compile_passes(fvparity):
    r = fvparity("run", "cosmos3", "--level", "C1", "--graph", "compile", timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "graph_compile" in r.stdout


@pytest.mark.gpu
def test_cuda_graph_capture_replays_bitwise_eager(tiny):
    cfg, state, _ = tiny
    x = sample(cfg, 10, 7, 2, 4, 6)
    eager = Cosmos3Fast(cfg, state, device="cuda").forward_batch([x])[0]
    fast = Cosmos3Fast(cfg, state, device="cuda").configure_graph("cuda")
    for _ in range(2):
        got = fast.forward_batch([x])[0]
    assert fast.last_step_info["graph"] == "replayed" and torch.equal(got.vision, eager.vision)


# ---------------------------------------------------------------------------------------------------- wan
@pytest.fixture(scope="module")
def wan_dit():
    from manifests.wan.dit import dit_key_shapes
    from manifests.wan.model import load_model_variant

    cfg = load_model_variant("tiny-2.1-i2v").dit
    return cfg, random_state_dict(dit_key_shapes(cfg), 2)


def _wan_inputs(cfg, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, cfg.in_channels, 2, 4, 4, generator=g), torch.tensor([900, 300]),
            torch.randn(2, 512, cfg.text_dim, generator=g), torch.randn(2, 257, cfg.image_dim, generator=g))


def test_wan_blocks_replayed_bitwise_eager_and_stale_buffers_differ(wan_dit):
    from optimized.models.wan.transformer import WanDiTFast

    cfg, state = wan_dit
    eager = WanDiTFast(cfg, state)
    captured = WanDiTFast(cfg, state)
    captured.graph_cache = CompileCache(emulate_capture=True)
    captured.configure_graph("cuda")
    a, b = _wan_inputs(cfg, 1), _wan_inputs(cfg, 2)
    for x in (a, b):
        assert torch.equal(eager.forward_batch(*x), captured.forward_batch(*x))
    assert captured.last_step_info["graph"] == "replayed" and captured.last_step_info["graph_cache"] == "hit"
    stale = WanDiTFast(cfg, state)
    with stale_static_buffer([stale]):
        stale.forward_batch(*a)
        assert not torch.allclose(stale.forward_batch(*b), eager.forward_batch(*b))


@pytest.mark.slow
def test_wan_blocks_compiled_match_eager(wan_dit):
    from optimized.models.wan.transformer import WanDiTFast

    cfg, state = wan_dit
    x = _wan_inputs(cfg, 3)
    want = WanDiTFast(cfg, state).forward_batch(*x)
    fast = WanDiTFast(cfg, state).configure_graph("compile")
    assert compare(fast.forward_batch(*x), want).rel_l2 <= FP32_TOL and fast.last_step_info["graph"] == "compiled"


def test_wan_trace_step_reports_graph_bucket_and_cache_hits():
    import optimized
    from manifests.wan import WanGenerateRequest

    eng = optimized.Engine.from_variant("tiny-2.1-t2v", seed=0)
    for dit in eng.model.experts():
        dit.graph_cache = CompileCache(emulate_capture=True)
    eng.model.configure_graph("cuda", cfg_policy="batched")
    cfg = eng.model.cfg
    s = cfg.vae.spatial_compression * cfg.dit.patch_size[1]
    req = WanGenerateRequest(text_ids=torch.tensor([5, 6, 7]), negative_text_ids=torch.tensor([8, 9]), num_frames=5,
                             height=2 * s, width=2 * s, num_steps=3, guidance_scale=5.0, seed=0)
    h = eng.submit(req)
    eng.run_until_idle()
    steps = [e.data for e in h.events if e.kind == "trace.step"]
    assert [(d["graph"], d["graph_cache"]) for d in steps] == [("replayed", "miss"), ("replayed", "hit"),
                                                               ("replayed", "hit")]
    assert all(d["bucket"].startswith("B=2;N=8;") for d in steps)   # cond + uncond rows, 2 x 2 x 2 tokens
    eager = optimized.Engine.from_variant("tiny-2.1-t2v", seed=0).generate(req)["latents"]["vision"]
    assert torch.equal(h.result()["latents"]["vision"], eager)        # replayed == eager, bitwise


@pytest.mark.slow
def test_fvparity_wan_c1_graph_compile_passes(fvparity):
    r = fvparity("run", "wan", "--level", "C1", "--variant", "tiny-2.1-t2v", "--graph", "compile", timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "graph_compile" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("family, fault", [("cosmos3", "stale-static-buffer"), ("cosmos3", "pad-not-masked"),
                                           ("wan", "stale-static-buffer")])
def test_graph_negative_controls_fail_c1(family, fault):
    """The declared module patches (parity/graph_faults.py, cosmos3 packing.real_key_lengths) make C1 fail; the
    same run without them passes (test_fvparity_*_c1_graph_compile_passes and the C1 suites)."""
    if family == "cosmos3":
        from parity.families.cosmos3.c1 import run_c1
        report = run_c1(["tiny"], None, "cpu", ["fp32"], 0, fault, lambda m: None, only=("t2v",))
    else:
        from parity.families.wan.c1 import run_c1
        report = run_c1(["tiny-2.1-t2v"], None, "cpu", ["fp32"], 0, fault, lambda m: None)
    bad = [c for c in report.checks if not c.passed]
    assert any(c.name.endswith("/step1") for c in bad), [c.name for c in bad][:5]


def test_graph_kinds_check_fails_a_wrong_kind_and_a_compile_that_compiled_nothing():
    from parity.graph_checks import graph_kinds_check

    kinds = [("compiled", "B=1", "miss"), ("compiled", "B=1", "hit")]
    assert graph_kinds_check("g", "compile", kinds, (3, 2)).passed
    assert not graph_kinds_check("g", "compile", kinds, (0, 0)).passed      # ran "compiled" but dynamo built nothing
    assert not graph_kinds_check("g", "compile", kinds + [("eager", "B=2", "miss")]).passed
    assert not graph_kinds_check("g", "cuda", kinds).passed and not graph_kinds_check("g", "compile", []).passed


def test_cuda_graphs_on_a_cpu_device_exit_2_before_anything_runs(fvparity):
    r = fvparity("run", "cosmos3", "--level", "C1", "--graph", "cuda", "--device", "cpu")
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-1000:]
    assert "--graph cuda captures CUDA graphs and needs --device cuda" in r.stderr and "Traceback" not in r.stderr
    assert "[cosmos3 C1]" not in r.stdout + r.stderr          # refused before any case ran


def test_cuda_graphs_under_a_plan_are_refused_naming_the_alternative():
    """Plan ranks run on CPU (gloo): --graph cuda under a plan is a setup error that points to --graph compile."""
    from parity.errors import SetupError
    from parity.families.cosmos3.parallel import run_c1 as cosmos3_c1
    from parity.families.wan.c1 import run_c1 as wan_c1

    with pytest.raises(SetupError, match="use --graph compile"):
        wan_c1(["tiny-2.1-t2v"], None, "cpu", ["fp32"], 0, None, lambda m: None, plan="ulysses2", graph="cuda")
    with pytest.raises(SetupError, match="use --graph compile"):
        cosmos3_c1(["tiny"], None, "cpu", ["fp32"], 0, None, lambda m: None, plan="ulysses2", graph="cuda")


# ---- the AR decode step body (optimized/models/cosmos3/reasoner.py decode_body)

def _reason_all(eng, reqs) -> tuple[list[dict], list[dict]]:
    steps: list[dict] = []
    eng.subscribe(lambda ev: steps.append(dict(ev.data)), prefix="trace.step")
    handles = [eng.submit_reasoning(r, record_logits=True) for r in reqs]
    eng.run_until_idle()
    return [h.result() for h in handles], [d for d in steps if d.get("phase") == "ar_token"]


def test_ar_decode_replayed_is_bitwise_eager_and_matches_the_reference_on_bucket_edges(tiny):
    """5 requests (5 rows -> the 8-row bucket: one over the 4-row edge) whose contexts fill 4 blocks of 4 exactly,
    then go one token over (the 8-block bucket). Replayed (emulated capture) == eager bitwise; both match the
    reference's full recompute (greedy tokens exact, logits within the fp32 C0 tolerance)."""
    import optimized
    from manifests.cosmos3.reasoning import ReasonRequest
    from reference.cosmos3.reasoner import reason

    cfg, state, ref = tiny
    g = torch.Generator().manual_seed(3)
    reqs = [ReasonRequest(prompt_ids=torch.randint(0, cfg.vocab_size, (12 + k % 2,), generator=g), max_new_tokens=6,
                          temperature=0.0 if k % 2 else 0.8, top_k=0 if k % 2 else 20, seed=k) for k in range(5)]
    eager = optimized.Engine.from_state_dict(cfg, state, kv_block_size=4, batching="greedy")
    captured = optimized.Engine.from_state_dict(cfg, state, kv_block_size=4, batching="greedy")
    captured.model.graph_cache = CompileCache(emulate_capture=True)
    captured.model.configure_graph("cuda")
    got_e, steps_e = _reason_all(eager, reqs)
    got_c, steps_c = _reason_all(captured, reqs)
    buckets = {d["bucket"] for d in steps_c}
    assert {"ar_token;B=8;blocks=4x4", "ar_token;B=8;blocks=8x4"} <= buckets, buckets
    assert {d["graph"] for d in steps_c} == {"replayed"} and {d["graph"] for d in steps_e} == {"eager"}
    assert any(d["graph_cache"] == "hit" for d in steps_c)
    for r, e, c in zip(reqs, got_e, got_c):
        assert e["tokens"] == c["tokens"]
        assert all(torch.equal(a, b) for a, b in zip(e["logits"], c["logits"]))
        want = reason(ref, r)
        assert e["tokens"] == want.tokens
        assert max(compare(a, b).rel_l2 for a, b in zip(e["logits"], want.logits)) <= FP32_TOL


def test_ar_decode_stale_static_buffer_fails_and_pad_rows_touch_no_request(tiny):
    """Negative control: the AR decode step replayed without copying its new inputs (emulated graph) repeats the
    previous step's logits; the same engine after the fault is lifted decodes correctly again, and the pool's scratch
    block (where pad rows write) was never handed out."""
    import optimized
    from manifests.cosmos3.reasoning import ReasonRequest
    from reference.cosmos3.reasoner import reason

    cfg, state, ref = tiny
    g = torch.Generator().manual_seed(4)
    reqs = [ReasonRequest(prompt_ids=torch.randint(0, cfg.vocab_size, (9,), generator=g), max_new_tokens=5, seed=k)
            for k in range(3)]
    want = [reason(ref, r).tokens for r in reqs]
    eng = optimized.Engine.from_state_dict(cfg, state, kv_block_size=4, batching="greedy")
    with faults.COSMOS3_C1_FAULTS["stale-static-buffer"](eng):
        got, steps = _reason_all(eng, reqs)
        assert {d["graph"] for d in steps} == {"replayed"}
        assert [x["tokens"] for x in got] != want
        assert any(torch.equal(x["logits"][1], x["logits"][2]) for x in got)   # replayed on the first inputs
    got, _ = _reason_all(eng, reqs)
    assert [x["tokens"] for x in got] == want
    pool = eng.loop("reasoning").pool
    assert pool.scratch_block not in pool.free_blocks and pool.num_free == pool.num_blocks
