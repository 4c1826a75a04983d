#!/usr/bin/env python
"""Make golden cases for probe ``cosmos3.transformer`` from upstream diffusers code.

One golden case = one generator forward pass of diffusers' ``Cosmos3OmniTransformer`` on a tiny config with
seeded random weights, packed by ``Cosmos3OmniPipeline``'s own segment builders (``_prepare_text_segment``,
``_prepare_vision_segment``, ``_prepare_sound_segment``, ``_prepare_action_segment``, called unbound on a
duck-typed ``self``) and called exactly as ``Cosmos3OmniPipeline.__call__`` calls it for the cond branch.
The case format is documented in golden/README.md.

    python tools/make_goldens.py --out golden/cosmos3                 # all committed cases
    python tools/make_goldens.py --out golden/cosmos3 --only NAME     # one committed case
    python tools/make_goldens.py --config-json FILE --name NAME --out DIR   # one extra case from JSON
    python tools/make_goldens.py --verify golden/cosmos3/*            # re-run upstream from the files, compare

FILE holds {"transformer": {<Cosmos3OmniTransformer kwargs>}, "inputs": {<see INPUT_KEYS>}}.
Needs diffusers (0.42.1 was used for golden/), torch, safetensors; accelerate for --verify (from_pretrained).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FAMILY = "cosmos3"
PROBE = "cosmos3.transformer"
UPSTREAM_CLASS = "Cosmos3OmniTransformer"
TESTED_DIFFUSERS = "0.42.1"
VAE_SCALE_FACTOR_TEMPORAL = 4  # Wan2.2 VAE; the pipeline's vae_scale_factor_temporal
REL_L2_TOL = 1e-5

# Keys of the "inputs" object of a case spec. Shapes are the tensor shapes stored in inputs.safetensors.
INPUT_KEYS = {
    "seed": "int: torch.manual_seed before construction + weight generator seed; inputs use seed + 1",
    "text_len": "int: number of text tokens (random ids < vocab_size)",
    "vision_shape": "[1, C, T, H, W] latent grid (C = latent_channel)",
    "vision_condition_frames": "list[int]: latent frames kept clean (no timestep embedding, prediction 0)",
    "sound_shape": "[S, T_s] or null (S = sound_dim; needs sound_gen)",
    "action_shape": "[T_a, A] or null (A = action_dim; needs action_gen)",
    "action_condition_rows": "list[int]: clean action rows (with action)",
    "action_domain_id": "int in [0, num_embodiment_domains) (with action)",
    "timestep": "int: the int64 scheduler timestep t.item(), e.g. 937",
    "fps_vision": "float: pipeline `fps` (vision and action mRoPE)",
    "fps_sound": "float or null: sound mRoPE fps; null -> float(sound_latent_fps) as the pipeline does",
    "description": "str: one line",
}

_TINY = dict(  # = manifests/cosmos3/variants/tiny.json, in diffusers' names
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, vocab_size=128, latent_channel=4, latent_patch_size=2, patch_latent_dim=16,
    rope_axes_dim=[4, 2, 2],
)

CASES: dict[str, dict[str, Any]] = {
    "silu_sound_action_i2v": {
        "transformer": dict(_TINY, sound_gen=True, sound_dim=8, action_gen=True, action_dim=6,
                            num_embodiment_domains=4),
        "inputs": dict(
            seed=1001, text_len=11, vision_shape=[1, 4, 3, 5, 6], vision_condition_frames=[0],
            sound_shape=[8, 7], action_shape=[4, 6], action_condition_rows=[0, 1], action_domain_id=2,
            timestep=937, fps_vision=24.0, fps_sound=None,
            description="tiny variant (silu/Qwen), i2v frame 0 clean, odd latent H, sound, action rows 0-1 clean",
        ),
    },
    "relu2_edge_action": {
        "transformer": dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=48, vocab_size=96, latent_channel=4, latent_patch_size=2, patch_latent_dim=16,
            rope_axes_dim=[4, 2, 2], rope_theta=1e8, hidden_act="relu2", rms_norm_eps=1e-5,
            qk_norm_for_text=False, use_und_k_norm_for_gen=True, action_gen=True, action_dim=5,
            num_embodiment_domains=3,
        ),
        "inputs": dict(
            seed=2002, text_len=9, vision_shape=[1, 4, 2, 4, 5], vision_condition_frames=[],
            sound_shape=None, action_shape=[3, 5], action_condition_rows=[], action_domain_id=1,
            timestep=625, fps_vision=30.0, fps_sound=None,
            description="Edge-style backbone (relu2, Nemotron norms, no text qk-norm, und k-norm for gen, "
                        "theta 1e8), action only, no clean frames, odd latent W, fps 30, H*d > hidden",
        ),
    },
    "silu_t2v_fps16": {
        "transformer": dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
            intermediate_size=40, vocab_size=64, latent_channel=2, latent_patch_size=4, patch_latent_dim=32,
            rope_axes_dim=[2, 2, 2], attention_bias=True,
        ),
        "inputs": dict(
            seed=3003, text_len=7, vision_shape=[1, 2, 4, 6, 8], vision_condition_frames=[0, 1],
            sound_shape=None, action_shape=None, action_condition_rows=[], action_domain_id=None,
            timestep=999, fps_vision=16.0, fps_sound=None,
            description="silu with attention biases, head_dim 12 (rope [2,2,2]), patch 4 with padded H, "
                        "video of 4 latent frames with frames 0-1 clean (v2v), fps 16",
        ),
    },
    "silu_image_nofps": {
        "transformer": dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
            intermediate_size=48, vocab_size=80, latent_channel=3, latent_patch_size=2, patch_latent_dim=12,
            rope_axes_dim=[2, 1, 1], rope_theta=10000.0, enable_fps_modulation=False,
            unified_3d_mrope_reset_spatial_ids=False, unified_3d_mrope_temporal_modality_margin=1000,
            sound_gen=True, sound_dim=6,
        ),
        "inputs": dict(
            seed=4004, text_len=8, vision_shape=[1, 3, 1, 5, 7], vision_condition_frames=[],
            sound_shape=[6, 5], action_shape=None, action_condition_rows=[], action_domain_id=None,
            timestep=500, fps_vision=24.0, fps_sound=None,
            description="image (T=1, odd H and W), no fps modulation (int64 positions), spatial ids not reset, "
                        "margin 1000, no GQA (kv=heads), head_dim 8, with sound",
        ),
    },
    "silu_notextnorm_forward_dynamics": {
        "transformer": dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            intermediate_size=32, vocab_size=64, latent_channel=4, latent_patch_size=2, patch_latent_dim=16,
            rope_axes_dim=[4, 2, 2], qk_norm_for_text=False, base_fps=30,
            sound_gen=True, sound_dim=4, sound_latent_fps=12.5, action_gen=True, action_dim=3,
            num_embodiment_domains=2,
        ),
        "inputs": dict(
            seed=5005, text_len=6, vision_shape=[1, 4, 2, 3, 4], vision_condition_frames=[0],
            sound_shape=[4, 3], action_shape=[4, 3], action_condition_rows=[0, 1, 2, 3], action_domain_id=0,
            timestep=128, fps_vision=10.0, fps_sound=None,
            description="silu without text qk-norm (no und k-norm for gen), forward-dynamics layout: frame 0 "
                        "and ALL action rows clean (action timestep branch skipped), sound at 12.5 fps, "
                        "base_fps 30, H*d == hidden",
        ),
    },
    "relu2_inverse_dynamics": {
        "transformer": dict(
            hidden_size=24, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
            intermediate_size=40, vocab_size=50, latent_channel=4, latent_patch_size=2, patch_latent_dim=16,
            rope_axes_dim=[6, 1, 1], hidden_act="relu2",
            rms_norm_eps=1e-5, rope_theta=1e6, action_gen=True, action_dim=4, num_embodiment_domains=5,
        ),
        "inputs": dict(
            seed=6006, text_len=5, vision_shape=[1, 4, 2, 2, 3], vision_condition_frames=[0, 1],
            sound_shape=None, action_shape=[5, 4], action_condition_rows=[], action_domain_id=4,
            timestep=1, fps_vision=24.0, fps_sound=None,
            description="relu2 with text qk-norm, inverse-dynamics layout: ALL vision frames clean (empty "
                        "vision mse indexes, pred_vision all 0), 5 noisy action rows, 3 heads/1 kv, timestep 1",
        ),
    },
}


# --------------------------------------------------------------------------------------------------------------
# upstream import


def _import_upstream():
    try:
        import diffusers
        from diffusers import Cosmos3OmniTransformer
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline
    except ImportError as e:  # diffusers missing or too old
        sys.exit(
            f"make_goldens: cannot import diffusers' Cosmos3OmniTransformer / Cosmos3OmniPipeline ({e}).\n"
            f"Install the upstream oracle first: pip install 'diffusers=={TESTED_DIFFUSERS}' accelerate"
        )
    if diffusers.__version__ != TESTED_DIFFUSERS:
        print(f"make_goldens: warning: diffusers {diffusers.__version__} (goldens were made with "
              f"{TESTED_DIFFUSERS})", file=sys.stderr)
    return diffusers, Cosmos3OmniTransformer, Cosmos3OmniPipeline


def _setup_determinism() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)


# --------------------------------------------------------------------------------------------------------------
# weights


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded random values so that every weight reaches the outputs.

    Drawn in ``named_parameters()`` order from ``torch.Generator().manual_seed(seed)``, r ~ N(0, 1) of the
    parameter's shape:
      RMSNorm weights (RMSNorm, Cosmos3NemotronRMSNorm)     1 + 0.1 r
      biases (*.bias, DomainAwareLinear *.bias.weight)      0.1 r
      audio/action_modality_embed                           0.5 r
      embed_tokens.weight                                   r
      DomainAwareLinear *.fc.weight [N_dom, in*out]         r / sqrt(in)
      every other weight (nn.Linear [out, in], lm_head too) r / sqrt(in)
    """
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        owner = modules[name.rsplit(".", 1)[0]] if "." in name else model
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("modality_embed"):
            v = 0.5 * r
        elif type(owner).__name__.endswith("RMSNorm"):  # diffusers RMSNorm, Cosmos3NemotronRMSNorm
            v = 1.0 + 0.1 * r
        elif leaf == "bias" or name.endswith(".bias.weight"):
            v = 0.1 * r
        elif name == "embed_tokens.weight":
            v = r
        elif name.endswith(".fc.weight"):
            dal = modules[name.rsplit(".", 2)[0]]
            v = r / math.sqrt(dal.input_size)
        elif isinstance(owner, torch.nn.Linear):
            v = r / math.sqrt(p.shape[1])
        else:
            raise RuntimeError(f"make_goldens: no init rule for parameter {name} {tuple(p.shape)}")
        p.copy_(v.to(p.dtype))


