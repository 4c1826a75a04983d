"""Upstream goldens (diffusers 0.42.1) through `fvparity golden`, plus controls showing the check can fail."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import ROOT, has_module

CASES = sorted((ROOT / "golden" / "cosmos3").iterdir())
# the model-output cases (processor cases hold token ids and pixels: tests/test_processors.py checks them)
MODEL_CASES = [c for c in CASES if json.loads((c / "case.json").read_text())["probe"] not in (
    "cosmos3.processor", "cosmos3.sampling", "cosmos3.convert_dtypes")]


def test_cases_exist():
    probes = [json.loads((c / "case.json").read_text())["probe"] for c in CASES]
    assert probes.count("cosmos3.transformer") >= 4 and probes.count("cosmos3.generate") >= 4
    assert probes.count("cosmos3.reason") >= 2


def test_tampered_generate_trajectory_fails_at_that_step(fvparity, tmp_path):
    case = copy_case(tmp_path, "gen_t2v_sound")
    outs = load_file(str(case / "outputs.safetensors"))
    outs["trajectory_sound"][1] *= 1 + 1e-4
    save_file(outs, str(case / "outputs.safetensors"))
    proc = fvparity("golden", str(case))
    assert proc.returncode == 1
    fails = [l for l in proc.stdout.splitlines() if " FAIL " in l and not l.startswith("golden upstream")]
    assert len(fails) == 2 and all("sound_trajectory" in l and "first divergent step 1" in l for l in fails)


def test_all_goldens_pass_both_sides(fvparity, tmp_path):
    out = tmp_path / "g.json"
    proc = fvparity("golden", *map(str, CASES), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    names = [c["name"] for c in doc["checks"]]
    for case in MODEL_CASES:
        probe = json.loads((case / "case.json").read_text())["probe"]
        for side in ("reference", "optimized"):
            if probe == "cosmos3.reason":
                assert f"{case.name}/{side}:greedy_tokens" in names and f"{case.name}/{side}:step_logits" in names
                continue
            assert f"{case.name}/{side}:vision" in names
            if probe == "cosmos3.transformer":
                assert f"{case.name}/{side}:position_ids" in names
            else:
                assert f"{case.name}/{side}:vision_trajectory" in names
                assert f"{case.name}/{side}:model_timesteps" in names
    tolerance = {c.name: json.loads((c / "case.json").read_text())["tolerance"] for c in CASES}
    for c in doc["checks"]:  # each within its own case's tolerance (the bf16 case has a bf16 one)
        if c["metrics"] and "rel_l2" in tolerance[c["name"].split("/")[0]]:
            assert c["metrics"]["rel_l2"] <= tolerance[c["name"].split("/")[0]]["rel_l2"], c["name"]


def copy_case(tmp_path, name="silu_sound_action_i2v") -> Path:
    dst = tmp_path / name
    shutil.copytree(ROOT / "golden" / "cosmos3" / name, dst)
    return dst


def test_tampered_upstream_output_fails(fvparity, tmp_path):
    case = copy_case(tmp_path)
    outs = load_file(str(case / "outputs.safetensors"))
    outs["pred_sound"] = outs["pred_sound"] * (1 + 1e-4)  # far below visual difference, far above fp32 noise
    save_file(outs, str(case / "outputs.safetensors"))
    proc = fvparity("golden", str(case))
    assert proc.returncode == 1
    assert "reference:sound" in proc.stdout and "FAIL" in proc.stdout


def test_tampered_position_ids_fail(fvparity, tmp_path):
    case = copy_case(tmp_path)
    outs = load_file(str(case / "outputs.safetensors"))
    outs["position_ids"][0, -1] += 1  # one action position off by one
    save_file(outs, str(case / "outputs.safetensors"))
    proc = fvparity("golden", str(case))
    assert proc.returncode == 1
    fails = [l for l in proc.stdout.splitlines() if " FAIL " in l and not l.startswith("golden upstream")]
    assert len(fails) == 2 and all(":position_ids" in l for l in fails)  # both sides, nothing else


def test_checkpoint_with_wrong_shape_is_a_failed_case(fvparity, tmp_path):
    """The converters refusing a case's upstream weights is a failure of what is checked (exit 1, key named)."""
    case = copy_case(tmp_path)
    f = case / "upstream" / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(f))
    sd["proj_in.bias"] = torch.zeros(3)
    save_file(sd, str(f))
    proc = fvparity("golden", str(case))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert "proj_in.bias" in proc.stdout


