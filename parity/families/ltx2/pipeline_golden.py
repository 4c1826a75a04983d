"""ltx2 golden probe `ltx2.pipeline`: a case of golden/ltx2_pipe (tools/make_ltx2_pipeline_goldens.py: diffusers'
LTX2Pipeline on tiny components, precomputed text hidden states, output_type="latent") run on each side; the final
video / audio latents and the latents after every step but the last (`step.<i>.video` / `.audio`) are compared;
a failing final row names the first step that left the tolerance."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

import optimized.models.ltx2 as opt
import reference.ltx2 as ref
from manifests.ltx2 import Ltx2Config
from manifests.ltx2.connectors import Ltx2ConnectorsConfig
from manifests.ltx2.sampling import Ltx2Media, Ltx2Request, Ltx2SchedulerConfig
from optimized.models.ltx2.connectors import load_connectors as fast_connectors
from optimized.models.ltx2.pipeline import Ltx2Prompt
from optimized.models.ltx2.pipeline import generate_latents as fast_generate
from parity.family import golden_probe
from parity.localise import first_divergence
from parity.report import exceptions_fail, tensor_check
from reference.ltx2.connectors import load_connectors as ref_connectors
from reference.ltx2.pipeline import generate_latents as ref_generate

REQUEST_FIELDS = ("height", "width", "num_frames", "frame_rate", "num_inference_steps", "guidance_scale",
                  "audio_guidance_scale", "guidance_rescale", "audio_guidance_rescale", "seed")
TEXT = ("prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds", "negative_prompt_attention_mask")
FINAL = ("video_latents", "audio_latents")


def run_side(side: str, case_dir, params: dict, inputs: dict, trace=None) -> tuple[torch.Tensor, torch.Tensor]:
    up = case_dir / "upstream"
    tcfg = Ltx2Config.from_diffusers_config(json.loads((up / "transformer" / "config.json").read_text()))
    ccfg = Ltx2ConnectorsConfig.from_diffusers_config(json.loads((up / "connectors" / "config.json").read_text()))
    sched = Ltx2SchedulerConfig.from_diffusers(json.loads((up / "scheduler_config.json").read_text()))
    tw = load_file(str(up / "transformer" / "diffusion_pytorch_model.safetensors"))
    cw = load_file(str(up / "connectors" / "diffusion_pytorch_model.safetensors"))
    req = Ltx2Request(**{k: params[k] for k in REQUEST_FIELDS})
    media = Ltx2Media(latent_channels=params["latent_channels"], audio_latent_channels=params["audio_latent_channels"],
                      mel_bins=params["mel_bins"])
    stats = {k: inputs[k] for k in ("video_mean", "video_std", "audio_mean", "audio_std")}
    text = [inputs[k] for k in TEXT]
    with torch.no_grad():
        if side == "reference":
            return ref_generate(ref.load_model(tcfg, tw), ref_connectors(ccfg, cw), req, *text, stats, media, sched,
                                trace=trace)
        return fast_generate(opt.load_model(tcfg, tw), fast_connectors(ccfg, cw), [req], [Ltx2Prompt(*text)], stats,
                             media, sched, trace=trace)


@golden_probe(required=FINAL, optional=("step.*.video", "step.*.audio"))
def pipeline_probe(case, sides: tuple[str, ...]) -> list:
    inputs = {k: case.inputs[k] for k in sorted(case.inputs)}
    steps = {k: case.outputs[k] for k in sorted(case.outputs) if k.startswith("step.")}
    order = sorted(steps, key=lambda k: (int(k.split(".")[1]), k))
    checks = []
    for side in sides:
        with exceptions_fail(checks, f"{case.name}/{side}:latents"):
            trace: dict[str, torch.Tensor] = {}
            video, audio = run_side(side, case.path, case.params, inputs, trace.__setitem__)
            div = first_divergence(trace, {k: steps[k] for k in order}, case.tolerance)
            for name, got in zip(FINAL, (video, audio)):
                checks.append(tensor_check(f"{case.name}/{side}:{name}", got, case.outputs[name], case.tolerance,
                                           div.name if div else None))
            for k in order:
                checks.append(tensor_check(f"{case.name}/{side}:{k}", trace[k], steps[k], case.tolerance))
    return checks
