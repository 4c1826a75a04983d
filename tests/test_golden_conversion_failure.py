"""A golden case whose upstream checkpoint the converters refuse is that case's failed check (exit 1, the other
cases still run), not a setup error that aborts the run (exit 2): a manifest bug is a failure of what is checked."""

import json
import shutil

from safetensors.torch import load_file, save_file

from tests.conftest import ROOT


def _corrupt(case_dir, weights: str) -> None:
    path = case_dir / "upstream" / weights
    state = load_file(str(path))
    key = sorted(k for k, v in state.items() if v.dim() == 2)[0]
    state[key] = state[key][:, :-1].contiguous()  # a shape no manifest rule accepts
    save_file(state, str(path))


def test_unconvertible_upstream_is_a_failed_case_and_the_run_goes_on(fvparity, tmp_path):
    bad = tmp_path / "bad_dit"
    shutil.copytree(ROOT / "golden" / "wan" / "dit_t2v", bad)
    _corrupt(bad, "diffusion_pytorch_model.safetensors")
    good = ROOT / "golden" / "wan" / "umt5"
    out = tmp_path / "r.json"
    proc = fvparity("golden", str(bad), str(good), "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    failed = [c for c in doc["checks"] if not c["passed"]]
    assert failed and all(c["name"].startswith("bad_dit/") for c in failed)
    assert any("UpstreamConversionFailed" in c["detail"] for c in failed)
    assert any(c["name"].startswith("umt5/") and c["passed"] for c in doc["checks"])  # the next case still ran


def test_wan_c4_engine_exception_is_a_failed_check(monkeypatch):
    """An engine that raises inside a C4 case fails that case's row; the run returns its report (no exit 3)."""
    import optimized.engine
    from parity.families import families

    def broken(self, *a, **k):
        raise RuntimeError("request req-0 failed: planted")

    monkeypatch.setattr(optimized.engine.Engine, "generate", broken)
    report = families()["wan"].levels["C4"](variants=["tiny-2.1-t2v"], checkpoint=None, device="cpu",
                                            dtypes=["fp32"], seed=0, fault=None, progress=lambda m: None)
    assert not report.passed
    rows = [c for c in report.checks if c.name.endswith("/engine")]
    assert rows and all(not c.passed and "planted" in c.detail for c in rows)
