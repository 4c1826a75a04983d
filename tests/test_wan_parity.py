"""The wan parity levels (C0 components, C1 denoise trajectories, C4 decoded frames), their planted faults, the
upstream golden probes on both sides, and the converted-checkpoint path a user takes:
`fvconvert wan --from diffusers <pipeline root> OUT` (with the DiT / UMT5 / VAE post-checks), then
`Engine.from_checkpoint(OUT)` generating what the reference pipeline generates from the same directory.

Fast: one tiny variant per level, every fault once, the golden cases, the conversion round trip. Slow: every default
variant at every level and dtype through the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from manifests.checkpoint import load_state, read_checkpoint
from manifests.wan import load_model_variant
from parity.errors import SetupError
from parity.families import get_family
from parity.families.wan import c0, c1, check_converted, check_converted_text_encoder
from parity.families.wan import check_converted_transformer, common, faults
from parity.golden import run_golden_cases
from tests.conftest import ROOT

import optimized
import reference.wan as ref

T2V, A14B, I2V, TI2V = "tiny-2.1-t2v", "tiny-2.2-t2v-a14b", "tiny-2.1-i2v", "tiny-2.2-ti2v"


def quiet(msg: str) -> None:
    pass


def run(level: str, variants: list[str], fault: str | None = None, dtypes=("fp32",)):
    return get_family("wan").levels[level](variants, None, "cpu", list(dtypes), 0, fault, quiet)


def failed(report) -> list:
    return [c for c in report.checks if not c.passed]


# ------------------------------------------------------------------------------------------------ levels pass

def test_c0_passes_on_a_tiny_model_and_covers_every_component():
    report = run("C0", [T2V])
    assert report.passed, [(c.name, c.detail) for c in failed(report)]
    names = [c.name for c in report.checks]
    for part in ("/dit/forward/per_token_timestep", "/dit/batched/b", "/dit/block/blocks.1", "/dit/trace/proj_out",
                 "/umt5/prompt_embeds", "/umt5/padding_zeroed", "/scheduler/unipc/steps", "/scheduler/euler/sigmas",
                 "/input/noise", "/input/timestep", "/input/text", "vae:tiny-2.1/fp32/decode/chunk1"):
        assert any(part in n for n in names), part
    # a row on tensors that are zero by construction must say so
    pad = next(c for c in report.checks if c.name.endswith("padding_zeroed"))
    assert "zero by construction" in pad.detail


def test_c0_i2v_conditioning_rows_compare_the_loop_input():
    report = run("C0", [I2V])
    assert report.passed, [(c.name, c.detail) for c in failed(report)]
    rows = {c.name.rsplit("/", 1)[1]: c for c in report.checks if "/input/" in c.name}
    assert {"noise", "timestep", "text", "dit_input", "mask", "condition_latents"} <= set(rows)
    assert "by construction" in rows["mask"].detail and rows["condition_latents"].metrics.rel_l2 < 1e-5


def test_c1_passes_two_experts_with_named_expert_and_batching_rows():
    report = run("C1", [A14B])
    assert report.passed, [(c.name, c.detail) for c in failed(report)]
    by_name = {c.name: c for c in report.checks}
    assert by_name[f"{A14B}/fp32/two_experts/experts"].detail == "expert per step [1, 1, 2, 2]"
    assert f"{A14B}/fp32/two_experts/timesteps_fed" in by_name
    for k in range(3):
        assert by_name[f"{A14B}/fp32/concurrent3/req{k}/batched_with_others"].passed
    assert "drift" in by_name[f"{A14B}/fp32/euler_no_cfg/latents"].detail


def test_c4_passes_with_frames_written_and_read_back():
    report = run("C4", [T2V])
    assert report.passed, [(c.name, c.detail) for c in failed(report)]
    assert {c.name.rsplit("/", 1)[1] for c in report.checks} == {"frames", "artifacts_roundtrip", "png_frames",
                                                                   "decode_chunk2"}


def test_c4_reference_that_raises_is_a_failed_check_not_a_crash(monkeypatch):
    """A reference-side bug that makes the pipeline raise fails that case (exit 1) and the run goes on."""
    def boom(self, request):
        raise ValueError("latents hold NaN or Inf values")
    monkeypatch.setattr(common.ref.WanReferencePipeline, "generate", boom)
    report = run("C4", [T2V])
    assert not report.passed and report.checks
    assert all(c.name.endswith("/reference") and "reference raised ValueError" in c.detail for c in report.checks)


def test_levels_refuse_what_they_cannot_run():
    with pytest.raises(SetupError, match="not on tiny-2.1"):
        run("C1", ["tiny-2.1"])                       # a VAE-only variant has no loop
    with pytest.raises(SetupError, match="unknown C1 fault 'rope'"):
        run("C1", [T2V], fault="rope")
    with pytest.raises(SetupError, match="two-expert"):
        run("C1", [T2V], fault="expert-switch-late")
    with pytest.raises(SetupError, match="unknown variant"):
        run("C0", ["tiny-9"])


# ------------------------------------------------------------------------------------------------ faults

FAULT_CASES = [  # (fault, level, variant, where it must be named)
    ("rope-wrong-axis", "C0", T2V, "blocks.0"),
    ("perturbed-weight", "C0", T2V, "blocks.1"),
    ("text-padding-not-zeroed", "C0", T2V, "text_encoder.padding"),
    ("vae-perturbed-weight", "C0", T2V, "decoder.up_blocks.1"),
    ("dropped-cache", "C0", T2V, "decoder.conv_in"),
    ("rep-context", "C0", T2V, "decoder.up_blocks.0"),
    ("clip-perturbed-weight", "C0", I2V, "encoder.layers.0"),
    ("expert-switch-late", "C1", A14B, "step 2: expert 1, reference expert 2"),
    ("text-padding-not-zeroed", "C1", T2V, "step 0, cond branch, DiT input text: text_encoder.padding"),
    ("rope-wrong-axis", "C1", I2V, "step 0, cond branch, layer blocks.0"),
    ("inverted-latents-std", "C4", T2V, "vae decode (final latents agree)"),
    ("widget-shifted-by-one", "C4", None, "ui/compile"),      # the workflow rows run on the default variants
    ("cfg-read-as-steps", "C4", None, "settings"),
]


@pytest.mark.parametrize("fault, level, variant, where", FAULT_CASES, ids=[f"{f}-{lv}" for f, lv, _, _ in FAULT_CASES])
def test_planted_fault_fails_and_is_localised(fault, level, variant, where):
    report = run(level, [variant] if variant else [], fault=fault)
    bad = failed(report)
    assert bad, f"{level} passed with {fault} planted"
    assert any(where in (c.divergence or "") for c in bad), [(c.name, c.divergence) for c in bad][:6]


def test_every_declared_fault_is_exercised_here():
    """Every C0 / C1 / C4 fault of the family (C2 / C3 ones: tests/test_c2_c3.py) is planted above, and the
    divergence its entry declares is the one asserted."""
    ours = [f for f in get_family("wan").faults if f.level in ("C0", "C1", "C4")]
    assert {f.name for f in ours} == set(faults.FAULT_NAMES)
    ours = [f for f in ours if f.name not in faults.GRAPH_FAULTS]   # planted under --graph: tests/test_compile.py
    assert {(f.name, f.level) for f in ours} <= {(f, lv) for f, lv, _, _ in FAULT_CASES}
    for f in ours:
        if f.divergence:
            assert any(f.name == n and f.level == lv and f.divergence in w for n, lv, _, w in FAULT_CASES), f.name


def test_fault_leaves_nothing_behind():
    """A planted fault is undone on exit: the same components pass again afterwards."""
    m = common.resolve_models([T2V], None, 0)[0]
    fast = common.load_optimized_dit(m.cfg.dit, m.weights["transformer"], "cpu", torch.float32)
    enc = common.load_optimized_umt5(m.cfg.text_encoder, m.weights["text_encoder"], "cpu", torch.float32)
    x = common.DiTInputs(torch.randn(1, 4, 2, 4, 4), torch.tensor([500]), torch.randn(1, 16, 32), None)
    before, ids = fast.forward_batch(x.latents, x.timestep, x.text), [torch.tensor([3, 4, 5])]
    emb = enc.encode(ids, 16)
    for name in ("rope-wrong-axis", "perturbed-weight"):
        with faults.planted_dit(name, fast):
            assert not torch.equal(fast.forward_batch(x.latents, x.timestep, x.text), before)
        assert torch.equal(fast.forward_batch(x.latents, x.timestep, x.text), before)
    with faults.planted_umt5("text-padding-not-zeroed", enc):
        assert enc.encode(ids, 16)[0, 3:].abs().sum() > 0
    assert torch.equal(enc.encode(ids, 16), emb)


# ------------------------------------------------------------------------------------------------ goldens

WAN_CASES = sorted(p.parent for p in (ROOT / "golden" / "wan").glob("*/case.json")
                   if json.loads(p.read_text())["probe"] in ("wan.dit", "wan.umt5", "wan.generate", "wan.vae_decode",
                                                              "wan.vae_encode"))


def test_golden_probes_pass_on_both_sides():
    assert {json.loads((c / "case.json").read_text())["probe"] for c in WAN_CASES} >= {"wan.dit", "wan.umt5",
                                                                                      "wan.generate"}
    report = run_golden_cases(WAN_CASES, ("reference", "optimized"), quiet)
    assert report.passed, [(c.name, c.detail) for c in failed(report)]
    names = [c.name for c in report.checks]
    for want in ("pipe_a14b/optimized:experts", "pipe_ti2v/optimized:model_timesteps", "pipe_i2v/optimized:video",
                 "dit_i2v/optimized:pred_0", "umt5/optimized:prompt_embeds", "pipe_t2v/reference:trajectory"):
        assert want in names, want


def test_golden_case_missing_a_documented_output_fails(tmp_path):
    import shutil

    from safetensors.torch import load_file

    case = tmp_path / "pipe_t2v"
    shutil.copytree(ROOT / "golden" / "wan" / "pipe_t2v", case)
    out = load_file(str(case / "outputs.safetensors"))
    del out["experts"]
    save_file(out, str(case / "outputs.safetensors"))
    report = run_golden_cases([case], ("optimized",), quiet)
    assert not report.passed and any("experts" in c.detail for c in failed(report))


# ------------------------------------------------------------------------------------------------ conversion

def write_pipeline_root(root: Path, variant: str, seed: int = 5) -> dict[str, dict[str, torch.Tensor]]:
    """A diffusers pipeline root written by hand (no upstream package): model_index.json, scheduler config, a
    tokenizer folder, and per component its upstream config.json + safetensors (diffusers / transformers names are
    the canonical names; the UMT5 file carries transformers' tied `encoder.embed_tokens.weight` copy)."""
    cfg = load_model_variant(variant)
    weights = common.random_model_weights(cfg, seed)

    def component(name: str, config: dict, state: dict, file: str) -> None:
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in state.items()}, str(root / name / file))

    component("transformer", cfg.dit.to_diffusers_config(), weights["transformer"],
              "diffusion_pytorch_model.safetensors")
    if cfg.two_experts:
        component("transformer_2", cfg.dit_2.to_diffusers_config(), weights["transformer_2"],
                  "diffusion_pytorch_model.safetensors")
    te = dict(weights["text_encoder"])
    te["encoder.embed_tokens.weight"] = te["shared.weight"].clone()   # (upstream) the tied copy transformers saves
    component("text_encoder", cfg.text_encoder.to_transformers_config(), te, "model.safetensors")
    component("vae", {"_class_name": "AutoencoderKLWan", **cfg.vae.to_diffusers_config()}, weights["vae"],
              "diffusion_pytorch_model.safetensors")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": cfg.num_train_timesteps,
         "flow_shift": cfg.flow_shift, "use_flow_sigmas": True, "prediction_type": "flow_prediction"}))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanImageToVideoPipeline" if cfg.task == "i2v" else "WanPipeline",
        "_diffusers_version": "0.42.1", "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if cfg.two_experts else [None, None],
        "boundary_ratio": cfg.boundary_ratio, "expand_timesteps": cfg.expand_timesteps}))
    return weights


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("variant", [A14B, pytest.param(I2V, marks=pytest.mark.slow),
                                     pytest.param(TI2V, marks=pytest.mark.slow)])