def test_case_json_missing_key(fvparity, tmp_path):
    case = copy_case(tmp_path)
    meta = json.loads((case / "case.json").read_text())
    del meta["probe"]
    (case / "case.json").write_text(json.dumps(meta))
    proc = fvparity("golden", str(case))
    assert proc.returncode == 2 and "probe" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.upstream
def test_new_case_from_config_json_passes(fvparity, tmp_path):
    """A case with a config the repo does not ship, built by the upstream maker, passes on both sides."""
    spec = {
        "transformer": {"hidden_size": 40, "num_hidden_layers": 2, "num_attention_heads": 5,
                        "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 48, "vocab_size": 64,
                        "latent_channel": 2, "latent_patch_size": 2, "patch_latent_dim": 8,
                        "rope_axes_dim": [2, 1, 1], "action_gen": True, "action_dim": 3,
                        "num_embodiment_domains": 3, "sound_gen": True, "sound_dim": 3},
        "inputs": {"seed": 11, "text_len": 4, "vision_shape": [1, 2, 2, 3, 3], "vision_condition_frames": [1],
                   "sound_shape": [3, 2], "action_shape": [3, 3], "action_condition_rows": [2],
                   "action_domain_id": 2, "timestep": 250, "fps_vision": 12.0, "fps_sound": 25.0},
    }
    cfg = tmp_path / "spec.json"
    cfg.write_text(json.dumps(spec))
    made = subprocess.run([sys.executable, "tools/make_goldens.py", "--config-json", str(cfg), "--name", "fresh",
                           "--out", str(tmp_path / "cases")], cwd=ROOT, capture_output=True, text=True)
    assert made.returncode == 0, made.stdout + made.stderr
    proc = fvparity("golden", str(tmp_path / "cases" / "fresh"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_glob_skips_paths_that_are_not_cases_and_names_them(fvparity, tmp_path):
    """`fvparity golden golden/seedvr2/*` also matches README.md, make_cases.py and key lists: skipped, named."""
    shutil.copytree(ROOT / "golden" / "cosmos3_sound" / "tiny_sound_decode", tmp_path / "tiny_sound_decode")
    (tmp_path / "README.md").write_text("# cases\n")
    (tmp_path / "make_cases.py").write_text("print('recipe')\n")
    (tmp_path / "scratch").mkdir()  # a folder without case.json
    proc = fvparity("golden", *sorted(map(str, tmp_path.iterdir())))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skipped = next(line for line in proc.stderr.splitlines() if "not case folders" in line)
    assert all(name in skipped for name in ("README.md", "make_cases.py", "scratch")), skipped
    assert "tiny_sound_decode" not in skipped and "tiny_sound_decode/optimized:audio" in proc.stdout


@pytest.mark.parametrize("given, needle", [(("scratch",), "missing case.json"),
                                           (("README.md",), "not a directory"),
                                           (("README.md", "scratch"), "no golden case among 2 paths")])
def test_a_path_alone_or_only_non_cases_is_still_an_error(fvparity, tmp_path, given, needle):
    (tmp_path / "README.md").write_text("# cases\n")
    (tmp_path / "scratch").mkdir()
    proc = fvparity("golden", *(str(tmp_path / g) for g in given))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("fvparity: error:") and needle in proc.stderr
