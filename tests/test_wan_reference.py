"""Reference Wan DiT and UMT5 encoder: canonical names, committed upstream goldens (always run), planted bugs that
the golden check must catch, and direct comparisons with diffusers / transformers on fresh weights (upstream)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reference.wan.transformer as ref_dit
from manifests.wan.dit import UMT5Config, WanDiTConfig, dit_key_shapes, umt5_key_shapes
from manifests.wan.model import load_model_variant
from reference.wan import UMT5Encoder, WanTransformer, encode_prompts, load_umt5, load_wan_transformer

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "wan"
DIT_CASES = ["dit_t2v", "dit_i2v", "dit_ti2v"]
rel = lambda got, want: float((got - want).norm() / want.norm())

T2V = load_model_variant("tiny-2.1-t2v").dit
I2V = load_model_variant("tiny-2.1-i2v").dit
TI2V = load_model_variant("tiny-2.2-ti2v").dit
UMT5 = load_model_variant("tiny-2.1-t2v").text_encoder


# ----------------------------------------------------------------------------------------------
# golden checks (no upstream packages needed)
# ----------------------------------------------------------------------------------------------

def check_dit_case(name: str) -> dict[str, float]:
    """rel-L2 of every stored prediction, reference model on the case's upstream weights (= canonical names)."""
    case = GOLDEN / name
    cfg = WanDiTConfig.from_diffusers_config(json.loads((case / "upstream" / "config.json").read_text()))
    model = load_wan_transformer(cfg, load_file(str(case / "upstream" / "diffusion_pytorch_model.safetensors")))
    inputs, want = load_file(str(case / "inputs.safetensors")), load_file(str(case / "outputs.safetensors"))
    n = json.loads((case / "case.json").read_text())["params"]["num_calls"]
    with torch.no_grad():
        return {f"pred_{k}": rel(model(inputs[f"latents_{k}"], inputs[f"timestep_{k}"], inputs[f"text_{k}"],
                                       inputs.get(f"image_embeds_{k}")), want[f"pred_{k}"]) for k in range(n)}


def check_umt5_case(encode=encode_prompts) -> dict[str, float]:
    case = GOLDEN / "umt5"
    cfg = UMT5Config.from_transformers_config(json.loads((case / "upstream" / "config.json").read_text()))
    state = load_file(str(case / "upstream" / "model.safetensors"))
    state.pop("encoder.embed_tokens.weight", None)     # transformers' tied copy of shared.weight
    model = load_umt5(cfg, state)
    inputs, want = load_file(str(case / "inputs.safetensors")), load_file(str(case / "outputs.safetensors"))
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    ids_list = [row[m.bool()] for row, m in zip(ids, mask)]
    with torch.no_grad():
        return {"hidden_states": rel(model(ids, mask), want["hidden_states"]),
                "prompt_embeds": rel(encode(model, ids_list, ids.shape[1]), want["prompt_embeds"])}


def tolerance(name: str) -> float:
    return json.loads((GOLDEN / name / "case.json").read_text())["tolerance"]["rel_l2"]


@pytest.mark.parametrize("cfg", [T2V, I2V, TI2V, replace(T2V, cross_attn_norm=False),
                                 replace(I2V, pos_embed_seq_len=10)], ids=["t2v", "i2v", "ti2v", "no_xnorm", "flf2v"])
def test_dit_parameter_names_are_canonical(cfg):
    assert {k: tuple(v.shape) for k, v in WanTransformer(cfg).state_dict().items()} == dit_key_shapes(cfg)


def test_umt5_parameter_names_are_canonical():
    assert {k: tuple(v.shape) for k, v in UMT5Encoder(UMT5).state_dict().items()} == umt5_key_shapes(UMT5)


def test_loaders_are_strict():
    state = {k: torch.zeros(s) for k, s in dit_key_shapes(T2V).items()}
    state.pop("proj_out.bias")
    with pytest.raises(ValueError, match="proj_out.bias"):
        load_wan_transformer(T2V, state)
    state = {k: torch.zeros(s) for k, s in umt5_key_shapes(UMT5).items()}
    state["encoder.embed_tokens.weight"] = state["shared.weight"]
    with pytest.raises(ValueError, match="embed_tokens"):
        load_umt5(UMT5, state)


