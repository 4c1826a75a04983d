#!/usr/bin/env python
"""Make golden cases for probe ``wan.generate`` from upstream diffusers code (golden/wan/pipe_*).

One case = one end-to-end run of diffusers' ``WanPipeline`` or ``WanImageToVideoPipeline`` ``__call__`` on tiny
components with seeded random weights (CPU, fp32, one thread), the prompts given as token ids through a stub
tokenizer (so the pipeline's own ``_get_t5_prompt_embeds`` runs: pad to max_sequence_length, UMT5, trim, zero-pad),
the noise drawn by the pipeline from ``generator=torch.Generator().manual_seed(seed)``:

  * transformer (+ transformer_2): ``WanTransformer3DModel`` with the manifest variant's DiT config;
  * text_encoder: transformers ``UMT5EncoderModel`` with the variant's UMT5 config;
  * vae: ``AutoencoderKLWan`` with the variant's VAE config (it encodes the image for i2v / ti2v and decodes);
  * image_encoder (``pipe_i2v_image``): transformers ``CLIPVisionModel`` with the variant's CLIP config and
    ``image_processor``: ``CLIPImageProcessorPil``: the pipeline's own ``encode_image`` runs on the PIL image
    ``image_rgb`` (the original, before the VAE's resize to height x width); cases with stored ``image_embeds``
    use the variant without its image encoder (a stub returns the stored embeddings);
  * scheduler: ``UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift)``
    (the Wan release config) or ``FlowMatchEulerDiscreteScheduler(shift)``.

Every component is stored under ``upstream/<component>/`` with ``save_pretrained`` (diffusers / transformers
layout). Per-step latents come from ``callback_on_step_end``; the model calls from a forward pre-hook on each
transformer. A second run with ``output_type="pt"`` captures the VAE decoder's input and output (``video``).
Format: golden/README.md, section "Probe wan.generate".

    python tools/make_wan_pipeline_goldens.py --out golden/wan                  # every case
    python tools/make_wan_pipeline_goldens.py --out golden/wan --only pipe_t2v
    python tools/make_wan_pipeline_goldens.py --verify golden/wan/pipe_*        # re-run upstream from the files

Needs diffusers (0.42.1 was used), transformers (5.24.0), torch, safetensors, accelerate (for --verify).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from manifests.wan.model import WanModelConfig, load_model_variant  # noqa: E402

FAMILY, PROBE = "wan", "wan.generate"
TESTED = {"diffusers": "0.42.1", "transformers": "5.24.0"}
REL_L2_TOL = 1e-5

CASES: dict[str, dict[str, Any]] = {
    "pipe_t2v": dict(video=True, variant="tiny-2.1-t2v", seed=9101, solver="unipc", flow_shift=3.0, num_frames=5, height=32,
                     width=32, steps=3, guidance=5.0, guidance_2=None, text_len=7, negative_len=4,
                     description="Wan2.1 T2V: UniPC (flow_shift 3), CFG 5.0, 3 steps, 5 frames 32x32 -> [1,4,2,4,4]"),
    "pipe_euler": dict(variant="tiny-2.1-t2v", seed=9102, solver="euler", flow_shift=5.0, num_frames=9, height=16,
                       width=32, steps=4, guidance=1.0, guidance_2=None, text_len=11, negative_len=3,
                       description="Wan2.1 T2V: FlowMatch Euler (shift 5, float timesteps), guidance 1.0 = no "
                                   "uncond pass, 4 steps, 9 frames 16x32 -> [1,4,3,2,4]"),
    "pipe_a14b": dict(variant="tiny-2.2-t2v-a14b", seed=9103, solver="unipc", flow_shift=3.0, num_frames=5,
                      height=32, width=32, steps=4, guidance=4.0, guidance_2=2.5, text_len=9, negative_len=6,
                      description="Wan2.2 A14B-style: two experts, boundary 875 crossed after step 2 (t 999, 900 | "
                                  "750, 500), guidance 4.0 then guidance_2 2.5"),
    "pipe_i2v": dict(video=True, variant="tiny-2.1-i2v", seed=9104, solver="unipc", flow_shift=5.0, num_frames=5, height=32,
                     width=32, steps=3, guidance=5.0, guidance_2=None, text_len=8, negative_len=5, image=True,
                     image_tokens=3,
                     description="Wan2.1 I2V: image (+ zero frames) VAE-encoded, 4-channel mask, image_embeds "
                                 "[3, 8] through the image branch, text padded to 512, CFG 5.0, 3 steps"),
    "pipe_i2v_image": dict(video=False, variant="tiny-2.1-i2v", seed=9114, solver="unipc", flow_shift=5.0,
                           num_frames=5, height=32, width=32, steps=3, guidance=5.0, guidance_2=None, text_len=6,
                           negative_len=4, image_rgb=(40, 30),
                           description="Wan2.1 I2V from an image: a 40x30 RGB image (PIL) -> LANCZOS to 32x32 for "
                                       "the VAE condition and, unresized, through CLIPImageProcessor (shortest "
                                       "edge 28, centre crop) + CLIPVisionModel hidden_states[-2] [17, 8] for the "
                                       "image branch; CFG 5.0, 3 steps"),
    "pipe_ti2v": dict(variant="tiny-2.2-ti2v", seed=9105, solver="unipc", flow_shift=5.0, num_frames=5, height=32,
                      width=64, steps=3, guidance=3.0, guidance_2=None, text_len=6, negative_len=8, image=True,
                      description="Wan2.2 TI2V: expand_timesteps (per-token timesteps, 0 on latent frame 0), "
                                  "image latents blended into frame 0, Wan2.2 VAE (patch 2), CFG 3.0, 3 steps"),
    "pipe_g05": dict(variant="tiny-2.1-t2v", seed=9106, solver="unipc", flow_shift=3.0, num_frames=5, height=32,
                     width=32, steps=3, guidance=0.5, guidance_2=None, text_len=7, negative_len=4,
                     description="Wan2.1 T2V: guidance 0.5 < 1 with a negative prompt given: WanPipeline runs no "
                                 "CFG (`guidance_scale > 1`), one DiT call per step, UniPC 3 steps"),
    "pipe_a14b_boundary": dict(variant="tiny-2.2-t2v-a14b", seed=9107, solver="unipc", flow_shift=3.5,
                               num_frames=5, height=32, width=32, steps=3, guidance=4.0, guidance_2=3.0, text_len=5,
                               negative_len=3, boundary_step=1,
                               description="Wan2.2 A14B-style: flow_shift 3.5 puts step 1's timestep exactly on the "
                                           "boundary 875 (t 999, 875 | 637): upstream `t >= boundary` runs the "
                                           "high-noise expert there; guidance 4.0 then guidance_2 3.0"),
    # expert-dependent guidance and boundary steps at other boundary ratios (a model config with the variant's
    # components and its own boundary_ratio); the components are pipe_a14b's (weights_seed), so git stores them once
    "pipe_a14b_r05_on": dict(variant="tiny-2.2-t2v-a14b", boundary_ratio=0.5, weights_seed=9103, seed=9108,
                             solver="unipc", flow_shift=1.0, num_frames=5, height=32, width=32, steps=4,
                             guidance=2.0, guidance_2=6.0, text_len=6, negative_len=5, boundary_step=2,
                             description="two experts at boundary_ratio 0.5: UniPC shift 1.0 gives t 999, 750, 500 "
                                         "(exactly on the boundary: expert 1) | 250 (expert 2); guidance 2.0 on "
                                         "expert 1, guidance_2 6.0 (the larger one) on expert 2"),
    "pipe_a14b_r09_below": dict(variant="tiny-2.2-t2v-a14b", boundary_ratio=0.9, weights_seed=9103, seed=9109,
                                solver="unipc", flow_shift=4.45, num_frames=5, height=32, width=32, steps=3,
                                guidance=5.0, guidance_2=1.5, text_len=8, negative_len=4, below_boundary_step=1,
                                description="two experts at boundary_ratio 0.9 (the I2V A14B value): UniPC shift "
                                            "4.45 gives t 999 | 899 (one below the boundary 900: expert 2), 690; "
                                            "guidance 5.0 then guidance_2 1.5"),
    "pipe_a14b_euler_below": dict(variant="tiny-2.2-t2v-a14b", weights_seed=9103, seed=9110, solver="euler",
                                  flow_shift=3.48, num_frames=5, height=32, width=32, steps=4, guidance=3.0,
                                  guidance_2=1.5, text_len=7, negative_len=6, below_boundary_step=1,
                                  description="two experts, FlowMatch Euler (float timesteps) shift 3.48: t 1000.0 | "
                                              "874.943 (below the boundary 875 by a fraction: expert 2; rounded to "
                                              "an int it would be expert 1), 637.443, 11.977; guidance 3.0 then "
                                              "guidance_2 1.5"),
    "pipe_ti2v_text": dict(variant="tiny-2.2-ti2v", weights_seed=9105, seed=9112, solver="unipc", flow_shift=5.0,
                           num_frames=5, height=32, width=64, steps=3, guidance=3.0, guidance_2=None, text_len=9,
                           negative_len=5,
                           description="Wan2.2 TI2V without an image (WanPipeline, expand_timesteps): the mask is all "
                                       "ones, so every token's timestep is t (frame 0 included) and nothing is "
                                       "blended; components shared with pipe_ti2v"),
    "pipe_a14b_g1": dict(variant="tiny-2.2-t2v-a14b", weights_seed=9103, seed=9111, solver="unipc", flow_shift=3.0,
                         num_frames=5, height=32, width=32, steps=4, guidance=1.0, guidance_2=4.0, text_len=5,
                         negative_len=7,
                         description="two experts, guidance 1.0 with guidance_2 4.0: upstream decides CFG by "
                                     "guidance_scale alone (`guidance_scale > 1`), so no step runs an uncond pass, "
                                     "not even expert 2's (t 999, 900 | 750, 500)"),
    "pipe_a14b_g05": dict(variant="tiny-2.2-t2v-a14b", weights_seed=9103, seed=9113, solver="euler", flow_shift=5.0,
                          num_frames=5, height=32, width=32, steps=3, guidance=0.5, guidance_2=3.0, text_len=6,
                          negative_len=4,
                          description="two experts, FlowMatch Euler shift 5, guidance 0.5 with guidance_2 3.0: no "
                                      "CFG on either expert (`guidance_scale > 1` decides), cond only on both"),
}


def _setup() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


# ------------------------------------------------------------------------------------------------ weights

@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Every parameter, in ``named_parameters()`` order (tied ones once), r ~ N(0, 1) from one generator:
    norm scales (``*norm*.weight``, 1-D) 1 + 0.1 r; other 1-D (biases) 0.1 r; ``scale_shift_table`` 0.1 r;
    ``shared.weight`` (token embeddings) r; ``relative_attention_bias`` 0.5 r; other weights r / sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
        if p.ndim == 1 and "norm" in leaf:
            v = 1.0 + 0.1 * r
        elif p.ndim == 1 or name.endswith("scale_shift_table"):
            v = 0.1 * r
        elif name.endswith("shared.weight"):
            v = r
        elif name.endswith("relative_attention_bias.weight"):
            v = 0.5 * r
        else:
            v = r / math.sqrt(p[0].numel())
        p.copy_(v)


def vae_weights_rule(model: torch.nn.Module, seed: int) -> None:
    """The VAE recipe of tools/make_vae_goldens.py (keeps decoded pixels mostly inside the [-1, 1] clamp)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_vae_goldens import randomize_weights as vae_randomize
    vae_randomize(model, seed)


