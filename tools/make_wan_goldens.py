#!/usr/bin/env python
"""Make golden cases for probes ``wan.dit`` (diffusers ``WanTransformer3DModel``) and ``wan.umt5`` (transformers
``UMT5EncoderModel`` + WanPipeline ``_get_t5_prompt_embeds`` semantics), tiny configs, seeded random weights.
Format: golden/README.md (case layout; section "Probes wan.dit and wan.umt5").

    python tools/make_wan_goldens.py --out golden                # every case below (golden/wan/dit_*, umt5)
    python tools/make_wan_goldens.py --out golden --only dit_i2v
    python tools/make_wan_goldens.py --verify golden/wan/dit_* golden/wan/umt5   # re-run upstream, compare bitwise

Needs diffusers (0.42.1 was used), transformers (5.24.0), torch, safetensors; --verify needs accelerate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from manifests.wan.model import load_model_variant  # noqa: E402

REL_L2_TOL = 1e-5
# bf16 cases: both sides measured bit-identical to diffusers' bf16 CPU forward (rel-L2 0, torch 2.13 x86_64); one
# extra bf16 rounding (the gated residual x + f * gate in bf16 instead of fp32) measures 3.7e-3..4.7e-3
BF16_REL_L2_TOL = 1.5e-3
TEXT_LEN_I2V = 512   # upstream's I2V attention splits the context at L - 512

# calls: one DiT forward each; "text_lens" = per-sample count of non-zero text tokens (the rest are the pipeline's
# zero padding); "timestep": ints per sample, or ("first_frame", [t per sample]) for per-token TI2V timesteps
# (0 on latent frame 0, t elsewhere), or ("uniform", [t]) for the same float t on every token.
CASES = {
    "dit_t2v": dict(probe="wan.dit", variant="tiny-2.1-t2v", seed=400, calls=[
        dict(latents=[2, 4, 3, 4, 6], timestep=[937, 125], text_len=16, text_lens=[9, 16]),
        dict(latents=[1, 4, 4, 6, 2], timestep=[500], text_len=16, text_lens=[5])],
        description="tiny Wan2.1 T2V DiT: B=2 with different timesteps on an odd-T grid (3x2x3 patches), then "
                    "B=1 on 4x3x1; text zero-padded after each prompt's length"),
    "dit_i2v": dict(probe="wan.dit", variant="tiny-2.1-i2v", seed=410, calls=[
        dict(latents=[1, 12, 3, 4, 4], timestep=[999], text_len=TEXT_LEN_I2V, text_lens=[7], image_tokens=5)],
        description="tiny Wan2.1 I2V DiT: image branch (5 CLIP tokens -> image embedder -> add_k/add_v "
                    "attention in attn2), 512-token text context (7 real tokens), 12 input channels"),
    "dit_ti2v": dict(probe="wan.dit", variant="tiny-2.2-ti2v", seed=420, calls=[
        dict(latents=[2, 6, 3, 4, 4], timestep=("first_frame", [937.0, 500.0]), text_len=16, text_lens=[6, 11]),
        dict(latents=[1, 6, 3, 2, 6], timestep=("uniform", [333.5]), text_len=16, text_lens=[16])],
        description="tiny Wan2.2 TI2V DiT, expand_timesteps: per-token float timesteps [B, S] (0 on latent "
                    "frame 0, as WanPipeline builds them), B=2 with different t; then a uniform fractional t"),
    "dit_i2v_flat_image": dict(probe="wan.dit", variant="tiny-2.1-i2v", seed=440, calls=[
        dict(latents=[1, 12, 2, 4, 4], timestep=[875], text_len=TEXT_LEN_I2V, text_lens=[6], image_tokens=4,
             image_std=2e-3)],
        description="tiny Wan2.1 I2V DiT with CLIP embeddings of std 2e-3 (per-token variance ~4e-6): the image "
                    "embedder's FP32LayerNorm eps (nn.LayerNorm's 1e-5, not the model's 1e-6) moves the output"),
    "dit_i2v_original": dict(probe="wan.dit", variant="tiny-2.1-i2v", seed=450, upstream_format="original", calls=[
        dict(latents=[1, 12, 2, 4, 4], timestep=[909], text_len=TEXT_LEN_I2V, text_lens=[9], image_tokens=3)],
        description="tiny Wan2.1 I2V DiT stored in the original Wan-AI release layout (self_attn / cross_attn.k_img "
                    "/ v_img / norm_k_img, img_emb.proj.*, head.*, modulation): the stored file converts back to "
                    "the diffusers model bit for bit through diffusers' own convert_wan_transformer_to_diffusers"),
    "dit_t2v_bf16": dict(probe="wan.dit", variant="tiny-2.1-t2v", seed=460, dtype="bfloat16",
                         tolerance=BF16_REL_L2_TOL, calls=[
        dict(latents=[2, 4, 3, 4, 6], timestep=[937, 250], text_len=16, text_lens=[8, 16]),
        dict(latents=[1, 4, 2, 6, 4], timestep=[500], text_len=16, text_lens=[3])],
        description="tiny Wan2.1 T2V DiT in bf16 as diffusers loads it (from_pretrained(torch_dtype=bfloat16): "
                    "_keep_in_fp32_modules stay fp32), bf16 inputs, on CPU: pins where upstream computes in fp32 "
                    "(the gated residuals, the norms) at a tolerance set from measured clean noise"),
    "umt5": dict(probe="wan.umt5", variant="tiny-2.1-t2v", seed=430, prompt_lens=[5, 19], max_sequence_length=24,
                 description="tiny UMT5 encoder (8 buckets, max distance 16): prompts of 5 and 19 tokens padded "
                             "to 24 (distances past max_distance), raw hidden states and the pipeline's "
                             "trimmed, zero-padded prompt embeds"),
    "umt5_original": dict(probe="wan.umt5", variant="tiny-2.1-t2v", seed=470, upstream_format="original",
                          prompt_lens=[7, 16], max_sequence_length=20,
                          description="tiny UMT5 encoder stored in the original Wan-AI layout (wan/modules/t5.py "
                                      "T5Encoder: token_embedding, attn.q/k/v/o, pos_embedding, norm1 / norm2, "
                                      "ffn.gate.0 / fc1 / fc2, norm) as models_t5_umt5-xxl-enc-bf16.pth (fp32): "
                                      "gate.0 and fc1 are equal in shape and independent, so crossing them fails"),
    "dit_t2v_original": dict(probe="wan.dit", variant="tiny-2.1-t2v", seed=480, upstream_format="original", calls=[
        dict(latents=[1, 4, 2, 4, 6], timestep=[777], text_len=16, text_lens=[10])],
        description="tiny Wan2.1 T2V DiT stored in the original Wan-AI release layout (self_attn / cross_attn, "
                    "norm3 = the cross-attention norm, head.*, modulation): the second original-layout case, so a "
                    "converter that crosses self / cross attention names fails two cases"),
}


def _setup() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Every parameter in named_parameters() order (tied weights once) from one generator, r = randn(shape):
    norm weights (name has "norm", incl. T5 layer_norm) 1 + 0.1r; biases 0.1r; scale_shift_table 0.3r;
    pos_embed 0.1r; token embedding `shared.weight` and `relative_attention_bias` r; every other weight
    (Linear, Conv3d) r / sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                x = 1 + 0.1 * r
            elif name.endswith("bias"):
                x = 0.1 * r
            elif name.endswith("scale_shift_table"):
                x = 0.3 * r
            elif name.endswith("pos_embed"):
                x = 0.1 * r
            elif name in ("shared.weight",) or name.endswith("relative_attention_bias.weight"):
                x = r
            else:
                x = r / (p[0].numel() ** 0.5)
            p.copy_(x)


def hf_umt5_config(variant: str):
    from transformers import UMT5Config as HFUMT5Config
    c = load_model_variant(variant).text_encoder.to_transformers_config()
    drop = ("model_type", "architectures", "dense_act_fn", "is_gated_act")   # derived from feed_forward_proj
    return HFUMT5Config(**{k: v for k, v in c.items() if k not in drop})


def build_model(spec: dict):
    torch.manual_seed(spec["seed"])
    if spec["probe"] == "wan.dit":
        from diffusers import WanTransformer3DModel
        cfg = load_model_variant(spec["variant"]).dit.to_diffusers_config()
        model = WanTransformer3DModel(**{k: v for k, v in cfg.items() if k != "_class_name"})
    else:
        from transformers import UMT5EncoderModel
        model = UMT5EncoderModel(hf_umt5_config(spec["variant"]))
        assert model.encoder.embed_tokens.weight is model.shared.weight, "embed_tokens must be tied to shared"
    model = model.eval()
    randomize_weights(model, spec["seed"])
    return model


# diffusers WanTransformer3DModel name -> original Wan-AI WanModel name (wan/modules/model.py), applied in order;
# build_case checks the result with diffusers' own convert_wan_transformer_to_diffusers (tensor for tensor)
TO_ORIGINAL = (
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_q\.", ".q."), (r"\.to_k\.", ".k."), (r"\.to_v\.", ".v."), (r"\.to_out\.0\.", ".o."),
    (r"\.add_k_proj\.", ".k_img."), (r"\.add_v_proj\.", ".v_img."), (r"\.norm_added_k\.", ".norm_k_img."),
    (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),               # the cross-attention norm is norm3 in WanModel
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."), (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
)


def original_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights in the original Wan-AI layout, checked against upstream's own converter."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    orig = _renamed(sd, TO_ORIGINAL)
    back = convert_wan_transformer_to_diffusers(dict(orig))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd), "not the inverse of upstream's"
    return orig


# transformers UMT5EncoderModel name -> original Wan-AI T5Encoder name (Wan-Video wan/modules/t5.py, shared_pos=False:
# one relative bias per block); diffusers has no converter for this file, so build_case checks the mapping by
# computing Wan's T5FeedForward (`fc2(fc1(x) * gate(x))`, gate = [Linear, tanh-GELU]) from the renamed tensors
UMT5_TO_ORIGINAL = (
    (r"^shared\.weight$", "token_embedding.weight"),
    (r"^encoder\.final_layer_norm\.", "norm."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.", r"blocks.\1.pos_embedding.embedding."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.(q|k|v|o)\.", r"blocks.\1.attn.\2."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"blocks.\1.norm1."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"blocks.\1.norm2."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_0\.", r"blocks.\1.ffn.gate.0."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_1\.", r"blocks.\1.ffn.fc1."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wo\.", r"blocks.\1.ffn.fc2."),
)
UMT5_ORIGINAL_FILE = "models_t5_umt5-xxl-enc-bf16.pth"   # the release's name (its dtype: bf16; stored here in fp32)


def _renamed(sd: dict[str, torch.Tensor], table) -> dict[str, torch.Tensor]:
    import re
    out = {}
    for k, v in sd.items():
        name = k
        for pattern, repl in table:
            name = re.sub(pattern, repl, name)
        out[name] = v
    return out


@torch.no_grad()
def original_umt5_state_dict(model) -> dict[str, torch.Tensor]:
    """The encoder's weights in the Wan-AI T5Encoder layout (the tied `encoder.embed_tokens` copy dropped), checked
    by running Wan's feed-forward block (T5LayerNorm norm2, then fc2(fc1(x) * gelu_tanh(gate.0(x))), residual) from
    the renamed tensors against transformers' own `layer[1]` of every block."""
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}
    orig = _renamed(sd, UMT5_TO_ORIGINAL)
    assert len(orig) == len(sd) and all(k.startswith(("blocks.", "token_embedding.", "norm.")) for k in orig), \
        sorted(orig)
    x = torch.randn(3, 5, model.config.d_model, generator=torch.Generator().manual_seed(0))
    gelu_tanh = lambda u: 0.5 * u * (1.0 + torch.tanh((2.0 / torch.pi) ** 0.5 * (u + 0.044715 * u ** 3)))
    for i, block in enumerate(model.encoder.block):
        o = {k.split(".", 2)[2]: v for k, v in orig.items() if k.startswith(f"blocks.{i}.")}
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.layer_norm_epsilon) * o["norm2.weight"]
        wan = x + (n @ o["ffn.fc1.weight"].T * gelu_tanh(n @ o["ffn.gate.0.weight"].T)) @ o["ffn.fc2.weight"].T
        assert torch.allclose(wan, block.layer[1](x), rtol=1e-5, atol=1e-5), f"block {i}: not Wan's T5FeedForward"
    return orig