@pytest.mark.parametrize("name", DIT_CASES)
def test_dit_matches_golden(name):
    got = check_dit_case(name)
    assert got and all(v <= tolerance(name) for v in got.values()), got


def test_umt5_matches_golden():
    got = check_umt5_case()
    assert all(v <= tolerance("umt5") for v in got.values()), got


def test_golden_cases_are_small_and_nontrivial():
    for name in DIT_CASES + ["umt5"]:
        case = GOLDEN / name
        assert sum(f.stat().st_size for f in case.rglob("*") if f.is_file()) < 300 * 1024
        for k, v in load_file(str(case / "outputs.safetensors")).items():
            assert 0.3 < float(v.std()) < 3.0, (name, k)


# ----------------------------------------------------------------------------------------------
# planted bugs: the golden check must fail
# ----------------------------------------------------------------------------------------------

def test_golden_catches_rope_on_swapped_axes(monkeypatch):
    true_rope = ref_dit.rope_cos_sin

    def swapped(cfg, grid, device):          # h-frequencies on w positions and vice versa (h_dim == w_dim)
        t2, h2, _ = (d // 2 for d in cfg.rope_dims())
        return tuple(torch.cat([c[:, :t2], c[:, t2 + h2:], c[:, t2:t2 + h2]], dim=1)
                     for c in true_rope(cfg, grid, device))
    monkeypatch.setattr(ref_dit, "rope_cos_sin", swapped)
    got = check_dit_case("dit_t2v")
    assert max(got.values()) > 100 * tolerance("dit_t2v"), got


def test_golden_catches_timestep_off_by_one(monkeypatch):
    true_sinusoid = ref_dit.timestep_sinusoid
    monkeypatch.setattr(ref_dit, "timestep_sinusoid", lambda t, dim: true_sinusoid(t + 1, dim))
    got = check_dit_case("dit_ti2v")
    assert min(got.values()) > 10 * tolerance("dit_ti2v"), got


def test_golden_catches_dropped_image_branch(monkeypatch):
    true_attention = ref_dit.attention
    calls = []

    def no_image(q, k, v):                   # attn2's second call per block is the image attention: zero it
        calls.append(k.shape[1])
        out = true_attention(q, k, v)
        return torch.zeros_like(out) if k.shape[1] == 5 else out
    monkeypatch.setattr(ref_dit, "attention", no_image)
    got = check_dit_case("dit_i2v")
    assert 5 in calls and got["pred_0"] > 100 * tolerance("dit_i2v"), got


def test_golden_catches_unzeroed_padding():
    def keep_padding(encoder, ids_list, max_len):
        ids = torch.stack([torch.nn.functional.pad(t, (0, max_len - len(t))) for t in ids_list])
        return encoder(ids, ids != 0)
    got = check_umt5_case(keep_padding)
    assert got["hidden_states"] <= tolerance("umt5") and got["prompt_embeds"] > 100 * tolerance("umt5"), got


# ----------------------------------------------------------------------------------------------
# upstream: reference vs diffusers / transformers directly, fresh random weights
# ----------------------------------------------------------------------------------------------

def _upstream_dit(cfg: WanDiTConfig, seed: int):
    diffusers = pytest.importorskip("diffusers")
    from tools.make_wan_goldens import randomize_weights
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(**{k: v for k, v in cfg.to_diffusers_config().items()
                                               if k != "_class_name"}).eval()
    randomize_weights(model, seed)
    return model, load_wan_transformer(cfg, {k: v.clone() for k, v in model.state_dict().items()})


def _first_frame_timesteps(ts, grid):
    mask = torch.ones(grid)
    mask[0] = 0
    return torch.stack([(mask * t).flatten() for t in ts]).float()


UPSTREAM_DIT = {   # name: (cfg, latents shape, timestep, text length, image tokens)
    "t2v_B2_two_timesteps": (T2V, [2, 4, 3, 4, 6], torch.tensor([999, 3]), 16, None),
    "t2v_odd_T_5": (T2V, [1, 4, 5, 2, 4], torch.tensor([500]), 16, None),
    "t2v_no_cross_attn_norm": (replace(T2V, cross_attn_norm=False), [1, 4, 2, 4, 4], torch.tensor([250]), 9, None),
    "t2v_patch_2x2x2_odd_grid": (replace(T2V, patch_size=(2, 2, 2), num_heads=3, head_dim=16), [1, 4, 5, 5, 6],
                                 torch.tensor([777]), 16, None),
    "i2v_image_branch": (I2V, [2, 12, 3, 4, 4], torch.tensor([999, 640]), 512, 5),
    "flf2v_pos_embed": (replace(I2V, pos_embed_seq_len=6), [1, 12, 2, 4, 4], torch.tensor([300]), 512, 3),
    "ti2v_per_token": (TI2V, [2, 6, 3, 4, 4], _first_frame_timesteps([937.0, 500.5], (3, 2, 2)), 16, None),
}


@pytest.mark.upstream
@pytest.mark.parametrize("name", list(UPSTREAM_DIT))
def test_dit_matches_diffusers(name):
    cfg, shape, timestep, text_len, image_tokens = UPSTREAM_DIT[name]
    up, ref = _upstream_dit(cfg, seed=7)
    g = torch.Generator().manual_seed(8)
    latents = torch.randn(shape, generator=g)
    text = torch.randn(shape[0], text_len, cfg.text_dim, generator=g)
    image = None
    if image_tokens:   # FLF2V: two image rows (first, last frame) per sample
        rows = shape[0] * (2 if cfg.pos_embed_seq_len else 1)
        image = torch.randn(rows, image_tokens, cfg.image_dim, generator=g)
    with torch.no_grad():
        want = up(latents, timestep, text, image, return_dict=False)[0]
        got = ref(latents, timestep, text, image)
    assert got.shape == want.shape and float(want.std()) > 0.3
    assert rel(got, want) <= 1e-5, rel(got, want)


@pytest.mark.upstream
def test_per_token_uniform_timestep_is_close_to_scalar_path():
    """Documented upstream fact: a uniform [B, S] timestep differs from the [B] path only by rounding."""
    _, ref = _upstream_dit(TI2V, seed=9)
    x, text = torch.randn(1, 6, 2, 4, 4), torch.randn(1, 16, TI2V.text_dim)
    with torch.no_grad():
        a = ref(x, torch.tensor([400]), text)
        b = ref(x, torch.full((1, 8), 400.0), text)
    assert 0 <= rel(b, a) < 1e-5


@pytest.mark.upstream
@pytest.mark.parametrize("lens", [(5, 19), (24, 1), (3,)], ids=["pad", "full_and_one", "single"])
def test_umt5_matches_transformers_and_pipeline(lens):
    pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    from tools.make_wan_goldens import hf_umt5_config, pipeline_prompt_embeds, randomize_weights
    torch.manual_seed(3)
    up = transformers.UMT5EncoderModel(hf_umt5_config("tiny-2.1-t2v")).eval()
    randomize_weights(up, 3)
    state = {k: v.clone() for k, v in up.state_dict().items() if k != "encoder.embed_tokens.weight"}
    ref = load_umt5(UMT5, state)
    L, g = 24, torch.Generator().manual_seed(4)
    ids_list = [torch.randint(1, UMT5.vocab_size, (n,), generator=g) for n in lens]
    ids = torch.stack([torch.nn.functional.pad(t, (0, L - len(t))) for t in ids_list])
    mask = (torch.arange(L)[None] < torch.tensor(lens)[:, None]).long()
    with torch.no_grad():
        want_hidden = up(ids, mask).last_hidden_state
        want_embeds = pipeline_prompt_embeds(up, ids, mask)
        assert rel(ref(ids, mask), want_hidden) <= 1e-5
        got = encode_prompts(ref, ids_list, L)
    assert rel(got, want_embeds) <= 1e-5
    for i, n in enumerate(lens):
        assert torch.all(got[i, n:] == 0) and (n == L or want_hidden[i, n:].abs().sum() > 0)
