"""Sliding-tile attention (`sta`): the engine's SDPA and FlexAttention backends against the readable reference, the
mask against the published rule written out here in the test's own words, removed-pair counts against closed forms,
the planted drop-diagonal fault, refusals."""

import math

import pytest
import torch
import torch.nn.functional as F

from manifests.accel import AccelSpecError, make_spec, parse_accel
from manifests.accel.sparse import StaParams
from optimized.accel import sparse as opt
from reference.wan import sparse_attention as ref


def _qkv(grid, batch=2, heads=2, head_dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = math.prod(grid)
    return [torch.randn(batch, S, heads, head_dim, generator=g).to(dtype) for _ in range(3)]


def _sta(**knobs):
    return make_spec("sta", knobs)


def _dense(q, k, v):   # [B, S, H, d] -> [B, S, H, d]
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


# grids: divisible, partial last tiles on every axis, a window wider than an axis, a single-frame grid
CASES = [
    ((4, 6, 8), {"tile_t": 2, "tile_h": 2, "tile_w": 2, "window_t": 0, "window_h": 1, "window_w": 1}),
    ((3, 5, 7), {"tile_t": 2, "tile_h": 2, "tile_w": 3, "window_t": 0, "window_h": 1, "window_w": 0}),
    ((5, 4, 9), {"tile_t": 1, "tile_h": 4, "tile_w": 2, "window_t": 1, "window_h": 0, "window_w": 5}),
    ((1, 7, 6), {"tile_t": 1, "tile_h": 3, "tile_w": 2, "window_t": 0, "window_h": 0, "window_w": 1}),
]


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("grid, knobs", CASES)
def test_backends_match_reference(grid, knobs, backend):
    spec = _sta(**knobs, backend=backend)
    q, k, v = _qkv(grid)
    got, removed = opt.sparse_self_attention(q, k, v, grid, spec)
    want, want_removed = ref.sparse_self_attention(q, k, v, grid, spec)
    assert got.shape == q.shape and want.shape == (q.shape[0], q.shape[1], q.shape[2] * q.shape[3])
    assert removed == want_removed > 0
    torch.testing.assert_close(got.flatten(2, 3), want, rtol=0, atol=2e-6)
    # and it is not dense attention (the mask changed something)
    assert (got - _dense(q, k, v)).abs().max() > 1e-3


def test_flex_and_sdpa_agree_in_bfloat16():
    grid, knobs = CASES[1]
    q, k, v = _qkv(grid, dtype=torch.bfloat16)
    a, na = opt.sparse_self_attention(q, k, v, grid, _sta(**knobs, backend="sdpa"))
    b, nb = opt.sparse_self_attention(q, k, v, grid, _sta(**knobs, backend="flex"))
    want, _ = ref.sparse_self_attention(q, k, v, grid, _sta(**knobs))
    assert a.dtype == b.dtype == want.dtype == torch.bfloat16 and na == nb
    torch.testing.assert_close(a.flatten(2, 3).float(), want.float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(b.flatten(2, 3).float(), want.float(), rtol=0, atol=2e-2)


def _upstream_rule_mask(grid, tile, kernel):
    """The published STA rule as stated for a divisible canvas, in tile-major token order: token i lies in tile
    i // tile_volume, tiles numbered frames-major; the kernel centre is the query tile clamped to
    [k // 2, n_tiles - 1 - k // 2]; keep iff |centre - key tile| <= k // 2 on every axis. Returned in RASTER order."""
    n = [g // t for g, t in zip(grid, tile)]
    vol = math.prod(tile)
    S = math.prod(grid)
    tile_of = []                                       # tile-major index -> (tile t, tile h, tile w)
    raster_of = []                                     # tile-major index -> raster index
    for a in range(n[0]):
        for b in range(n[1]):
            for c in range(n[2]):
                for dt in range(tile[0]):
                    for dh in range(tile[1]):
                        for dw in range(tile[2]):
                            t, h, w = a * tile[0] + dt, b * tile[1] + dh, c * tile[2] + dw
                            tile_of.append((a, b, c))
                            raster_of.append((t * grid[1] + h) * grid[2] + w)
    assert len(tile_of) == S and vol * math.prod(n) == S
    mask = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        centre = [min(max(tile_of[i][ax], kernel[ax] // 2), n[ax] - 1 - kernel[ax] // 2) for ax in range(3)]
        for j in range(S):
            if all(abs(centre[ax] - tile_of[j][ax]) <= kernel[ax] // 2 for ax in range(3)):
                mask[raster_of[i], raster_of[j]] = True
    return mask


@pytest.mark.parametrize("grid, tile, window", [((4, 6, 8), (2, 2, 2), (0, 1, 1)), ((3, 4, 4), (1, 2, 1), (1, 0, 1))])
def test_masks_are_the_published_rule_on_divisible_grids(grid, tile, window):
    spec = _sta(tile_t=tile[0], tile_h=tile[1], tile_w=tile[2], window_t=window[0], window_h=window[1],
                window_w=window[2])
    want = _upstream_rule_mask(grid, tile, tuple(2 * w + 1 for w in window))
    params = StaParams.from_spec(spec)
    assert torch.equal(ref.tile_window_mask(grid, params), want)
    assert torch.equal(opt.token_mask(grid, params), want)


def test_the_kernel_is_clamped_at_the_canvas_edge():
    # one row of 8 tokens, tile 1, window 1: the first query sees keys 0, 1, 2 (not just 0, 1), the last 5, 6, 7
    params = StaParams.from_spec(_sta(tile_t=1, tile_h=1, tile_w=1, window_t=0, window_h=0, window_w=1))
    for mask in (ref.tile_window_mask((1, 1, 8), params), opt.token_mask((1, 1, 8), params)):
        assert mask[0].nonzero().flatten().tolist() == [0, 1, 2]
        assert mask[4].nonzero().flatten().tolist() == [3, 4, 5]
        assert mask[7].nonzero().flatten().tolist() == [5, 6, 7]
        assert mask.sum(1).tolist() == [3] * 8


def test_removed_pairs_equal_the_closed_form():
    # divisible: every query sees min(2w + 1, n_tiles) tiles per axis, tile_a tokens each
    grid, tile, window, B, H = (4, 6, 8), (2, 2, 2), (0, 1, 1), 2, 3
    S = math.prod(grid)
    per_query = math.prod(min(2 * w + 1, g // t) * t for g, t, w in zip(grid, tile, window))
    assert per_query == 1 * 2 * 3 * 2 * 3 * 2
    q, k, v = _qkv(grid, batch=B, heads=H)
    spec = _sta(tile_t=2, tile_h=2, tile_w=2, window_t=0, window_h=1, window_w=1)
    for backend in ("sdpa", "flex"):
        _, removed = opt.sparse_self_attention(q, k, v, grid, make_spec("sta", dict(spec.knobs, backend=backend)))
        assert removed == B * H * (S * S - S * per_query)
    _, removed = ref.sparse_self_attention(q, k, v, grid, spec)
    assert removed == B * H * (S * S - S * per_query)

    # partial tiles, by hand: 5 tokens, tiles {0,1} {2,3} {4}, window 0 -> kept 2*2 + 2*2 + 1*1 = 9 of 25
    q, k, v = _qkv((1, 1, 5), batch=1, heads=1)
    spec = _sta(tile_t=1, tile_h=1, tile_w=2, window_t=0, window_h=0, window_w=0)
    assert opt.sparse_self_attention(q, k, v, (1, 1, 5), spec)[1] == 16
    assert ref.sparse_self_attention(q, k, v, (1, 1, 5), spec)[1] == 16


def test_a_full_window_is_dense_attention():
    grid = (3, 5, 7)
    q, k, v = _qkv(grid)
    dense = _dense(q, k, v)
    for backend in ("sdpa", "flex"):
        spec = _sta(tile_t=1, tile_h=2, tile_w=2, window_t=3, window_h=3, window_w=4, backend=backend)
        out, removed = opt.sparse_self_attention(q, k, v, grid, spec)
        assert removed == 0 and torch.equal(out, dense)          # nothing to skip: the dense kernel, bitwise
    out, removed = ref.sparse_self_attention(q, k, v, grid, _sta(tile_t=1, tile_h=2, tile_w=2, window_t=3,
                                                                  window_h=3, window_w=4))
    assert removed == 0
    torch.testing.assert_close(out, dense.flatten(2, 3), rtol=0, atol=1e-6)   # the masked softmax, all kept


def test_step_and_block_ranges():
    grid, knobs = CASES[0]
    q, k, v = _qkv(grid)
    spec = _sta(**knobs, start_step=2, end_step=4, start_block=1)
    dense = _dense(q, k, v)
    for step, block, sparse in ((1, 1, False), (2, 0, False), (2, 1, True), (3, 5, True), (4, 1, False)):
        out, removed = opt.sparse_self_attention(q, k, v, grid, spec, step=step, block=block)
        want, want_removed = ref.sparse_self_attention(q, k, v, grid, spec, step=step, block=block)
        assert (removed > 0) is sparse and removed == want_removed
        assert ref.sparse_applies(StaParams.from_spec(spec), step, block) is opt.applies(
            StaParams.from_spec(spec), step, block) is sparse
        if not sparse:
            assert torch.equal(out, dense)
        torch.testing.assert_close(out.flatten(2, 3), want, rtol=0, atol=2e-6)
    for side in (opt.sparse_self_attention, ref.sparse_self_attention):
        with pytest.raises(AccelSpecError, match="caller must pass step"):
            side(q, k, v, grid, spec, block=1)
        with pytest.raises(AccelSpecError, match="caller must pass block"):
            side(q, k, v, grid, spec, step=2)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_planted_drop_diagonal_is_caught(backend):
    grid, knobs = CASES[1]
    spec = _sta(**knobs, backend=backend)
    q, k, v = _qkv(grid)
    want, want_removed = ref.sparse_self_attention(q, k, v, grid, spec)
    with opt.planted("drop_diagonal"):
        got, removed = opt.sparse_self_attention(q, k, v, grid, spec)
        mask = opt.token_mask(grid, StaParams.from_spec(spec))
    assert removed > want_removed
    assert (got.flatten(2, 3) - want).abs().max() > 1e-2
    assert not mask.diagonal().any()                       # no query keeps even itself
    clean, _ = opt.sparse_self_attention(q, k, v, grid, spec)  # the fault ends with the block
    torch.testing.assert_close(clean.flatten(2, 3), want, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="unknown sparse-attention fault"), opt.planted("nope"):
        pass


def test_flex_skips_whole_blocks_when_tiles_fill_them():
    # tiles of 1 x 8 x 16 = 128 tokens, window 0: the BlockMask keeps its 4 diagonal 128 x 128 blocks of 16, so
    # the kernel never touches exactly the pairs the mask removes
    grid = (2, 16, 16)
    spec = _sta(tile_t=1, tile_h=8, tile_w=16, window_t=0, window_h=0, window_w=0, backend="flex")
    stats = opt.flex_block_stats(grid, spec)
    S = math.prod(grid)
    assert stats["blocks"] == 16 and stats["blocks_skipped"] == 12
    assert stats["pairs_skipped_by_kernel"] == stats["pairs_removed_by_mask"] == S * S - 4 * 128 * 128


@pytest.mark.parametrize("text, message", [
    ("sta:tile_t=0", "must be in [1"),
    ("sta:window_h=-1", "must be in [0"),
    ("sta:backend=cuda", "must be one of sdpa, flex"),
    ("sta:tile=6x8x8", "unknown knob 'tile'"),
])
def test_bad_specs_are_refused(text, message):
    with pytest.raises(AccelSpecError, match=message.replace("[", r"\[")):
        parse_accel(text)


def test_cross_knob_refusals_and_wrong_kind():
    grid = (1, 2, 2)
    q, k, v = _qkv(grid)
    for spec, message in ((parse_accel("sta:start_step=3,end_step=3"), "end_step"),
                          (parse_accel("sta:start_block=2,end_block=1"), "end_block"),
                          (parse_accel("fbcache"), "not a sparse-attention kind")):
        for side in (opt.sparse_self_attention, ref.sparse_self_attention):
            with pytest.raises(AccelSpecError, match=message):
                side(q, k, v, grid, spec)


def test_bad_shapes_are_refused():
    spec = _sta()
    q, k, v = _qkv((1, 2, 2))
    for side in (opt.sparse_self_attention, ref.sparse_self_attention):
        with pytest.raises(ValueError, match="do not fill the grid"):
            side(q, k, v, (1, 2, 3), spec)
        with pytest.raises(ValueError, match="grid must be three positive ints"):
            side(q, k, v, (4, 0), spec)
        with pytest.raises(ValueError, match="must be equal"):
            side(q, k[:, :2], v, (1, 2, 2), spec)


def test_rows_at_different_steps_decide_each_for_itself():
    grid, knobs = CASES[0]
    q, k, v = _qkv(grid, batch=3)
    spec = _sta(**knobs, start_step=2)
    out, removed = opt.sparse_self_attention(q, k, v, grid, spec, step=[1, 2, 5])
    for row, step in enumerate((1, 2, 5)):
        alone, _ = opt.sparse_self_attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], grid, spec,
                                                         step=step)
        torch.testing.assert_close(out[row:row + 1], alone, rtol=0, atol=1e-6)
    per_row = ref.sparse_self_attention(q[:1], k[:1], v[:1], grid, spec, step=2)[1]
    assert per_row > 0 and removed == 2 * per_row
    with pytest.raises(ValueError, match="2 steps given for a batch of 3"):
        opt.sparse_self_attention(q, k, v, grid, spec, step=[1, 2])


def test_flops_skipped_counts_both_matmuls():
    from manifests.accel.sparse import attention_flops_skipped
    # one removed pair at head_dim 8: q.k (8 multiplies + 8 adds) and p.v (8 + 8)
    assert attention_flops_skipped(1, 8) == 32 and attention_flops_skipped(0, 128) == 0


@pytest.mark.slow
def test_compiled_flex_matches_reference():
    # what CUDA runs by default: torch.compile(flex_attention) with the BlockMask (~30 s to compile on CPU)
    grid, knobs = CASES[1]
    q, k, v = _qkv(grid, head_dim=16)
    spec = _sta(**knobs, backend="flex")
    got, removed = opt.sparse_self_attention(q, k, v, grid, spec, compile_flex=True)
    want, want_removed = ref.sparse_self_attention(q, k, v, grid, spec)
    assert removed == want_removed
    torch.testing.assert_close(got.flatten(2, 3), want, rtol=0, atol=2e-6)


def test_dense_calls_use_the_callers_kernel():
    # the engine passes its exact-path kernel so that dense steps / blocks are bitwise the exact path
    grid, knobs = CASES[0]
    q, k, v = _qkv(grid, batch=2)
    calls = []

    def kernel(qh, kh, vh):          # [B, H, S, d]
        calls.append(qh.shape[0])
        return F.scaled_dot_product_attention(qh, kh, vh) + 1.0   # marked, so its use shows in the output

    spec = _sta(**knobs, start_step=1)
    out, removed = opt.sparse_self_attention(q, k, v, grid, spec, step=0, dense_attention=kernel)
    assert calls == [2] and removed == 0 and torch.equal(out, _dense(q, k, v) + 1.0)
    out, _ = opt.sparse_self_attention(q, k, v, grid, spec, step=[0, 1], dense_attention=kernel)
    assert calls == [2, 1]
    torch.testing.assert_close(out[:1], _dense(q[:1], k[:1], v[:1]) + 1.0, rtol=0, atol=1e-6)
    assert (out[1:] - _dense(q[1:], k[1:], v[1:]) - 1.0).abs().max() > 0.5   # the sparse row did not use it