def test_converted_pipeline_engine_from_checkpoint_matches_reference(tmp_path, variant):
    from converters.cli import main

    write_pipeline_root(tmp_path / "src", variant)
    out = tmp_path / "out"
    assert main(["wan", "--from", "diffusers", str(tmp_path / "src"), str(out), "--variant", variant, "-q"]) == 0
    report = json.loads((out / "conversion_report.json").read_text())
    for name, comp in report["components"].items():   # every post-check wired through the entry points, and passed
        assert comp["parity"]["status"] == "pass", (name, comp["parity"])
    assert report["components"]["transformer"]["parity"]["checks"] > 10

    ckpt = read_checkpoint(out)
    cfg = ckpt.typed_config()
    assert cfg == load_model_variant(variant)
    pipe = ref.WanReferencePipeline(cfg, {name: load_state(out, component=name) for name in ckpt.components})
    engine = optimized.Engine.from_checkpoint(out)
    req = common.make_request(cfg, 11, **({"guidance_scale_2": 2.5} if cfg.two_experts else {}))
    want = pipe.generate(req, keep_trajectory=True)
    got = engine.generate(req, record_trajectory=True)
    assert got["timesteps"] == want.timesteps and got["experts"] == want.experts
    assert torch.equal(got["initial"], want.initial)
    for k, (a, b) in enumerate(zip(got["trajectory"], want.trajectory)):
        assert rel_l2(a, b) <= 1e-5, k
    assert rel_l2(got["latents"]["vision"], want.latents) <= 1e-5