def build_components(cfg: WanModelConfig, seed: int) -> dict[str, torch.nn.Module]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    def dit(c, s):
        torch.manual_seed(s)
        d = dict(c.to_diffusers_config())
        d.pop("_class_name")
        m = WanTransformer3DModel(**d).eval()
        randomize_weights(m, s)
        return m

    out = {"transformer": dit(cfg.dit, seed)}
    if cfg.dit_2 is not None:
        out["transformer_2"] = dit(cfg.dit_2, seed + 50)
    torch.manual_seed(seed + 100)
    te = UMT5EncoderModel(UMT5Config(**cfg.text_encoder.to_transformers_config())).eval()
    randomize_weights(te, seed + 100)
    out["text_encoder"] = te
    torch.manual_seed(seed + 200)
    vd = dict(cfg.vae.to_diffusers_config())
    vd.pop("_class_name", None)
    vae = AutoencoderKLWan(**vd).eval()
    vae_weights_rule(vae, seed + 200)
    out["vae"] = vae
    if cfg.image_encoder is not None:   # 2.1 I2V: transformers CLIPVisionModel (its layer norms near 1)
        from transformers import CLIPVisionConfig, CLIPVisionModel
        torch.manual_seed(seed + 300)
        enc = CLIPVisionModel(CLIPVisionConfig(**cfg.image_encoder.to_transformers_config())).eval()
        randomize_weights(enc, seed + 300)
        out["image_encoder"] = enc
    return out


