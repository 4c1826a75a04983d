"""The user's path: fvconvert an upstream checkpoint (its C0 post-check recorded in the report), then
fvparity on the converted weights; a broken converted checkpoint is a setup error, not a traceback."""

import json

from tests.conftest import ROOT, run_cli

SRC = ROOT / "golden" / "cosmos3" / "relu2_edge_action" / "upstream"


def test_convert_records_parity_then_c0_passes(fvparity, tmp_path):
    out = tmp_path / "ckpt"
    conv = run_cli("converters.cli", "cosmos3", "--from", "diffusers", str(SRC), str(out))
    assert conv.returncode == 0, conv.stdout + conv.stderr
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["parity"]["status"] == "pass" and report["parity"]["level"] == "C0"
    assert report["parity"]["checks"] > 10 and not report["parity"]["failed"]
    proc = fvparity("run", "cosmos3", "--level", "C0", "--checkpoint", str(out), "--dtype", "fp32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checkpoint/fp32/forward/i2v_sound_action:action" in proc.stdout


def test_invalid_config_in_checkpoint_exit_2(fvparity, tmp_path):
    out = tmp_path / "ckpt"
    conv = run_cli("converters.cli", "cosmos3", "--from", "diffusers", str(SRC), str(out), "--skip-parity")
    assert conv.returncode == 0, conv.stderr
    cfg = json.loads((out / "config.json").read_text())
    cfg["patch_latent_dim"] += 1
    (out / "config.json").write_text(json.dumps(cfg))
    proc = fvparity("run", "cosmos3", "--level", "C0", "--checkpoint", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "patch_latent_dim" in proc.stderr.strip().splitlines()[-1]


def test_checkpoint_not_matching_variant_exit_2(fvparity, tmp_path):
    out = tmp_path / "ckpt"
    assert run_cli("converters.cli", "cosmos3", "--from", "diffusers", str(SRC), str(out),
                   "--skip-parity").returncode == 0
    proc = fvparity("run", "cosmos3", "--level", "C0", "--checkpoint", str(out), "--variant", "tiny")
    assert proc.returncode == 2 and "variant 'tiny'" in proc.stderr
