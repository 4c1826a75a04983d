"""fvparity as a user runs it: tables, JSON, exit codes, one-line errors."""

import json

import pytest


def assert_one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert err and err[-1].startswith("fvparity: error:") and needle in err[-1], proc.stderr


def test_c0_passes_with_table_and_json(fvparity, tmp_path):
    out = tmp_path / "c0.json"
    proc = fvparity("run", "cosmos3", "--level", "C0", "--variant", "tiny", "--dtype", "fp32", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "FAIL" not in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["level"] == "C0"
    names = [c["name"] for c in doc["checks"]]
    for part in ("packing/", "layer0", "forward/i2v_sound_action:sound", "forward/i2v_sound_action:action",
                 "batched/", "und_cache/hit_skips_und", "und_cache/new_prompt_misses"):
        assert any(part in n for n in names), part
    for c in doc["checks"]:
        if c["metrics"]:
            assert c["metrics"]["rel_l2"] <= 1e-5


def test_list_shows_levels(fvparity):
    proc = fvparity("list")
    assert proc.returncode == 0
    row = next(line for line in proc.stdout.splitlines() if line.startswith("cosmos3 "))
    assert "tiny-edge" in row and "C0 C1 C2 C3 C4" in row and "(-)" not in row
    seedvr2 = next(line for line in proc.stdout.splitlines() if line.startswith("seedvr2 "))
    assert "C2(-)" in seedvr2  # a level a family lacks is shown as missing


@pytest.mark.parametrize("args, needle", [
    (("run", "wan9", "--level", "C0"), "unknown family 'wan9'"),
    (("run", "cosmos3", "--level", "C0", "--variant", "huge"), "unknown variant 'huge'"),
    (("run", "seedvr2", "--level", "C2"), "not implemented for seedvr2"),
    (("run", "cosmos3", "--level", "C9"), "C9"),
    (("run", "cosmos3", "--level", "C0", "--plant-fault", "nope"), "fault 'nope'"),
    (("run", "cosmos3", "--level", "C0", "--checkpoint", "/nonexistent/ckpt"), "/nonexistent/ckpt"),
    (("golden", "/nonexistent/case"), "not a directory"),
])
def test_bad_input_one_line_exit_2(fvparity, args, needle):
    assert_one_line_error(fvparity(*args), needle)


def test_golden_case_missing_file(fvparity, tmp_path):
    case = tmp_path / "case"
    case.mkdir()
    (case / "case.json").write_text("{}")
    assert_one_line_error(fvparity("golden", str(case)), "missing upstream")


def test_c1_passes_with_per_step_rows(fvparity, tmp_path):
    out = tmp_path / "c1.json"
    proc = fvparity("run", "cosmos3", "--level", "C1", "--variant", "tiny-edge", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    names = [c["name"] for c in doc["checks"]]
    for case in ("t2v", "concurrent3/req0", "concurrent3/req2", "two_forward_cfg", "i2v", "karras_shipped",
                 "policy", "forward_dynamics", "inverse_dynamics"):
        steps = [n for n in names if n.startswith(f"tiny-edge/fp32/{case}/step")]
        assert len(steps) == doc["settings"]["steps"], case
    step = next(c for c in doc["checks"] if c["name"] == "tiny-edge/fp32/policy/step3")
    assert set(step["extra"]) == {"vision", "action"} and step["metrics"]["rel_l2"] <= 1e-4
    assert all(c["passed"] for c in doc["checks"] if c["name"].endswith("batched_with_others"))
