"""A tiny diffusers-layout LTX2Pipeline root written without diffusers (safetensors + config JSONs with diffusers'
and transformers' key names and config fields), for the ltx2 conversion / serving tests and CI. `--upstream` tests
build the same root with diffusers' own save_pretrained (tests/test_ltx2_serving.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from manifests.ltx2.model import load_model_variant
from manifests.ltx2.sampling import Ltx2SchedulerConfig

WEIGHTS = "diffusion_pytorch_model.safetensors"
CLASSES = {"transformer": "LTX2VideoTransformer3DModel", "connectors": "LTX2TextConnectors",
           "vae": "AutoencoderKLLTX2Video", "audio_vae": "AutoencoderKLLTX2Audio", "vocoder": "LTX2Vocoder"}
WORDS = ["a", "cat", "dog", "runs", "jumps", "on", "the", "grass", "in", "rain", "and", "sings", "loud", "quiet", "red", "blue", "sky"]


def gemma_transformers_config(spec) -> dict:
    """A transformers Gemma3Config (ForConditionalGeneration) as save_pretrained writes it, for a Gemma3TextSpec."""
    text = {"model_type": "gemma3_text", "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
            "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps,
            "query_pre_attn_scalar": spec.query_pre_attn_scalar, "sliding_window": spec.sliding_window,
            "layer_types": list(spec.types()), "attn_logit_softcapping": None,
            "rope_parameters": {"full_attention": {"rope_theta": spec.rope_global_theta, "rope_type": "default"}
                                if spec.rope_global_linear_factor == 1.0 else
                                {"rope_theta": spec.rope_global_theta, "rope_type": "linear",
                                 "factor": spec.rope_global_linear_factor},
                                "sliding_attention": {"rope_theta": spec.rope_local_theta, "rope_type": "default"}}}
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16, "num_hidden_layers": 1},
            "mm_tokens_per_image": 4, "tie_word_embeddings": True}


def write_tokenizer(d: Path) -> None:
    """A word-level tokenizer with Gemma's specials (<pad> 0, <eos> 1, <bos> 2, <unk> 3) that prepends <bos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{w: 4 + i for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>",
        "unk_token": "<unk>", "padding_side": "left", "model_max_length": 16}, indent=1))


def random_state(shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, shape in sorted(shapes.items()):
        t = torch.randn(shape, generator=g)
        if k.endswith(("latents_std", "timestep_scale_multiplier", "norm_q.weight", "norm_k.weight")):
            out[k] = 1.0 + 0.1 * t.abs()
        elif len(shape) <= 1:
            out[k] = 0.05 * t
        else:
            out[k] = t / (torch.tensor(shape[1:]).prod().float().sqrt())
    return out


def write_tiny_pipeline_root(root: Path, seed: int = 0, *, extra_key: tuple[str, str] | None = None,
                             drop_key: tuple[str, str] | None = None) -> Path:
    """The tiny LTX-2 model (manifests/ltx2/model.py "tiny") as a diffusers LTX2Pipeline root. `extra_key`
    (component, key) adds a stray tensor, `drop_key` removes one (the converter must refuse both by name)."""
    from optimized.models.ltx2.instance import (
        component_key_shapes,  # the canonical (= upstream) names and shapes
    )
    cfg = load_model_variant("tiny")
    shapes = component_key_shapes(cfg)
    root.mkdir(parents=True)
    index = {"_class_name": "LTX2Pipeline", "_diffusers_version": "0.42.1",
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
             "tokenizer": ["transformers", "GemmaTokenizerFast"],
             "processor": [None, None], "prompt_enhancer": [None, None], "duration_head": [None, None]}
    for i, (name, c) in enumerate(cfg.components().items()):
        state = random_state(shapes[name], seed + i)
        if name == "text_encoder":
            state = {f"language_model.model.{k}": v for k, v in state.items()}
            g = torch.Generator().manual_seed(seed + 100)
            state["vision_tower.embeddings.patch_embedding.weight"] = torch.randn(16, 3, 14, 14, generator=g)
            state["multi_modal_projector.mm_input_projection_weight"] = torch.randn(16, 16, generator=g)
        if extra_key is not None and extra_key[0] == name:
            state[extra_key[1]] = torch.zeros(3)
        if drop_key is not None and drop_key[0] == name:
            state.pop(drop_key[1])
        d = root / name
        d.mkdir()
        if name == "text_encoder":
            (d / "config.json").write_text(json.dumps(gemma_transformers_config(c), indent=1))
            save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        else:
            (d / "config.json").write_text(json.dumps({"_class_name": CLASSES[name], "_diffusers_version": "0.42.1",
                                                       **c.to_dict()}, indent=1))
            save_file(state, str(d / WEIGHTS))
            index[name] = ["diffusers", CLASSES[name]]
    write_tokenizer(root / "tokenizer")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.42.1",
         **Ltx2SchedulerConfig().to_diffusers()}, indent=1))
    (root / "model_index.json").write_text(json.dumps(index, indent=1))
    return root


__all__ = ["gemma_transformers_config", "write_tiny_pipeline_root", "write_tokenizer"]
