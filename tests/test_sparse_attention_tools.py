"""The sparse-attention tools run end to end on CPU (no timing asserted: speed lives in the printed ratios)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_sparse
import gpu_sparse_check


def test_bench_prints_every_row_and_refuses_bad_knobs(capsys):
    assert bench_sparse.main(["--grid", "2", "4", "6", "--tile", "1", "2", "2", "--window", "0", "0", "0",
                              "--heads", "1", "--head-dim", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("dense sdpa", "sta sdpa (bool mask)", "sta flex (eager)", "reference (masked softmax)"):
        assert row in out
    # 2 x 2 x 3 tiles of 4 tokens (partial: w = 6 -> tiles of 2), window 0: each query keeps its own 4 of 48 keys
    assert "mask removes 91.7%" in out
    assert bench_sparse.main(["--tile", "0", "1", "1"]) == 2
    assert bench_sparse.main(["--grid", "0", "4", "4"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_gpu_sparse_check_dry_run_on_cpu(tmp_path, capsys):
    assert gpu_sparse_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--repeats", "1"]) == 0
    result = json.loads((tmp_path / "sparse_check.json").read_text())
    assert result["passed"] and result["tokens"] == 4 * 16 * 16
    # tile 1 x 8 x 8, window 1 along frames only: 3 of 4 frames' tiles x 1 of 2 x 1 of 2 -> 3/16 kept
    assert abs(result["pairs_removed_fraction"] - 13 / 16) < 1e-12
    assert 0 < result["pairs_skipped_by_kernel_fraction"] <= result["pairs_removed_fraction"]
    assert gpu_sparse_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--accel", "sta:tile_t=0"]) == 2