def _timesteps(spec_t, latents_shape: list[int], patch) -> torch.Tensor:
    if isinstance(spec_t, list):
        return torch.tensor(spec_t, dtype=torch.int64)          # what WanPipeline passes: t.expand(B), int64
    kind, ts = spec_t
    B, _, T, H, W = latents_shape
    grid = (T // patch[0], H // patch[1], W // patch[2])
    mask = torch.ones(grid)                                       # WanPipeline: first_frame_mask[0][0][:, ::2, ::2]
    if kind == "first_frame":
        mask[0] = 0
    return torch.stack([(mask * t).flatten() for t in ts]).float()


def make_inputs(spec: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    cfg = load_model_variant(spec["variant"])
    if spec["probe"] == "wan.umt5":
        L = spec["max_sequence_length"]
        ids = torch.zeros(len(spec["prompt_lens"]), L, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(spec["prompt_lens"]):
            ids[i, :n] = torch.randint(1, cfg.text_encoder.vocab_size, (n,), generator=g)
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask}
    out = {}
    for k, call in enumerate(spec["calls"]):
        B = call["latents"][0]
        out[f"latents_{k}"] = torch.randn(call["latents"], generator=g)
        out[f"timestep_{k}"] = _timesteps(call["timestep"], call["latents"], cfg.dit.patch_size)
        text = torch.randn(B, call["text_len"], cfg.dit.text_dim, generator=g)
        for i, n in enumerate(call["text_lens"]):
            text[i, n:] = 0                                       # the pipeline's zero padding
        out[f"text_{k}"] = text
        if call.get("image_tokens"):
            out[f"image_embeds_{k}"] = call.get("image_std", 1.0) * torch.randn(B, call["image_tokens"],
                                                                                 cfg.dit.image_dim, generator=g)
    return out


def pipeline_prompt_embeds(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """WanPipeline._get_t5_prompt_embeds itself (unbound, duck-typed self) with a tokenizer stub that returns the
    stored ids / mask: trims each prompt to its length and zero-pads to max_sequence_length = ids.shape[1]."""
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline

    def tokenizer(prompts, padding, max_length, truncation, add_special_tokens, return_attention_mask,
                  return_tensors):
        assert padding == "max_length" and max_length == ids.shape[1] and len(prompts) == len(ids)
        return SimpleNamespace(input_ids=ids, attention_mask=mask)

    self = SimpleNamespace(tokenizer=tokenizer, text_encoder=model)
    return WanPipeline._get_t5_prompt_embeds(self, prompt=["-"] * len(ids), max_sequence_length=ids.shape[1],
                                             device=torch.device("cpu"), dtype=torch.float32)


def run_probe(model, spec: dict, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        if spec["probe"] == "wan.umt5":
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            hidden = model(ids, mask).last_hidden_state
            return {"hidden_states": hidden, "prompt_embeds": pipeline_prompt_embeds(model, ids, mask)}
        out = {}
        for k in range(len(spec["calls"])):
            out[f"pred_{k}"] = model(inputs[f"latents_{k}"], inputs[f"timestep_{k}"], inputs[f"text_{k}"],
                                     inputs.get(f"image_embeds_{k}"), return_dict=False)[0]
        return out


def _spec_of(case: Path, meta: dict) -> dict:
    spec = dict(CASES[case.name]) if case.name in CASES else {}
    spec.update(probe=meta["probe"], seed=meta["seed"])
    if meta["probe"] == "wan.dit":
        spec["calls"] = [None] * meta["params"]["num_calls"]
    return spec


def load_bf16(upstream: Path):
    """WanTransformer3DModel.from_pretrained(torch_dtype=bfloat16): its `_keep_in_fp32_modules` stay fp32."""
    from diffusers import WanTransformer3DModel
    model = WanTransformer3DModel.from_pretrained(upstream, torch_dtype=torch.bfloat16).eval()
    assert model.scale_shift_table.dtype == torch.float32 and model.proj_out.weight.dtype == torch.bfloat16
    return model


def upstream_config(model) -> dict:
    """The config.json `save_pretrained` writes: what an original-layout case carries as case.json `config` (the
    release layout has no config the converter reads; golden/README.md)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        return json.loads((Path(d) / "config.json").read_text())


def build_case(name: str, out_root: Path) -> Path:
    import diffusers
    import transformers
    spec = CASES[name]
    _setup()
    model = build_model(spec)
    inputs = make_inputs(spec)
    case = out_root / "wan" / name
    if case.exists():
        shutil.rmtree(case)
    (case / "upstream").mkdir(parents=True)
    fmt = spec.get("upstream_format")
    if fmt == "original" and spec["probe"] == "wan.umt5":   # the release's .pth: T5Encoder names, no config
        torch.save(original_umt5_state_dict(model), case / "upstream" / UMT5_ORIGINAL_FILE)
    elif fmt == "original":   # the release layout: WanModel names, no config the converter reads (params.variant)
        save_file(original_state_dict(model), str(case / "upstream" / "diffusion_pytorch_model.safetensors"))
    else:
        model.save_pretrained(case / "upstream", safe_serialization=True)
    dtype = spec.get("dtype", "float32")
    if dtype == "bfloat16":   # the stored fp32 weights loaded as diffusers loads a bf16 model; bf16 float inputs
        model = load_bf16(case / "upstream")
        inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    outputs = {k: v.contiguous() for k, v in run_probe(model, spec, inputs).items()}
    for k, v in outputs.items():
        if not torch.isfinite(v).all():
            raise RuntimeError(f"{name}: non-finite {k}")
    save_file(inputs, str(case / "inputs.safetensors"))
    save_file(outputs, str(case / "outputs.safetensors"))
    if spec["probe"] == "wan.dit":
        upstream = {"package": "diffusers", "version": diffusers.__version__, "class": "WanTransformer3DModel"}
        params = {"num_calls": len(spec["calls"]), "variant": spec["variant"]}
        fmt = fmt or "diffusers"
    else:
        upstream = {"package": "transformers", "version": transformers.__version__, "class": "UMT5EncoderModel"}
        params = {"max_sequence_length": spec["max_sequence_length"], "seq_lens": spec["prompt_lens"],
                  "variant": spec["variant"]}
        fmt = fmt or "transformers"
    meta = {"family": "wan", "probe": spec["probe"], "upstream": {**upstream, "torch": torch.__version__},
            "upstream_format": fmt, "dtype": dtype, "seed": spec["seed"],
            "tolerance": {"rel_l2": spec.get("tolerance", REL_L2_TOL)},
            **({"config": upstream_config(model)} if fmt == "original" else {}),
            "params": params, "description": spec["description"]}
    (case / "case.json").write_text(json.dumps(meta, indent=2) + "\n")
    for f in case.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)    # save_pretrained may write 0600 files
    size = sum(f.stat().st_size for f in case.rglob("*") if f.is_file())
    stats = {k: f"{list(v.shape)} std {v.std():.3f}" for k, v in outputs.items()}
    print(f"{case} ({size / 1024:.0f} KB): {stats}")
    return case


def verify_case(case: Path) -> bool:
    _setup()
    meta = json.loads((case / "case.json").read_text())
    if meta["upstream_format"] == "original" and meta["probe"] == "wan.umt5":   # back through the inverse renaming
        model = build_model({"probe": "wan.umt5", "variant": meta["params"]["variant"], "seed": meta["seed"]})
        inverse = _renamed({k: k for k in model.state_dict() if k != "encoder.embed_tokens.weight"},
                           UMT5_TO_ORIGINAL)   # original name -> transformers name
        stored = torch.load(case / "upstream" / UMT5_ORIGINAL_FILE, weights_only=True)
        missing, unexpected = model.load_state_dict({inverse[k]: v for k, v in stored.items()}, strict=False)
        assert set(missing) <= {"encoder.embed_tokens.weight"} and not unexpected, (missing, unexpected)
    elif meta["upstream_format"] == "original":   # back through upstream's converter into the variant's model
        from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
        model = build_model({"probe": "wan.dit", "variant": meta["params"]["variant"], "seed": meta["seed"]})
        weights = case / "upstream" / "diffusion_pytorch_model.safetensors"
        sd = convert_wan_transformer_to_diffusers(load_file(str(weights)))
        model.load_state_dict(sd, strict=True)
    elif meta["probe"] == "wan.dit" and meta["dtype"] == "bfloat16":
        model = load_bf16(case / "upstream")
    elif meta["probe"] == "wan.dit":
        from diffusers import WanTransformer3DModel as cls
        model = cls.from_pretrained(case / "upstream").eval()
    else:
        from transformers import UMT5EncoderModel as cls
        model = cls.from_pretrained(case / "upstream").eval()
    for t in list(model.parameters()) + list(model.buffers()):
        t.data = t.data.clone()                       # fresh aligned storage, as when the case was made
    got = run_probe(model, _spec_of(case, meta), load_file(str(case / "inputs.safetensors")))
    want = load_file(str(case / "outputs.safetensors"))
    ok = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    if not ok:
        diffs = {k: float((got[k] - want[k]).norm() / want[k].norm()) for k in want if k in got}
        print(f"{case}: DIFFERS {diffs}")
    else:
        print(f"{case}: bit-exact")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="golden root (cases go to OUT/wan/<name>)")
    ap.add_argument("--only", action="append", choices=sorted(CASES), help="make only this case (repeatable)")
    ap.add_argument("--verify", type=Path, nargs="+", metavar="CASE_DIR")
    a = ap.parse_args(argv)
    if a.verify:
        return 0 if all([verify_case(d) for d in a.verify]) else 1
    if a.out is None:
        ap.error("--out is required (or use --verify)")
    for name in a.only or CASES:
        build_case(name, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