def make_image_processor(cfg: WanModelConfig):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    p = cfg.image_processor
    return CLIPImageProcessorPil(size={"shortest_edge": p.shortest_edge},
                                 crop_size={"height": p.crop_height, "width": p.crop_width},
                                 image_mean=list(p.image_mean), image_std=list(p.image_std), resample=p.resample)


def load_components(case_dir: Path) -> dict[str, torch.nn.Module]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel
    up = case_dir / "upstream"
    out = {"transformer": WanTransformer3DModel.from_pretrained(up / "transformer")}
    if (up / "transformer_2").is_dir():
        out["transformer_2"] = WanTransformer3DModel.from_pretrained(up / "transformer_2")
    out["text_encoder"] = UMT5EncoderModel.from_pretrained(up / "text_encoder")
    out["vae"] = AutoencoderKLWan.from_pretrained(up / "vae")
    if (up / "image_encoder").is_dir():
        from transformers import CLIPVisionModel
        out["image_encoder"] = CLIPVisionModel.from_pretrained(up / "image_encoder")
    for m in out.values():
        m.eval()
        for t in list(m.parameters()) + list(m.buffers()):
            t.data = t.data.clone()  # 64-byte aligned, as when built (golden/README.md, weight alignment)
    return out


# ------------------------------------------------------------------------------------------------ the run

