"""Sliding-tile attention inside the wan denoising loop: C1 (parity/accel_checks.py, engine batched with another
request vs the reference loop, decisions incl. keys_skipped then latents per step) passes on clean code, and the
planted drop-diagonal mask fails it at the first step (which also shows that the engine really runs the mask)."""

import pytest

from manifests.accel import parse_accel
from manifests.wan import load_model_variant
from optimized.accel import sparse as engine_sparse
from optimized.models.wan.instance import WanModelInstance
from parity.accel_checks import default_request, run_accel_c1
from parity.accel_rows import first_failure
from reference.wan.pipeline import WanReferencePipeline

# tiny-2.1-t2v's default request: grid (2, 2, 2); tile 1, window 0 along frames: each query keeps its frame's 4 keys
SPEC = "sta:tile_t=1,tile_h=1,tile_w=1,window_t=0,window_h=1,window_w=1"
_WEIGHTS: dict = {}


def _weights():
    if not _WEIGHTS:
        _WEIGHTS["w"] = WanModelInstance.random_weights(load_model_variant("tiny-2.1-t2v"), 0)
    return _WEIGHTS["w"]


def test_c1_under_sta_passes():
    rows = run_accel_c1("wan", SPEC, weights=_weights(), num_steps=3)
    assert rows and first_failure(rows) is None, first_failure(rows)
    assert {r.check for r in rows} >= {"decision"}


def test_c1_catches_the_drop_diagonal_mask():
    with engine_sparse.planted("drop_diagonal"):
        rows = run_accel_c1("wan", SPEC, weights=_weights(), num_steps=3)
    bad = first_failure(rows)
    assert bad is not None and bad.step == 0, rows


@pytest.mark.slow
def test_c1_under_sta_flex_passes():
    rows = run_accel_c1("wan", SPEC + ",backend=flex", weights=_weights(), num_steps=3)
    assert rows and first_failure(rows) is None, first_failure(rows)


def test_c1_with_step_and_block_ranges():
    # sparse only from step 1 on and only in block 1 of 2: both sides must route the same calls (decisions carry the
    # per-step keys_skipped: 0 at step 0, > 0 after)
    spec = parse_accel(SPEC + ",start_step=1,start_block=1")
    rows = run_accel_c1("wan", spec, weights=_weights(), num_steps=3)
    assert rows and first_failure(rows) is None, first_failure(rows)
    cfg = load_model_variant("tiny-2.1-t2v")
    ref = WanReferencePipeline(cfg, _weights()).generate(default_request(cfg, spec, 3, 0))
    # grid (2, 2, 2): each query keeps its frame's 4 of 8 keys -> 64 - 32 removed per head, 1 sparse block
    per_branch = 1 * cfg.dit.num_heads * (8 * 8 - 8 * 4)
    assert [(d.step, d.keys_skipped) for d in ref.accel] == [(0, 0), (0, 0)] + [(s, per_branch) for s in (1, 1, 2, 2)]
    with engine_sparse.planted("drop_diagonal"):
        rows = run_accel_c1("wan", SPEC + ",start_step=1,start_block=1", weights=_weights(), num_steps=3)
    bad = first_failure(rows)
    assert bad is not None and bad.step == 1, rows        # step 0 is dense: the fault shows from step 1
