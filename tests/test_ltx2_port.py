"""ltx2 beyond the generated test: every planted fault (one per stream and one across them) fails C0 naming its
layer; the audio output is a C0 check of its own (a fault that only the audio head sees fails); a text row with
every key masked matches upstream's -10000 bias on the optimized side's boolean mask; configs this port does not
cover are refused by name; the four golden cases (LTX-2.0, split RoPE, 2.3, 2.5 switches) pass and pin what they
claim (the RoPE kind, each stream's sigma); and, against diffusers, align names a planted upstream difference in
the audio stream, the hand-written switched keys equal upstream's, and the kit's tiny config / identity manifest
fit LTX-2's constructor and its top-level parameters."""

import dataclasses
from pathlib import Path

import pytest
import torch

from manifests.ltx2 import load_variant
from parity.families.ltx2 import FAMILY, SIDES
from parity.families.ltx2.inputs import make_inputs


def c0(fault=None):
    return FAMILY.levels["C0"](variants=["tiny"], checkpoint=None, device="cpu", dtypes=["fp32"], seed=0,
                               fault=fault, progress=lambda m: None)


@pytest.mark.parametrize("fault", sorted(SIDES.faults))
def test_each_fault_fails_c0_naming_its_layer(fault):
    report = c0(fault)
    _, layer = SIDES.faults[fault]
    failed = [c for c in report.checks if not c.passed]
    # the layer or a module inside it (the block's scale_shift_table first shows in its attn1)
    assert failed and all(c.divergence == layer or c.divergence.startswith(layer + ".") for c in failed), \
        [(c.name, c.divergence) for c in report.checks]


def test_audio_output_is_checked_on_its_own():
    """The audio head's weight changes only the second output: C0 must fail on `forward.out1`, not pass on the
    video output alone (the kit compared the first output only)."""
    clean = c0()
    assert clean.passed and [c.name for c in clean.checks] == ["tiny/fp32/forward", "tiny/fp32/forward.out1"]
    report = c0("scaled-weight-audio_proj_out")
    by_name = {c.name: c for c in report.checks}
    assert by_name["tiny/fp32/forward"].passed
    assert not by_name["tiny/fp32/forward.out1"].passed


def test_fully_masked_text_row_matches_the_reference():
    """Upstream adds -10000 to masked keys, so in a row that keeps no key the shift cancels and it attends to every
    key; the optimized side's boolean mask must do the same there (a plain `mask > 0.5` drops that row's
    attention: rel-L2 ~0.3). Not to 1e-5: upstream's logits - 10000 are
    rounded to fp32's ~1e-3 step at 10^4, the boolean side keeps them exact (the pipeline's masks keep >= 1 token)."""
    cfg = load_variant("tiny")
    state = SIDES.random_state(cfg, 1)
    inputs = make_inputs(cfg, 1)
    inputs["encoder_attention_mask"][1] = 0.0
    inputs["audio_encoder_attention_mask"][1] = 0.0
    want, _ = SIDES.forward_all("reference", cfg, state, inputs)
    got, _ = SIDES.forward_all("optimized", cfg, state, inputs)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert (g - w).norm() / w.norm() < 1e-3


@pytest.mark.parametrize("side", ["reference", "optimized"])
def test_unported_configs_are_refused_by_name(side):
    cfg = dataclasses.replace(load_variant("tiny"), perturbed_attn=True, patch_size=2)
    state = SIDES.random_state(cfg, 0)
    with pytest.raises(ValueError, match="not ported yet: patch_size=2, perturbed_attn=True"):
        SIDES.forward(side, cfg, state, make_inputs(cfg, 0))


def test_key_changing_switches_not_written_are_refused_by_the_keys():
    from manifests import ManifestError
    from manifests.ltx2 import key_shapes

    cfg = dataclasses.replace(load_variant("tiny"), norm_elementwise_affine=True, attention_bias=False)
    with pytest.raises(ManifestError, match="norm_elementwise_affine=True, attention_bias=False"):
        key_shapes(cfg)


