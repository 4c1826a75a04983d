"""`fvparity golden` is strict about outputs and turns probe failures into failed checks (issue 11, defect 5):
a required output missing, an undeclared output, a probe exception and a NaN output each give a FAILED row for that
case while the other cases still run; only bad case files stop the run (exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import parity.families
from manifests.parity import Tolerance
from parity.family import golden_probe
from parity.golden import run_golden_cases
from parity.report import tensor_check
from tests.conftest import ROOT


@golden_probe(required=("pred",), optional=("debug_*",), required_with={"sound": ("pred_sound",)})
def fake_probe(case, sides):
    """Compares its input `x` doubled with `pred` (and `sound` doubled with `pred_sound`); raises on request."""
    if "boom" in case.inputs:
        raise RuntimeError("engine exploded")
    tol = Tolerance(rel_l2=1e-6)
    out = [tensor_check(f"{case.name}/{s}:pred", case.inputs["x"] * 2, case.outputs["pred"], tol) for s in sides]
    if "sound" in case.inputs:
        out.append(tensor_check(f"{case.name}/ref:sound", case.inputs["sound"] * 2, case.outputs["pred_sound"], tol))
    return out


def make_case(root: Path, name: str, inputs: dict, outputs: dict) -> Path:
    d = root / name
    (d / "upstream").mkdir(parents=True)
    (d / "case.json").write_text(json.dumps({
        "family": "test", "probe": "test.fake", "upstream": {"package": "none", "version": "0"},
        "upstream_format": "none", "dtype": "float32", "seed": 0, "tolerance": {"rel_l2": 1e-6}}))
    save_file({k: v.clone() for k, v in inputs.items()}, str(d / "inputs.safetensors"))
    save_file({k: v.clone() for k, v in outputs.items()}, str(d / "outputs.safetensors"))
    return d


@pytest.fixture
def fake_registry(monkeypatch):
    monkeypatch.setattr(parity.families, "golden_probes", lambda: {"test.fake": fake_probe})


def run(paths):
    return run_golden_cases(paths, ("reference",), progress=lambda _m: None)


def by_case(report) -> dict[str, list]:
    out: dict[str, list] = {}
    for c in report.checks:
        out.setdefault(c.name.split("/")[0], []).append(c)
    return out


X = torch.arange(6.0)


def test_good_case_passes(tmp_path, fake_registry):
    rep = run([make_case(tmp_path, "good", {"x": X}, {"pred": X * 2, "debug_1": X})])
    assert rep.passed and [c.name for c in rep.checks] == ["good/reference:pred"]


def test_missing_required_output_is_a_failed_check_and_the_run_goes_on(tmp_path, fake_registry):
    cases = [make_case(tmp_path, "lacks", {"x": X}, {"debug_1": X}),
             make_case(tmp_path, "good", {"x": X}, {"pred": X * 2})]
    rep = by_case(run(cases))
    assert [c.passed for c in rep["lacks"]] == [False] and "pred" in rep["lacks"][0].detail
    assert all(c.passed for c in rep["good"])


def test_output_required_by_a_present_input(tmp_path, fake_registry):
    rep = run([make_case(tmp_path, "sound", {"x": X, "sound": X}, {"pred": X * 2})])
    fails = [c for c in rep.checks if not c.passed]
    assert len(fails) == 1 and "pred_sound" in fails[0].detail


def test_undeclared_output_is_reported(tmp_path, fake_registry):
    rep = run([make_case(tmp_path, "extra", {"x": X}, {"pred": X * 2, "pred_sund": X})])
    fails = [c for c in rep.checks if not c.passed]
    assert len(fails) == 1 and "pred_sund" in fails[0].detail and "undeclared" in fails[0].name


def test_probe_exception_is_a_failed_check_naming_it(tmp_path, fake_registry):
    cases = [make_case(tmp_path, "boom", {"x": X, "boom": X}, {"pred": X * 2}),
             make_case(tmp_path, "good", {"x": X}, {"pred": X * 2})]
    rep = by_case(run(cases))
    assert [c.passed for c in rep["boom"]] == [False]
    assert "RuntimeError" in rep["boom"][0].detail and "engine exploded" in rep["boom"][0].detail
    assert all(c.passed for c in rep["good"])


def test_nan_output_fails_without_crashing(tmp_path, fake_registry):
    nan = X * 2
    nan[3] = float("nan")
    rep = by_case(run([make_case(tmp_path, "nan", {"x": X}, {"pred": nan}),
                       make_case(tmp_path, "good", {"x": X}, {"pred": X * 2})]))
    assert [c.passed for c in rep["nan"]] == [False] and all(c.passed for c in rep["good"])


def test_cli_nan_in_a_real_golden_fails_that_case_and_prints_the_table(fvparity, tmp_path):
    src = ROOT / "golden" / "cosmos3" / "relu2_inverse_dynamics"
    bad = tmp_path / "nan_case"
    shutil.copytree(src, bad)
    outs = load_file(str(bad / "outputs.safetensors"))
    name = next(k for k, v in outs.items() if v.is_floating_point() and v.abs().sum() > 0)
    outs[name].view(-1)[0] = float("nan")
    save_file(outs, str(bad / "outputs.safetensors"))
    proc = fvparity("golden", str(bad), str(src), "--side", "reference")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    rows = [l for l in proc.stdout.splitlines() if l.startswith(("nan_case/", "relu2_inverse_dynamics/"))]
    assert any(l.startswith("nan_case/") and "FAIL" in l.split() for l in rows)
    assert any(l.startswith("relu2_inverse_dynamics/") for l in rows)
    assert all("PASS" in l.split() for l in rows if l.startswith("relu2_inverse_dynamics/"))
