"""`fvconvert export --to diffusers MODEL_DIR OUT` (converters/export.py): a canonical wan model directory -> a
diffusers pipeline root. Round trip: a hand-written WanPipeline root -> `fvconvert wan --from diffusers` -> export ->
convert again gives back every tensor bit for bit (same dtypes, same model config, same weights_version). Bad input
exits 2 with one line and leaves no OUT. Upstream-marked: diffusers' WanPipeline.from_pretrained loads the export
and its latents match the reference pipeline's on the same request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from converters.cli import main as fvconvert
from converters.export import source_key
from converters.manifest import load_manifest
from manifests.checkpoint import load_state, read_checkpoint
from tests.test_model_directory import write_wan_root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("export")
    write_wan_root(d / "root", seed=3)
    assert fvconvert(["wan", "--from", "diffusers", str(d / "root"), str(d / "model"), "-q", "--skip-parity"]) == 0
    return d / "model"


def _states(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    ck = read_checkpoint(path)
    return {n: load_state(ck, component=n) for n in ck.components}


def test_export_then_convert_back_is_bitwise(model_dir, tmp_path):
    exp, back = tmp_path / "exp", tmp_path / "back"
    assert fvconvert(["export", "--to", "diffusers", str(model_dir), str(exp)]) == 0
    index = json.loads((exp / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert json.loads((exp / "transformer" / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    assert fvconvert(["wan", "--from", "diffusers", str(exp), str(back), "-q", "--skip-parity"]) == 0
    a, b = _states(model_dir), _states(back)
    assert a.keys() == b.keys()
    for comp in a:
        assert a[comp].keys() == b[comp].keys(), comp
        for k, v in a[comp].items():
            assert v.dtype == b[comp][k].dtype and torch.equal(v, b[comp][k]), (comp, k)
    ca, cb = read_checkpoint(model_dir), read_checkpoint(back)
    assert ca.typed_config() == cb.typed_config()
    assert ca.weights_version == cb.weights_version


def test_upstream_names_come_from_the_manifests(model_dir, tmp_path):
    """The tied UMT5 embedding that the converter drops is written back (upstream files hold both), equal to shared."""
    exp = tmp_path / "exp"
    assert fvconvert(["export", "--to", "diffusers", str(model_dir), str(exp)]) == 0
    from safetensors.torch import load_file
    te = load_file(exp / "text_encoder" / "model.safetensors")
    assert torch.equal(te["encoder.embed_tokens.weight"], te["shared.weight"])
    m = load_manifest("wan", "diffusers-transformer")
    assert source_key(m, "blocks.0.attn1.to_q.weight", {})[0] == "blocks.0.attn1.to_q.weight"


def test_a_key_no_rule_gives_back_is_refused():
    from converters.errors import ConversionError
    m = load_manifest("wan", "diffusers-transformer")
    with pytest.raises(ConversionError, match="no rule gives canonical key"):
        source_key(m, "blocks.0.not_a_module.weight", {})


def test_bad_input_exits_2_and_leaves_no_out(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert fvconvert(["export", "--to", "diffusers", str(tmp_path / "missing"), str(out)]) == 2
    assert not out.exists()
    single = model_dir / "transformer"            # one component dir, not a model directory
    assert fvconvert(["export", "--to", "diffusers", str(single), str(out)]) == 2
    assert "not a canonical wan model directory" in capsys.readouterr().err and not out.exists()
    assert fvconvert(["export", "--to", "onnx", str(model_dir), str(out)]) == 2 and not out.exists()
    out.mkdir()
    assert fvconvert(["export", "--to", "diffusers", str(model_dir), str(out)]) == 2     # exists, no --force
    assert list(out.iterdir()) == []


def test_a_corrupt_weight_file_leaves_no_out(model_dir, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    f = min((bad / "vae").glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    out = tmp_path / "out"
    assert fvconvert(["export", "--to", "diffusers", str(bad), str(out)]) == 2
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "tmp" in p.name]


@pytest.mark.upstream
def test_diffusers_loads_the_export_and_matches_the_reference(model_dir, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from reference.wan.pipeline import WanReferencePipeline
    from reference.wan.processor import WanProcessor
    exp = tmp_path / "exp"
    assert fvconvert(["export", "--to", "diffusers", str(model_dir), str(exp)]) == 0
    pipe = diffusers.WanPipeline.from_pretrained(exp, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    ck = read_checkpoint(model_dir)
    cfg = ck.typed_config()
    req = WanProcessor(ck.assets["tokenizer"]).build_request("a cat on a mat", "", None, num_frames=5, height=32,
                                                             width=32, steps=2, guidance=5.0, seed=0)
    ref = WanReferencePipeline(cfg, _states(model_dir))
    with torch.no_grad():
        want = ref.generate(req).latents
        got = pipe(prompt="a cat on a mat", negative_prompt="", height=32, width=32, num_frames=5,
                   num_inference_steps=2, guidance_scale=5.0, generator=torch.Generator().manual_seed(0),
                   output_type="latent", max_sequence_length=cfg.max_sequence_length).frames
        other = ref.generate(WanProcessor(ck.assets["tokenizer"]).build_request(
            "a red dog runs", "", None, num_frames=5, height=32, width=32, steps=2, guidance=5.0, seed=0)).latents
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    assert rel(got, want) < 1e-4
    assert rel(got, other) > 1e-3        # negative control: another prompt is told apart