@pytest.mark.upstream
def test_align_names_a_planted_upstream_difference_in_the_audio_stream():
    pytest.importorskip("diffusers")
    from parity.align import align

    clean, *_ = align("ltx2", "diffusers:LTX2VideoTransformer3DModel")
    assert clean.passed, [(s.side, s.error, s.first) for s in clean.sides]
    planted, *_ = align("ltx2", "diffusers:LTX2VideoTransformer3DModel", plant="transformer_blocks.0.audio_attn2")
    for side in planted.sides:
        assert side.first is not None and side.first.upstream == "transformer_blocks.0.audio_attn2", side


@pytest.mark.upstream
def test_kit_fits_ltx2_constructor_and_top_level_parameters():
    pytest.importorskip("diffusers")
    from parity.port import upstream as U

    up = U.resolve("diffusers:LTX2VideoTransformer3DModel")
    tiny = U.tiny_config(up, U.default_config(up), {})
    # a modality-prefixed width shrinks with the rest (else the audio cross-attention RoPE is 2048 wide on 16)
    assert tiny["audio_cross_attention_dim"] == tiny["audio_num_attention_heads"] * tiny["audio_attention_head_dim"]
    # every boolean switch that changes upstream's keys is either written (keys._switched) or refused by name
    from manifests.ltx2.keys import FITTED_SWITCHES
    written = {"gated_attn", "audio_gated_attn", "cross_attn_mod", "audio_cross_attn_mod", "use_prompt_embeddings",
               "ff_bias", "audio_ff_bias", "use_keyframes_abs_pos_embedding"}
    assert {w.field for w in U.key_switches(up, tiny)} == written | set(FITTED_SWITCHES)
    manifest = SIDES.manifest()
    config = load_variant("tiny").to_dict()
    assert manifest.match("scale_shift_table", config)[1] == "scale_shift_table"
    assert manifest.match("audio_scale_shift_table", config)[1] == "audio_scale_shift_table"


GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "ltx2"


def test_every_golden_case_passes_both_sides():
    from click.testing import CliRunner

    from parity.cli import cli

    cases = sorted(p for p in GOLDEN.iterdir() if (p / "case.json").is_file())
    assert [p.name for p in cases] == ["tiny_23_forward", "tiny_25_forward", "tiny_forward", "tiny_split_forward"]
    r = CliRunner().invoke(cli, ["golden", *map(str, cases)])
    assert r.exit_code == 0 and "16/16 checks passed" in r.output, r.output


def _case(name: str):
    from parity.golden import load_case, read_diffusers_dir

    case = load_case(GOLDEN / name)
    config, up_state = read_diffusers_dir(case)
    return case, SIDES.config_from_upstream(config), SIDES.canonical_state(up_state, config), dict(case.inputs)


def _misses(case, cfg, state, inputs) -> bool:
    out, _ = SIDES.forward("reference", cfg, state, inputs)
    want = case.outputs["out"]
    return bool((out - want).norm() / want.norm() > 1e-3)


def test_split_rope_case_tells_the_rope_kinds_apart():
    """The same weights and inputs with interleaved RoPE miss the split case's output (4 video heads, 2 audio)."""
    case, cfg, state, inputs = _case("tiny_split_forward")
    assert cfg.rope_type == "split" and cfg.num_attention_heads != cfg.audio_num_attention_heads
    assert _misses(case, dataclasses.replace(cfg, rope_type="interleaved"), state, inputs)


def test_ltx23_case_reads_each_streams_sigma():
    """LTX-2.3's text modulation follows sigma per stream: swapping video and audio sigma misses the case."""
    case, cfg, state, inputs = _case("tiny_23_forward")
    assert cfg.cross_attn_mod and cfg.gated_attn and not cfg.use_prompt_embeddings
    assert not _misses(case, cfg, state, inputs)
    swapped = {**inputs, "sigma": inputs["audio_sigma"], "audio_sigma": inputs["sigma"]}
    assert _misses(case, cfg, state, swapped)