# --------------------------------------------------------------------------------------------------------------
# inputs


def _check_spec(cfg: dict[str, Any], inp: dict[str, Any]) -> None:
    unknown = sorted(set(inp) - set(INPUT_KEYS))
    if unknown:
        raise ValueError(f"unknown inputs keys {unknown}; known: {sorted(INPUT_KEYS)}")
    for k in ("seed", "text_len", "vision_shape", "timestep", "fps_vision"):
        if inp.get(k) is None:
            raise ValueError(f"inputs.{k} is required")
    vs = list(inp["vision_shape"])
    if len(vs) != 5 or vs[0] != 1:
        raise ValueError(f"inputs.vision_shape must be [1, C, T, H, W], got {vs}")
    if vs[1] != cfg.get("latent_channel", 48):
        raise ValueError(f"vision C={vs[1]} != latent_channel={cfg.get('latent_channel', 48)}")
    cond = list(inp.get("vision_condition_frames") or [])
    if cond != sorted(set(cond)) or any(not 0 <= i < vs[2] for i in cond):
        raise ValueError(f"vision_condition_frames must be sorted unique frames in [0, {vs[2]}), got {cond}")
    if not isinstance(inp["timestep"], int):
        raise ValueError("inputs.timestep must be an int (the pipeline passes t.item() of an int64 schedule)")
    if inp.get("sound_shape") is not None:
        if not cfg.get("sound_gen"):
            raise ValueError("sound_shape given but transformer.sound_gen is false")
        if len(inp["sound_shape"]) != 2 or inp["sound_shape"][0] != cfg.get("sound_dim"):
            raise ValueError(f"sound_shape must be [sound_dim={cfg.get('sound_dim')}, T_s]")
    if inp.get("action_shape") is not None:
        if not cfg.get("action_gen"):
            raise ValueError("action_shape given but transformer.action_gen is false")
        if len(inp["action_shape"]) != 2 or inp["action_shape"][1] != cfg.get("action_dim"):
            raise ValueError(f"action_shape must be [T_a, action_dim={cfg.get('action_dim')}]")
        rows = list(inp.get("action_condition_rows") or [])
        if rows != sorted(set(rows)) or any(not 0 <= i < inp["action_shape"][0] for i in rows):
            raise ValueError(f"action_condition_rows must be sorted unique rows in [0, T_a), got {rows}")
        dom = inp.get("action_domain_id")
        if not isinstance(dom, int) or not 0 <= dom < cfg.get("num_embodiment_domains", 32):
            raise ValueError(f"action_domain_id must be an int in [0, num_embodiment_domains), got {dom}")


