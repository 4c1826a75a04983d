"""The attention-level sparse parity rows (parity/accel_sparse_checks.py): clean code passes every row on both
backends; the planted drop-diagonal fault fails every row and is named as the diagonal tile; a different mask bug
(a window one tile too wide) is told apart from it; bad input exits 2."""

import torch

from manifests.accel import parse_accel
from optimized.accel import sparse as engine
from parity import accel_sparse_checks as rows

SPEC = "sta:tile_t=1,tile_h=2,tile_w=3,window_t=0,window_h=1,window_w=0"


def _by_name(checks):
    return {c.name: c for c in checks}


def test_clean_rows_pass_on_both_backends():
    checks = _by_name(rows.check_sparse_attention(parse_accel(SPEC), (3, 5, 7)))
    assert set(checks) == {f"{b}:{r}" for b in ("sdpa", "flex") for r in ("mask", "removed", "output")}
    assert all(c.passed for c in checks.values()), checks
    assert checks["sdpa:removed"].got == checks["flex:removed"].got > 0


def test_drop_diagonal_fails_every_row_and_says_diagonal():
    checks = rows.check_sparse_attention(parse_accel(SPEC), (3, 5, 7), fault="drop_diagonal")
    assert checks and not any(c.passed for c in checks)
    for c in checks:
        if c.name.endswith(":mask"):
            assert "own tile is missing" in c.where and "diagonal" in c.where
        if c.name.endswith(":removed"):
            assert c.got > c.want
    assert not engine.FAULTS            # the fault ends with the check


def test_a_too_wide_window_is_not_called_the_diagonal(monkeypatch):
    real = engine._axis_tables
    monkeypatch.setattr(engine, "_axis_tables", lambda size, tile, window: real(size, tile, window + 1))
    for cache in (engine._tables, engine._kept_pairs, engine._token_mask, engine._flex_layout):
        cache.cache_clear()
    try:
        checks = _by_name(rows.check_sparse_attention(parse_accel(SPEC), (3, 5, 7)))
    finally:
        monkeypatch.undo()
        for cache in (engine._tables, engine._kept_pairs, engine._token_mask, engine._flex_layout):
            cache.cache_clear()
    for backend in ("sdpa", "flex"):
        mask = checks[f"{backend}:mask"]
        assert not mask.passed and "extra" in mask.where and "diagonal" not in mask.where
        assert not checks[f"{backend}:removed"].passed and not checks[f"{backend}:output"].passed


def test_cli_exit_codes(capsys):
    assert rows.main(["--accel", SPEC, "--grid", "3", "5", "7"]) == 0
    assert rows.main(["--accel", SPEC, "--grid", "3", "5", "7", "--fault", "drop_diagonal"]) == 1
    assert "diagonal" in capsys.readouterr().out
    assert rows.main(["--accel", "sta:tile_t=0", "--grid", "3", "5", "7"]) == 2
    assert rows.main(["--accel", "fbcache", "--grid", "3", "5", "7"]) == 2
    assert rows.main(["--accel", SPEC, "--grid", "3", "0", "7"]) == 2
    err = capsys.readouterr().err
    assert "tile_t" in err and "not a sparse-attention kind" in err and "grid" in err and "Traceback" not in err


def test_bf16_rows_pass():
    checks = rows.check_sparse_attention(parse_accel(SPEC), (2, 4, 6), dtype=torch.bfloat16)
    assert all(c.passed for c in checks), checks