def test_ltx25_case_applies_the_keyframe_embedding_to_marked_tokens():
    """LTX-2.5's keyframe embedding goes to the marked tokens only: dropping the marker misses the case."""
    case, cfg, state, inputs = _case("tiny_25_forward")
    assert cfg.use_keyframes_abs_pos_embedding and not cfg.use_prompt_adaln_single and not cfg.ff_bias
    assert not _misses(case, cfg, state, inputs)
    assert _misses(case, cfg, state, {**inputs, "video_keyframes_mask": torch.zeros_like(inputs["video_keyframes_mask"])})


@pytest.mark.upstream
@pytest.mark.parametrize("switches", [{"gated_attn": True}, {"audio_gated_attn": True}, {"cross_attn_mod": True},
                                      {"audio_cross_attn_mod": True},
                                      {"cross_attn_mod": True, "use_prompt_adaln_single": False},
                                      {"ff_bias": False, "audio_ff_bias": False}, {"use_prompt_embeddings": False},
                                      {"use_keyframes_abs_pos_embedding": True}])
def test_switched_keys_match_upstream(switches):
    """manifests/ltx2/keys.py's hand-written switches (the scaffold fits int fields only) against upstream's own
    state dict, on the config with unequal head counts."""
    pytest.importorskip("diffusers")
    from manifests.ltx2 import key_shapes
    from parity.port.upstream import resolve, shapes_of

    cfg = dataclasses.replace(load_variant("tiny-split"), **switches)
    want = shapes_of(resolve("diffusers:LTX2VideoTransformer3DModel").build(cfg.to_dict()))
    assert key_shapes(cfg) == want


def _original_key(key: str) -> str:
    """A diffusers ltx2 key in the Lightricks single-file spelling (the inverse of diffusers' renames; the test
    below checks it against diffusers' own converter)."""
    for new, old in (("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
                     ("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
                     ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
                     ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
                     ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
                     ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
                     (".norm_q.", ".q_norm."), (".norm_k.", ".k_norm.")):
        key = key.replace(new, old)
    for new, old in (("audio_time_embed.", "audio_adaln_single."), ("time_embed.", "adaln_single."),
                     ("audio_proj_in.", "audio_patchify_proj."), ("proj_in.", "patchify_proj.")):
        if key.startswith(new):
            key = old + key[len(new):]
    return "model.diffusion_model." + key


@pytest.mark.upstream
def test_fvconvert_from_the_original_single_file(tmp_path, capsys):
    """`fvconvert ltx2 --from original` on a Lightricks-layout file (made from the golden's weights; diffusers'
    convert_ltx2_transformer_to_diffusers maps it back to them exactly): the connector and VAE keys are dropped, the
    post-check passes, and every converted tensor equals the diffusers one bitwise."""
    pytest.importorskip("diffusers")
    from diffusers.loaders.single_file_utils import (
        convert_ltx2_transformer_to_diffusers,
    )
    from safetensors.torch import load_file, save_file

    from converters.cli import main

    want = load_file(str(GOLDEN / "tiny_forward" / "upstream" / "diffusion_pytorch_model.safetensors"))
    original = {_original_key(k): v for k, v in want.items()}
    original["model.diffusion_model.video_embeddings_connector.learnable_registers"] = torch.zeros(4, 16)
    assert set(convert_ltx2_transformer_to_diffusers(dict(original))) == set(want)
    original["vae.per_channel_statistics.mean-of-means"] = torch.zeros(8)   # the single file's other parts
    original["audio_vae.per_channel_statistics.mean-of-means"] = torch.zeros(8)
    src = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file(original, str(src))
    assert main(["ltx2", "--from", "original", str(src), str(tmp_path / "out"), "--variant", "tiny"]) == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    stray = {**original, "model.diffusion_model.not_a_module.weight": torch.zeros(1)}
    save_file(stray, str(src))
    assert main(["ltx2", "--from", "original", str(src), str(tmp_path / "out2"), "--variant", "tiny"]) == 2
    assert not (tmp_path / "out2").exists()
    assert "not_a_module" in capsys.readouterr().err