def make_scheduler(case: dict[str, Any], cfg: WanModelConfig):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
    if case["solver"] == "unipc":  # the Wan release scheduler config (everything else at the class default)
        return UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                       flow_shift=case["flow_shift"], num_train_timesteps=cfg.num_train_timesteps)
    return FlowMatchEulerDiscreteScheduler(shift=case["flow_shift"], num_train_timesteps=cfg.num_train_timesteps)


class IdsTokenizer:
    """Stands in for the UMT5 tokenizer: maps the two prompt strings to stored ids, padded as the real one pads."""

    def __init__(self, table: dict[str, torch.Tensor]):
        self.table = table

    def __call__(self, prompts, padding, max_length, truncation, add_special_tokens, return_attention_mask,
                 return_tensors):
        assert padding == "max_length" and truncation and return_tensors == "pt"
        ids = torch.zeros(len(prompts), max_length, dtype=torch.int64)
        mask = torch.zeros(len(prompts), max_length, dtype=torch.int64)
        for row, p in enumerate(prompts):
            t = self.table[p][:max_length]
            ids[row, :len(t)], mask[row, :len(t)] = t, 1
        return SimpleNamespace(input_ids=ids, attention_mask=mask)


class StoredImageEncoder(torch.nn.Module):
    """Stands in for the CLIP vision tower: its penultimate hidden state is the stored ``image_embeds`` (upstream
    refuses ``image`` and ``image_embeds`` together, and i2v needs the image for the VAE condition)."""

    def __init__(self, image_embeds: torch.Tensor):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the module a device
        self.embeds = image_embeds
        self.device, self.dtype = torch.device("cpu"), torch.float32  # read by DiffusionPipeline.device / dtype

    def forward(self, pixel_values, output_hidden_states):
        return SimpleNamespace(hidden_states=(self.embeds[None], None))


class StoredImageProcessor:
    def __call__(self, images, return_tensors):
        return SimpleNamespace(to=lambda device: {"pixel_values": images})