def test_post_checks_refuse_the_wrong_component_and_fail_on_a_broken_side(tmp_path, monkeypatch):
    from converters import convert
    from manifests.wan import dit_key_shapes

    cfg = load_model_variant(T2V)
    src = tmp_path / "dit"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg.dit.to_diffusers_config()))
    save_file(common.random_model_weights(cfg, 1)["transformer"], str(src / "diffusion_pytorch_model.safetensors"))
    out = tmp_path / "out"
    convert("wan", "diffusers-transformer", src, out, skip_parity=True)
    assert set(load_state(out)) == set(dit_key_shapes(cfg.dit))
    assert check_converted_transformer(out)["status"] == "pass"
    for wrong in (check_converted, check_converted_text_encoder):
        r = wrong(out)
        assert r["status"] == "error" and "holds a wan transformer" in r["detail"]
    from optimized.models.wan import transformer as fast_dit   # the optimized side broken: the check must fail
    monkeypatch.setattr(fast_dit, "_apply_rope", lambda x, cos, sin: x)
    r = check_converted_transformer(out)
    assert r["status"] == "fail" and any("/dit/forward/" in n for n in r["failed"])


def test_c0_on_a_converted_component_checks_that_component_only(tmp_path):
    from converters import convert

    cfg = load_model_variant(T2V)
    src = tmp_path / "te"
    src.mkdir()
    state = common.random_model_weights(cfg, 2)["text_encoder"]
    (src / "config.json").write_text(json.dumps(cfg.text_encoder.to_transformers_config()))
    save_file(state, str(src / "model.safetensors"))
    convert("wan", "transformers-umt5", src, tmp_path / "out", skip_parity=True)
    report = c0.run_c0([T2V], str(tmp_path / "out"), "cpu", ["fp32"], 0, None, quiet)
    assert report.passed and {c.name.split("/")[2] for c in report.checks} == {"umt5"}
    with pytest.raises(SetupError, match=r"not on checkpoint \(text_encoder\)"):
        c1.run_c1([], str(tmp_path / "out"), "cpu", ["fp32"], 0, None, quiet)   # a loop needs a whole model


# ------------------------------------------------------------------------------------------------ full sweep

@pytest.mark.slow
@pytest.mark.parametrize("level", ["C0", "C1", "C4"])
def test_every_default_variant_passes_through_the_cli(fvparity, level):
    proc = fvparity("run", "wan", "--level", level, *(["--dtype", "all"] if level != "C0" else []))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"wan {level}: PASS" in proc.stdout
