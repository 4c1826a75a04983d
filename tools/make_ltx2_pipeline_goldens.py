"""Golden cases for the LTX-2 pipeline loop: diffusers 0.42.1 `LTX2Pipeline` on tiny components with seeded random
weights, called with precomputed text-encoder hidden states (`prompt_embeds`: Gemma 3's path is not part of these
cases) and `output_type="latent"`. Each case stores the upstream transformer and connectors (save_pretrained), the
scheduler config, the latent statistics of the (tiny) VAEs, the inputs, the latents entering every step (hooked at
the transformer: the first, unconditional copy of the CFG batch) and the final latents.

    python tools/make_ltx2_pipeline_goldens.py [OUT_ROOT]      # default: golden/ltx2_pipe
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from manifests.ltx2 import load_variant
from manifests.ltx2.connectors import load_connectors_variant
from manifests.ltx2.sampling import Ltx2SchedulerConfig

# (case, transformer variant, connectors variant, call arguments). tiny_t2v: audio_guidance_scale=0 falls back to the
# video scale (upstream's `or`); tiny23_t2v: CFG on through the audio scale alone (video scale 1)
_T2V = {"height": 64, "width": 96, "num_frames": 9, "frame_rate": 24.0, "num_inference_steps": 3,
        "guidance_scale": 3.0, "audio_guidance_scale": 0.0, "guidance_rescale": 0.7, "audio_guidance_rescale": 0.7,
        "seed": 7}
_NOCFG = {"height": 32, "width": 64, "num_frames": 17, "frame_rate": 25.0, "num_inference_steps": 2,
          "guidance_scale": 1.0, "audio_guidance_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0,
          "seed": 3}
_T2V23 = {"height": 64, "width": 64, "num_frames": 9, "frame_rate": 24.0, "num_inference_steps": 2,
          "guidance_scale": 1.0, "audio_guidance_scale": 4.0, "guidance_rescale": 0.0, "audio_guidance_rescale": None,
          "seed": 11}
CASES = (("tiny_t2v", "tiny", "tiny", _T2V), ("tiny_t2v_nocfg", "tiny", "tiny", _NOCFG),
         ("tiny23_t2v", "tiny-2.3", "tiny-2.3", _T2V23))
TEXT_LEN, TEXT_LAYERS = 8, 3     # connectors' text_proj_in_factor = Gemma layers + 1


def tiny_vaes(latent_channels: int, audio_latent_channels: int, mel_bins: int):
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    video = AutoencoderKLLTX2Video(latent_channels=latent_channels, block_out_channels=(8, 8, 8, 8),
                                   decoder_block_out_channels=(8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                   decoder_layers_per_block=(1, 1, 1, 1), spatial_compression_ratio=32,
                                   temporal_compression_ratio=8)   # LTX-2's ratios (the tiny blocks would give 64 / 16)
    audio = AutoencoderKLLTX2Audio(base_channels=8, ch_mult=(1, 2, 4), num_res_blocks=1,
                                   latent_channels=audio_latent_channels, mel_bins=mel_bins)
    return video, audio


def make_case(out: Path, name: str, tvar: str, cvar: str, call: dict) -> None:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    torch.manual_seed(0)
    tcfg, ccfg = load_variant(tvar), load_connectors_variant(cvar)
    transformer = LTX2VideoTransformer3DModel(**tcfg.to_dict()).eval()
    connectors = LTX2TextConnectors(**ccfg.to_dict()).eval()
    g = torch.Generator().manual_seed(0)
    for m in (transformer, connectors):   # seeded random weights, norm gains near 1 (not exactly: a swap must show)
        m.load_state_dict({k: (1 + 0.1 * torch.randn(v.shape, generator=g)) if "norm" in k
                           else 0.3 * torch.randn(v.shape, generator=g) for k, v in m.state_dict().items()})
    mel_bins = 16                                                     # 4 latent bins x 2 channels = 8 audio inputs
    audio_channels = tcfg.audio_in_channels // (mel_bins // 4)
    vae, audio_vae = tiny_vaes(tcfg.in_channels, audio_channels, mel_bins)
    stats = {"video_mean": 0.2 * torch.randn(tcfg.in_channels, generator=g),
             "video_std": 1 + 0.3 * torch.rand(tcfg.in_channels, generator=g),
             "audio_mean": 0.2 * torch.randn(tcfg.audio_in_channels, generator=g),
             "audio_std": 1 + 0.3 * torch.rand(tcfg.audio_in_channels, generator=g)}
    vae.latents_mean.copy_(stats["video_mean"])
    vae.latents_std.copy_(stats["video_std"])
    audio_vae.latents_mean.copy_(stats["audio_mean"])
    audio_vae.latents_std.copy_(stats["audio_std"])
    sched_cfg = Ltx2SchedulerConfig().to_diffusers()
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**sched_cfg), vae=vae, audio_vae=audio_vae,
                        text_encoder=None, tokenizer=None, connectors=connectors, transformer=transformer,
                        vocoder=None)
    width = ccfg.caption_channels * TEXT_LAYERS
    inputs = {"prompt_embeds": torch.randn(2, TEXT_LEN, width, generator=g),
              "negative_prompt_embeds": torch.randn(2, TEXT_LEN, width, generator=g),
              "prompt_attention_mask": torch.ones(2, TEXT_LEN, dtype=torch.int64),
              "negative_prompt_attention_mask": torch.ones(2, TEXT_LEN, dtype=torch.int64)}
    inputs["prompt_attention_mask"][1, :3] = 0                       # Gemma pads on the left
    inputs["negative_prompt_attention_mask"][:, :5] = 0
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(_mod, _args, kwargs):
        steps.append((kwargs["hidden_states"][:2].clone(), kwargs["audio_hidden_states"][:2].clone()))
    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    seed = call.pop("seed")
    with torch.no_grad():
        video, audio = pipe(**inputs, **call, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                            audio_modality_scale=1.0, output_type="latent",
                            generator=torch.Generator().manual_seed(seed), return_dict=False)
    handle.remove()
    if len(steps) != call["num_inference_steps"]:
        raise SystemExit(f"{name}: {len(steps)} transformer calls for {call['num_inference_steps']} steps")
    call["seed"] = seed
    outputs = {"video_latents": video.contiguous(), "audio_latents": audio.contiguous()}
    for i, (v, a) in enumerate(steps[1:]):
        outputs[f"step.{i}.video"], outputs[f"step.{i}.audio"] = v.contiguous(), a.contiguous()
    case = out / name
    (case / "upstream").mkdir(parents=True, exist_ok=True)
    transformer.save_pretrained(case / "upstream" / "transformer", safe_serialization=True)
    connectors.save_pretrained(case / "upstream" / "connectors", safe_serialization=True)
    (case / "upstream" / "scheduler_config.json").write_text(json.dumps(sched_cfg, indent=2, sort_keys=True) + "\n")
    save_file({**inputs, **stats}, str(case / "inputs.safetensors"))
    save_file(outputs, str(case / "outputs.safetensors"))
    import diffusers
    meta = {"family": "ltx2", "probe": "ltx2.pipeline", "dtype": "float32", "seed": 0,
            "upstream": {"package": "diffusers", "version": diffusers.__version__, "class_name": "LTX2Pipeline",
                         "torch": torch.__version__},
            "upstream_format": "diffusers", "tolerance": {"rel_l2": 1e-4},
            "config": {"transformer": transformer.config_dict if hasattr(transformer, "config_dict")
                       else dict(transformer.config), "connectors": dict(connectors.config)},
            "params": {**call, "mel_bins": mel_bins, "audio_latent_channels": audio_channels,
                       "latent_channels": tcfg.in_channels, "variants": [tvar, cvar]},
            "description": f"LTX2Pipeline text-to-video+audio latents, {tvar} transformer, {cvar} connectors, "
                           f"{call['num_inference_steps']} steps, guidance {call['guidance_scale']}"}
    meta["config"] = json.loads(json.dumps(meta["config"], default=list))
    (case / "case.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"wrote {case}: {len(steps)} steps")


def main(out: Path) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for name, tvar, cvar, call in CASES:
        make_case(out, name, tvar, cvar, dict(call))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "golden" / "ltx2_pipe"))