def make_inputs(cfg: dict[str, Any], inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Draw the case inputs from torch.Generator().manual_seed(seed + 1) in a fixed order."""
    g = torch.Generator().manual_seed(int(inp["seed"]) + 1)
    t: dict[str, torch.Tensor] = {}
    t["input_ids"] = torch.randint(0, cfg.get("vocab_size", 151936), (int(inp["text_len"]),), generator=g,
                                   dtype=torch.int64)
    t["vision_latents"] = torch.randn(tuple(inp["vision_shape"]), generator=g, dtype=torch.float32)
    t["vision_condition_frames"] = torch.tensor(list(inp.get("vision_condition_frames") or []), dtype=torch.int64)
    if inp.get("sound_shape") is not None:
        t["sound_latents"] = torch.randn(tuple(inp["sound_shape"]), generator=g, dtype=torch.float32)
    if inp.get("action_shape") is not None:
        t["action_latents"] = torch.randn(tuple(inp["action_shape"]), generator=g, dtype=torch.float32)
        t["action_condition_rows"] = torch.tensor(list(inp.get("action_condition_rows") or []), dtype=torch.int64)
        t["action_domain_id"] = torch.tensor(int(inp["action_domain_id"]), dtype=torch.int64)
    return t


# --------------------------------------------------------------------------------------------------------------
# the probe: packing by the pipeline's segment builders + one transformer call (cond branch of __call__)


@torch.no_grad()
def run_probe(model, pipeline_cls, inputs: dict[str, torch.Tensor], timestep: int, fps_vision: float,
              fps_sound: float | None) -> dict[str, torch.Tensor]:
    device = torch.device("cpu")
    ns = SimpleNamespace(transformer=model, vae_scale_factor_temporal=VAE_SCALE_FACTOR_TEMPORAL)
    latents = inputs["vision_latents"]
    sound_latents = inputs.get("sound_latents")
    action_latents = inputs.get("action_latents")
    vision_cond = [int(i) for i in inputs["vision_condition_frames"].tolist()]

    text = pipeline_cls._prepare_text_segment(ns, inputs["input_ids"].tolist(), device=device)
    vision = pipeline_cls._prepare_vision_segment(
        ns, input_vision_tokens=latents, has_image_condition=bool(vision_cond),
        mrope_offset=text["vision_start_temporal_offset"], vision_fps=fps_vision, curr=text["und_len"],
        device=device, condition_frame_indexes=vision_cond,
    )
    sound: dict[str, Any] = {}
    if sound_latents is not None:
        sound = pipeline_cls._prepare_sound_segment(
            ns, input_sound_tokens=sound_latents, mrope_offset=text["vision_start_temporal_offset"],
            sound_fps=fps_sound, curr=text["und_len"] + vision["num_vision_tokens"], device=device,
        )
    action: dict[str, Any] = {}
    action_domain_id = None
    if action_latents is not None:
        action = pipeline_cls._prepare_action_segment(
            ns, input_action_tokens=action_latents,
            condition_frame_indexes=[int(i) for i in inputs["action_condition_rows"].tolist()],
            mrope_offset=text["vision_start_temporal_offset"], action_fps=fps_vision,  # fps_vision, as upstream
            curr=text["und_len"] + vision["num_vision_tokens"] + sound.get("sound_len", 0), device=device,
        )
        action_domain_id = inputs["action_domain_id"].reshape(1)  # pipeline: torch.tensor([id], dtype=long)
    segs = [text["text_mrope_ids"], vision["vision_mrope_ids"]]
    if sound:
        segs.append(sound["sound_mrope_ids"])
    if action:
        segs.append(action["action_mrope_ids"])
    packed = {**text, **vision, **sound, **action, "position_ids": torch.cat(segs, dim=1),
              "sequence_length": text["und_len"] + vision["num_vision_tokens"] + sound.get("sound_len", 0)
              + action.get("action_len", 0)}

    vision_timesteps = torch.full((vision["num_noisy_vision_tokens"],), timestep, device=device)
    sound_timesteps = torch.full((sound["sound_len"],), timestep, device=device) if sound else None
    action_timesteps = torch.full((action["num_noisy_action_tokens"],), timestep, device=device) if action else None

    preds_vision, preds_sound, preds_action = model(
        input_ids=packed["input_ids"],
        text_indexes=packed["text_indexes"],
        position_ids=packed["position_ids"],
        und_len=packed["und_len"],
        sequence_length=packed["sequence_length"],
        vision_tokens=[latents.to(dtype=model.dtype)],
        vision_token_shapes=packed["vision_token_shapes"],
        vision_sequence_indexes=packed["vision_sequence_indexes"],
        vision_mse_loss_indexes=packed["vision_mse_loss_indexes"],
        vision_timesteps=vision_timesteps,
        vision_noisy_frame_indexes=packed["vision_noisy_frame_indexes"],
        sound_tokens=[sound_latents.to(dtype=model.dtype)] if sound_latents is not None else None,
        sound_token_shapes=packed.get("sound_token_shapes"),
        sound_sequence_indexes=packed.get("sound_sequence_indexes"),
        sound_mse_loss_indexes=packed.get("sound_mse_loss_indexes"),
        sound_timesteps=sound_timesteps,
        sound_noisy_frame_indexes=packed.get("sound_noisy_frame_indexes"),
        action_tokens=[action_latents.to(dtype=model.dtype)] if action_latents is not None else None,
        action_token_shapes=packed.get("action_token_shapes"),
        action_sequence_indexes=packed.get("action_sequence_indexes"),
        action_mse_loss_indexes=packed.get("action_mse_loss_indexes"),
        action_timesteps=action_timesteps,
        action_noisy_frame_indexes=packed.get("action_noisy_frame_indexes"),
        action_domain_ids=[action_domain_id] if action_domain_id is not None else None,
        return_dict=False,
    )

    out = {
        "position_ids": packed["position_ids"],
        "vision_sequence_indexes": packed["vision_sequence_indexes"],
        "vision_mse_loss_indexes": packed["vision_mse_loss_indexes"],
        "pred_vision": preds_vision[0],
    }
    if sound:
        out["sound_sequence_indexes"] = packed["sound_sequence_indexes"]
        out["sound_mse_loss_indexes"] = packed["sound_mse_loss_indexes"]
        out["pred_sound"] = preds_sound[0]
    if action:
        out["action_sequence_indexes"] = packed["action_sequence_indexes"]
        out["action_mse_loss_indexes"] = packed["action_mse_loss_indexes"]
        out["pred_action"] = preds_action[0]
    for k in list(out):
        assert not k.endswith("_indexes") or out[k].dtype == torch.int64, (k, out[k].dtype)  # upstream: long
        out[k] = out[k].detach().contiguous().clone()
    return out


def _sanity(out: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    pv = out["pred_vision"]
    assert pv.shape == inputs["vision_latents"].shape, (pv.shape, inputs["vision_latents"].shape)
    for f in inputs["vision_condition_frames"].tolist():
        assert torch.count_nonzero(pv[:, :, f]) == 0, f"conditioned frame {f} of pred_vision is not exactly 0"
    if "pred_action" in out:
        for r in inputs["action_condition_rows"].tolist():
            assert torch.count_nonzero(out["pred_action"][r]) == 0, f"conditioned action row {r} is not 0"
    for k, v in out.items():
        if v.is_floating_point():
            assert torch.isfinite(v).all(), f"{k} has non-finite values"


# --------------------------------------------------------------------------------------------------------------
# case building / verification


def build_case(name: str, spec: dict[str, Any], out_root: Path) -> Path:
    diffusers, Transformer, Pipeline = _import_upstream()
    _setup_determinism()
    cfg = dict(spec["transformer"])
    inp = dict(spec["inputs"])
    _check_spec(cfg, inp)
    seed = int(inp["seed"])
    fps_vision = float(inp["fps_vision"])
    fps_sound = None
    if inp.get("sound_shape") is not None:
        fps_sound = float(inp["fps_sound"]) if inp.get("fps_sound") is not None else None

    torch.manual_seed(seed)
    model = Transformer(**cfg)
    randomize_weights(model, seed)
    model.eval()
    if fps_sound is None and inp.get("sound_shape") is not None:
        fps_sound = float(model.config.sound_latent_fps)  # what Cosmos3OmniPipeline.prepare_latents passes
    if fps_sound is not None and fps_sound != float(model.config.sound_latent_fps):
        print(f"make_goldens: note: {name}: fps_sound {fps_sound} != sound_latent_fps "
              f"{model.config.sound_latent_fps} (the pipeline always uses sound_latent_fps)", file=sys.stderr)

    inputs = make_inputs(cfg, inp)
    out = run_probe(model, Pipeline, inputs, int(inp["timestep"]), fps_vision, fps_sound)
    _sanity(out, inputs)

    case_dir = out_root / name
    tmp = out_root / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "upstream", safe_serialization=True)
    save_file(inputs, str(tmp / "inputs.safetensors"), metadata={"format": "pt"})
    save_file(out, str(tmp / "outputs.safetensors"), metadata={"format": "pt"})
    case = {
        "family": FAMILY,
        "probe": PROBE,
        "upstream": {"package": "diffusers", "version": diffusers.__version__, "class": UPSTREAM_CLASS,
                     "torch": torch.__version__},
        "upstream_format": "diffusers",
        "dtype": "float32",
        "seed": seed,
        "tolerance": {"rel_l2": REL_L2_TOL},
        "params": {"timestep": int(inp["timestep"]), "fps_vision": fps_vision, "fps_sound": fps_sound},
        "description": str(inp.get("description") or name),
    }
    (tmp / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    for f in tmp.rglob("*"):  # safetensors writes 0600; make the case world-readable like the rest of the repo
        f.chmod(0o755 if f.is_dir() else 0o644)
    if case_dir.exists():
        shutil.rmtree(case_dir)
    tmp.rename(case_dir)

    size = sum(f.stat().st_size for f in case_dir.rglob("*") if f.is_file())
    L = out["position_ids"].shape[1]
    print(f"{name}: L={L} position_ids {out['position_ids'].dtype}, "
          + ", ".join(f"{k}{list(v.shape)}" for k, v in out.items() if k.startswith("pred_"))
          + f", {size / 1024:.0f} KiB -> {case_dir}")
    return case_dir


def verify_case(case_dir: Path) -> bool:
    """Re-run upstream from the case files alone (from_pretrained + inputs.safetensors) and compare exactly."""
    _, Transformer, Pipeline = _import_upstream()
    _setup_determinism()
    case = json.loads((case_dir / "case.json").read_text())
    model = Transformer.from_pretrained(str(case_dir / "upstream"), torch_dtype=torch.float32).eval()
    inputs = load_file(str(case_dir / "inputs.safetensors"))
    ref = load_file(str(case_dir / "outputs.safetensors"))
    p = case["params"]
    out = run_probe(model, Pipeline, inputs, int(p["timestep"]), float(p["fps_vision"]),
                    None if p["fps_sound"] is None else float(p["fps_sound"]))
    _sanity(out, inputs)
    ok = set(out) == set(ref)
    msgs = [] if ok else [f"names differ: {sorted(set(out) ^ set(ref))}"]
    for k in sorted(set(out) & set(ref)):
        if out[k].dtype != ref[k].dtype or out[k].shape != ref[k].shape or not torch.equal(out[k], ref[k]):
            ok = False
            msgs.append(f"{k}: mismatch")
    print(f"{'OK  ' if ok else 'FAIL'} {case_dir}" + ("" if ok else ": " + "; ".join(msgs)))
    return ok


# --------------------------------------------------------------------------------------------------------------
# probe `cosmos3.convert_dtypes`: which tensors upstream keeps in float32 when loading in bfloat16


DTYPE_CASE = "conv_bf16_keep_fp32"
DTYPE_CASE_SEED = 7101
DTYPE_CASE_CONFIG = dict(  # every module kind: und / gen streams, sound and action heads, time embedder
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    intermediate_size=24, vocab_size=32, latent_channel=4, latent_patch_size=2, patch_latent_dim=16,
    rope_axes_dim=[4, 2, 2], sound_gen=True, sound_dim=4, action_gen=True, action_dim=3, num_embodiment_domains=2,
)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def build_dtype_case(out_root: Path) -> Path:
    """upstream/ = a tiny fp32 save_pretrained; outputs = the dtype of every upstream key after
    `Cosmos3OmniTransformer.from_pretrained(upstream, torch_dtype=torch.bfloat16)` (0 float32, 1 bfloat16), in
    the order of params.upstream_keys: what upstream's `_keep_in_fp32_modules` keeps in float32."""
    diffusers, Transformer, _ = _import_upstream()
    _setup_determinism()
    torch.manual_seed(DTYPE_CASE_SEED)
    model = Transformer(**DTYPE_CASE_CONFIG)
    randomize_weights(model, DTYPE_CASE_SEED)  # distinct values: the probe matches converted tensors by value
    case_dir = out_root / DTYPE_CASE
    if case_dir.exists():
        shutil.rmtree(case_dir)
    model.save_pretrained(case_dir / "upstream", safe_serialization=True)
    loaded = Transformer.from_pretrained(str(case_dir / "upstream"), torch_dtype=torch.bfloat16)
    state = loaded.state_dict()
    keys = sorted(load_file(str(case_dir / "upstream" / "diffusion_pytorch_model.safetensors")))
    codes = torch.tensor([DTYPE_CODES[state[k].dtype] for k in keys], dtype=torch.int64)
    assert 0 < int((codes == 0).sum()) < len(keys), "the case must hold both float32 and bfloat16 tensors"
    save_file({}, str(case_dir / "inputs.safetensors"), metadata={"format": "pt"})
    save_file({"upstream_dtype_codes": codes}, str(case_dir / "outputs.safetensors"), metadata={"format": "pt"})
    meta = {"family": "cosmos3", "probe": "cosmos3.convert_dtypes",
            "upstream": {"package": "diffusers", "version": diffusers.__version__, "class": "Cosmos3OmniTransformer",
                         "torch": torch.__version__},
            "upstream_format": "diffusers", "dtype": "bfloat16", "seed": DTYPE_CASE_SEED,
            "tolerance": {"rel_l2": 0.0},
            "params": {"upstream_keys": keys, "keep_in_fp32_modules": list(Transformer._keep_in_fp32_modules or [])},
            "description": "converting to bfloat16 keeps in float32 exactly the tensors diffusers' "
                           "from_pretrained(torch_dtype=torch.bfloat16) keeps in float32 (_keep_in_fp32_modules)"}
    (case_dir / "case.json").write_text(json.dumps(meta, indent=1) + "\n")
    fp32 = [k for k, c in zip(keys, codes.tolist()) if c == 0]
    print(f"{DTYPE_CASE}: {len(keys)} keys, float32 kept: {fp32} -> {case_dir}")
    return case_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="output root, e.g. golden/cosmos3")
    ap.add_argument("--only", help=f"build one committed case: {', '.join(CASES)}")
    ap.add_argument("--config-json", type=Path, help="build one extra case from this JSON spec")
    ap.add_argument("--name", help="case name for --config-json")
    ap.add_argument("--verify", type=Path, nargs="+", metavar="CASE_DIR",
                    help="re-run upstream from these case dirs and require bit-exact outputs")
    ap.add_argument("--list", action="store_true", help="list committed cases")
    ap.add_argument("--dtype-case", action="store_true",
                    help=f"build only {DTYPE_CASE} (probe cosmos3.convert_dtypes) under --out")
    a = ap.parse_args(argv)

    if a.list:
        for n, s in CASES.items():
            print(f"{n}: {s['inputs']['description']}")
        return 0
    if a.verify:
        return 0 if all([verify_case(d) for d in a.verify]) else 1
    if a.out is None:
        ap.error("--out is required (or use --verify / --list)")
    if a.dtype_case:
        build_dtype_case(a.out)
        return 0
    if a.config_json is not None:
        if not a.name:
            ap.error("--config-json needs --name")
        spec = json.loads(a.config_json.read_text())
        if not isinstance(spec, dict) or set(spec) != {"transformer", "inputs"}:
            ap.error('--config-json file must hold {"transformer": {...}, "inputs": {...}}')
        try:
            build_case(a.name, spec, a.out)
        except (ValueError, TypeError) as e:
            ap.error(f"{a.config_json}: {e}")
        return 0
    if a.only is not None:
        if a.only not in CASES:
            ap.error(f"unknown case {a.only!r}; known: {', '.join(CASES)}")
        build_case(a.only, CASES[a.only], a.out)
        return 0
    for n, s in CASES.items():
        build_case(n, s, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