def make_inputs(case: dict[str, Any], cfg: WanModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case["seed"] + 1)
    V = cfg.text_encoder.vocab_size
    inp = {"text_ids": torch.randint(1, V, (case["text_len"],), generator=g),
           "negative_text_ids": torch.randint(1, V, (case["negative_len"],), generator=g)}
    if case.get("image"):
        inp["image"] = (torch.rand(3, case["height"], case["width"], generator=g) * 2 - 1).contiguous()
    if case.get("image_tokens"):
        inp["image_embeds"] = torch.randn(case["image_tokens"], cfg.dit.image_dim, generator=g)
    if case.get("image_rgb"):   # smooth structure plus noise (so both resizes matter), uint8 [H, W, 3]
        h, w = case["image_rgb"]
        yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        base = torch.stack([128 + 100 * torch.sin(xx / 5 + c) * torch.cos(yy / 7 - c) for c in range(3)], -1)
        inp["image_rgb"] = (base + 20 * torch.randn(h, w, 3, generator=g)).round().clamp(0, 255).to(torch.uint8)
    return inp


def run_upstream(case: dict[str, Any], cfg: WanModelConfig, comps: dict[str, torch.nn.Module],
                 inp: dict[str, torch.Tensor], output_type: str = "latent") -> dict[str, Any]:
    from diffusers import WanImageToVideoPipeline, WanPipeline
    sched = make_scheduler(case, cfg)
    tok = IdsTokenizer({"cond": inp["text_ids"], "uncond": inp["negative_text_ids"]})
    kw = dict(tokenizer=tok, text_encoder=comps["text_encoder"], vae=comps["vae"], scheduler=sched,
              transformer=comps["transformer"], transformer_2=comps.get("transformer_2"),
              boundary_ratio=cfg.boundary_ratio, expand_timesteps=cfg.expand_timesteps)
    with_image = "image" in inp or "image_rgb" in inp
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v_module
    if not hasattr(i2v_module, "ftfy"):  # i2v's basic_clean calls ftfy unguarded (upstream); identity on ASCII
        i2v_module.ftfy = SimpleNamespace(fix_text=lambda text: text)
    pipe = (WanImageToVideoPipeline if with_image else WanPipeline)(**kw)

    calls: list[dict[str, Any]] = []
    hooks = []
    for expert, name in ((1, "transformer"), (2, "transformer_2")):
        if name in comps:
            hooks.append(comps[name].register_forward_pre_hook(
                lambda m, a, k, e=expert: calls.append({"expert": e, **{n: k[n].clone() for n in (
                    "hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image")
                    if k.get(n) is not None}}), with_kwargs=True))
    trajectory: list[torch.Tensor] = []
    decoded: dict[str, torch.Tensor] = {}
    vae_decode = comps["vae"].decode

    def capture_decode(z, *a, **k):
        out = vae_decode(z, *a, **k)
        decoded.update(decoder_input=z.clone(), video=out[0].clone())
        return out

    comps["vae"].decode = capture_decode

    def on_step_end(p, i, t, kw):
        trajectory.append(kw["latents"].clone())
        return {}

    args = dict(prompt="cond", negative_prompt="uncond", height=case["height"], width=case["width"],
                num_frames=case["num_frames"], num_inference_steps=case["steps"], guidance_scale=case["guidance"],
                guidance_scale_2=case["guidance_2"], generator=torch.Generator().manual_seed(case["seed"]),
                output_type=output_type, callback_on_step_end=on_step_end,
                max_sequence_length=cfg.max_sequence_length)
    if "image_rgb" in inp:  # a PIL image: the pipeline's own CLIP encode_image and VideoProcessor resize
        from PIL import Image
        args["image"] = Image.fromarray(inp["image_rgb"].numpy())
        pipe.image_encoder, pipe.image_processor = comps["image_encoder"], make_image_processor(cfg)
    elif with_image:
        args["image"] = inp["image"][None]  # [-1, 1] tensor: preprocess keeps it as is (no resize, no normalise)
        if "image_embeds" in inp:  # through encode_image's hidden_states[-2]
            pipe.image_encoder, pipe.image_processor = StoredImageEncoder(inp["image_embeds"]), StoredImageProcessor()
    try:
        out = pipe(**args).frames
    finally:
        for h in hooks:
            h.remove()
        del comps["vae"].decode
    return dict(out=out, calls=calls, trajectory=trajectory, decoded=decoded, scheduler=pipe.scheduler)


def real_rows(embeds: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of a [max_sequence_length, d] text embedding; the rest must be exactly zero (upstream)."""
    assert not embeds[n:].any() and embeds[:n].abs().min() > 0, "text padding is not the trim + zero-pad"
    return embeds[:n].contiguous()


def outputs_of(case: dict[str, Any], cfg: WanModelConfig, comps, inp) -> dict[str, torch.Tensor]:
    r = run_upstream(case, cfg, comps, inp, "latent")
    per_step = 2 if case["guidance"] > 1 else 1
    calls = r["calls"]
    assert len(calls) == per_step * case["steps"], (len(calls), case["steps"])
    cond_calls = calls[::per_step]
    C = cfg.latent_channels
    noise = torch.randn((1, C, *cfg.vae.latent_shape(case["num_frames"], case["height"], case["width"])[1:]),
                        generator=torch.Generator().manual_seed(case["seed"]), dtype=torch.float32)
    first = cond_calls[0]["hidden_states"][:, :C]
    if cfg.expand_timesteps and "image" in inp:
        assert torch.equal(first[:, :, 1:], noise[:, :, 1:])  # frame 0 holds the image latents
    else:
        assert torch.equal(first, noise), "the pipeline's noise is not randn(seed) as recorded"
    sched = r["scheduler"]
    boundary = None if cfg.boundary_ratio is None else cfg.boundary_ratio * cfg.num_train_timesteps
    if "boundary_step" in case:  # the case's own claim: a step lands exactly on the boundary and expert 1 runs it
        k = case["boundary_step"]
        assert sched.timesteps[k].item() == boundary and cond_calls[k]["expert"] == 1, (sched.timesteps, boundary)
    if "below_boundary_step" in case:  # the claim: a step within 1 below the boundary, run by expert 2
        k = case["below_boundary_step"]
        t = sched.timesteps[k].item()
        assert boundary - 1 <= t < boundary and cond_calls[k]["expert"] == 2, (sched.timesteps, boundary)
    out = {"latents": r["out"].contiguous(), "trajectory": torch.stack(r["trajectory"]).contiguous(),
           "timesteps": sched.timesteps.clone(), "sigmas": sched.sigmas.clone(), "initial_latents": noise,
           "experts": torch.tensor([c["expert"] for c in cond_calls], dtype=torch.int64),
           "model_timesteps": torch.stack([c["timestep"][0] for c in cond_calls]).contiguous(),
           "text_embeds": real_rows(cond_calls[0]["encoder_hidden_states"][0], len(inp["text_ids"]))}
    if per_step == 2:
        out["negative_text_embeds"] = real_rows(calls[1]["encoder_hidden_states"][0], len(inp["negative_text_ids"]))
    if "image" in inp or "image_rgb" in inp:
        out["model_input_0"] = cond_calls[0]["hidden_states"].contiguous()  # first DiT input (with the condition)
    if "image_rgb" in inp:   # what the image branch was given: encode_image's hidden_states[-2]
        out["image_embeds"] = cond_calls[0]["encoder_hidden_states_image"][0].contiguous()
    if case.get("video"):  # decoded frames (a second run, output_type="pt"): pins WanReferencePipeline.decode
        r2 = run_upstream(case, cfg, comps, inp, "pt")
        assert torch.equal(torch.stack(r2["trajectory"]), out["trajectory"]), "second run differs"
        out["video"] = r2["decoded"]["video"].contiguous()
    return out


# ------------------------------------------------------------------------------------------------ files

def versions() -> dict[str, str]:
    import diffusers
    import transformers
    return {"diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__}


def case_json(name: str, case: dict[str, Any], cfg: WanModelConfig, with_image: bool) -> dict[str, Any]:
    v = versions()
    return {
        "family": FAMILY, "probe": PROBE,
        "upstream": {"package": "diffusers", "version": v["diffusers"],
                     "class": "WanImageToVideoPipeline" if with_image else "WanPipeline", "torch": v["torch"],
                     "transformers": v["transformers"]},
        "upstream_format": "diffusers", "dtype": "float32", "seed": case["seed"],
        **({"weights_seed": case["weights_seed"]} if "weights_seed" in case else {}),
        "tolerance": {"rel_l2": REL_L2_TOL},
        "params": {"variant": case["variant"], "num_frames": case["num_frames"], "height": case["height"],
                   "width": case["width"], "num_inference_steps": case["steps"],
                   "guidance_scale": case["guidance"], "guidance_scale_2": case["guidance_2"],
                   "solver": case["solver"], "flow_shift": case["flow_shift"], "seed": case["seed"],
                   "max_sequence_length": cfg.max_sequence_length, "boundary_ratio": cfg.boundary_ratio,
                   "expand_timesteps": cfg.expand_timesteps, "model_config": cfg.to_dict()},
        "description": case["description"],
        **({"ignore": {"negative_text_ids": NO_CFG_NEGATIVE}} if case["guidance"] <= 1 else {}),
    }


# every stored tensor is checked or ignored with a reason (golden/README.md)
NO_CFG_NEGATIVE = ("guidance_scale <= 1: upstream runs no CFG and never encodes the negative prompt (stored as the "
                   "request carries it; no output depends on it)")


def case_config(case: dict[str, Any]) -> WanModelConfig:
    """The variant's model config, with the case's own boundary_ratio when it names one."""
    cfg = load_model_variant(case["variant"])
    if not case.get("image_rgb") and cfg.image_encoder is not None:   # stored image_embeds: no image encoder
        cfg = WanModelConfig.from_dict({k: v for k, v in cfg.to_dict().items()
                                        if k not in ("image_encoder", "image_processor")})
    if "boundary_ratio" in case:
        cfg = WanModelConfig.from_dict({**cfg.to_dict(), "boundary_ratio": case["boundary_ratio"]})
    return cfg


def write_case(out_root: Path, name: str) -> Path:
    _setup()
    case = CASES[name]
    cfg = case_config(case)
    weights_seed = case.get("weights_seed", case["seed"])
    comps = build_components(cfg, weights_seed)
    inp = make_inputs(case, cfg)
    outs = outputs_of(case, cfg, comps, inp)
    again = outputs_of(case, cfg, build_components(cfg, weights_seed), make_inputs(case, cfg))
    for k in outs:
        assert torch.equal(outs[k], again[k]), f"{name}: {k} not reproducible"
    d = out_root / name
    tmp = out_root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "upstream").mkdir(parents=True)
    for comp, m in comps.items():
        m.save_pretrained(tmp / "upstream" / comp, safe_serialization=True)
    make_scheduler(case, cfg).save_pretrained(tmp / "upstream" / "scheduler")
    if cfg.image_processor is not None:
        make_image_processor(cfg).save_pretrained(tmp / "upstream" / "image_processor")
    save_file({k: v.contiguous() for k, v in inp.items()}, tmp / "inputs.safetensors")
    save_file(outs, tmp / "outputs.safetensors")
    (tmp / "case.json").write_text(json.dumps(case_json(name, case, cfg, "image" in inp or "image_rgb" in inp),
                                              indent=1) + "\n")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    print(f"{name}: {size / 1024:.0f} KB, timesteps {outs['timesteps'].tolist()}, experts {outs['experts'].tolist()}")
    return d


def verify(case_dir: Path) -> bool:
    _setup()
    meta = json.loads((case_dir / "case.json").read_text())
    name = case_dir.name
    case = CASES[name]
    cfg = WanModelConfig.from_dict(meta["params"]["model_config"])
    inp = load_file(case_dir / "inputs.safetensors")
    want = load_file(case_dir / "outputs.safetensors")
    got = outputs_of(case, cfg, load_components(case_dir), inp)
    ok = True
    for k, w in want.items():
        g = got[k]
        if w.is_floating_point():
            rel = ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
            good = rel <= REL_L2_TOL
            print(f"{name}.{k}: rel_l2 {rel:.2e} {'ok' if good else 'FAIL'}")
        else:
            good = torch.equal(g, w)
            print(f"{name}.{k}: {'equal' if good else 'DIFFERENT'}")
        ok &= good
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", action="append")
    ap.add_argument("--verify", nargs="+", type=Path)
    a = ap.parse_args()
    if a.verify:
        return 0 if all([verify(p) for p in a.verify]) else 1
    if not a.out:
        ap.error("--out or --verify")
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.only or list(CASES):
        write_case(a.out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
