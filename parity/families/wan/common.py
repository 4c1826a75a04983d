"""wan parity: what every level shares. The models a run checks (whole-model variants, VAE-only variants, or one
canonical checkpoint), their seeded random weights, the two sides' DiT / pipeline adapters (the only place the
harness knows their APIs), per-block traces and the engine-side decode.

A "model under test" is one of four kinds:
    model          a whole Wan model (WanModelConfig): DiT expert(s), UMT5, VAE; every level applies
    vae            a VAE variant or converted VAE dir (WanVAEConfig): the VAE rows of C0 only
    transformer    a converted DiT dir (WanDiTConfig): the DiT rows of C0 only  (fvconvert post-check)
    text_encoder   a converted UMT5 dir (UMT5Config): the UMT5 rows of C0 only   (fvconvert post-check)
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch

import manifests.parity as contracts
from manifests import ManifestError
from manifests.parity import METRICS, Tolerance
from manifests.wan import (UMT5Config, WanDiTConfig, WanGenerateRequest, WanModelConfig,
                           canonical_key_shapes, dit_key_shapes, list_model_variants, list_variants,
                           load_model_variant, load_variant, umt5_key_shapes)
from manifests.wan.clip import clip_vision_key_shapes
from parity.errors import SetupError, UpstreamConversionFailed
from parity.family import DTYPE_NAMES
from parity.localise import first_divergence
from parity.weights import fan_in_init, random_state_dict

import optimized
from optimized.models.wan.denoise import WanDenoiseJob
import reference.wan as ref

# The first default variant is the one a single-variant run (and the registry's fault sweep) checks: the two-expert
# model, so every planted fault (expert switching included) has something to break.
DEFAULT_VARIANTS = ("tiny-2.2-t2v-a14b", "tiny-2.1-t2v", "tiny-2.1-i2v", "tiny-2.2-ti2v")
KINDS = ("model", "vae", "transformer", "text_encoder")

# (upstream) modules diffusers / transformers keep in fp32 when the model is loaded in half precision
# (`_keep_in_fp32_modules`): a parameter stays fp32 when one of these names is a dot-separated part of its key.
DIT_KEEP_FP32 = ("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
UMT5_KEEP_FP32 = ("wo",)


def variants() -> list[str]:
    """Whole-model variants first, then the VAE-only variants (C0's VAE rows, as before the DiT port)."""
    return list_model_variants() + list_variants()


@dataclass
class ModelUnderTest:
    name: str
    kind: str                                   # one of KINDS
    cfg: Any                                    # WanModelConfig | WanVAEConfig | WanDiTConfig | UMT5Config
    weights: dict[str, dict[str, torch.Tensor]]  # component -> fp32 canonical state dict

    @property
    def is_model(self) -> bool:
        return self.kind == "model"


# ------------------------------------------------------------------------------------------------
# Seeded random weights (the one generator, parity/weights.py, with wan's init rule)
# ------------------------------------------------------------------------------------------------

def wan_init(name: str, shape: tuple[int, ...], r: torch.Tensor) -> torch.Tensor:
    """DiT / UMT5 init: norm scales near 1, modulation tables and position biases O(0.1-0.5), token table N(0, 1),
    other weights fan-in (so every weight reaches the output and activations stay O(1))."""
    leaf = name.rsplit(".", 2)
    if len(shape) == 1 and name.endswith(".weight") and len(leaf) > 1 and "norm" in leaf[-2]:
        return 1.0 + 0.1 * r
    if name.endswith("scale_shift_table"):
        return 0.1 * r
    if name == "shared.weight":
        return r
    if "relative_attention_bias" in name:
        return 0.5 * r
    return fan_in_init(name, shape, r)


def random_model_weights(cfg: WanModelConfig, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """One seeded draw per component (seed, seed + 1, ... in a fixed order); the VAE draw equals the VAE-only
    variant's at the same seed (fan-in rule), so a model's VAE rows reproduce that variant's."""
    out = {"transformer": random_state_dict(dit_key_shapes(cfg.dit), seed + 1, wan_init),
           "text_encoder": random_state_dict(umt5_key_shapes(cfg.text_encoder), seed + 2, wan_init),
           "vae": random_state_dict(canonical_key_shapes(cfg.vae), seed)}
    if cfg.two_experts:
        out["transformer_2"] = random_state_dict(dit_key_shapes(cfg.dit_2), seed + 3, wan_init)
    if cfg.has_image_encoder:   # 2.1 I2V's CLIP tower: layer norms near 1 (wan_init's "norm" rule)
        out["image_encoder"] = random_state_dict(clip_vision_key_shapes(cfg.image_encoder), seed + 4, wan_init)
    return out


# ------------------------------------------------------------------------------------------------
# Which models a run checks
# ------------------------------------------------------------------------------------------------

def _variant(name: str, seed: int) -> ModelUnderTest:
    if name in list_model_variants():
        cfg = load_model_variant(name)
        return ModelUnderTest(name, "model", cfg, random_model_weights(cfg, seed))
    if name in list_variants():
        cfg = load_variant(name)
        return ModelUnderTest(name, "vae", cfg, {"vae": random_state_dict(canonical_key_shapes(cfg), seed)})
    raise SetupError(f"wan: unknown variant {name!r}; known: {', '.join(variants())}")


def _checkpoint(path: str, named: list[str]) -> ModelUnderTest:
    """A canonical checkpoint fvconvert wrote: a whole model directory or one component directory."""
    from manifests.checkpoint import load_state, read_checkpoint

    ckpt = read_checkpoint(path, family="wan")
    if ckpt.partial:
        raise SetupError(f"checkpoint {path} is partial; parity needs every part")
    cfg = ckpt.typed_config()
    if ckpt.is_model:
        kind = "model"
        weights = {name: {k: t.float() for k, t in load_state(ckpt, component=name).items()}
                   for name in ckpt.components}
    else:
        (comp,) = ckpt.components.values()
        kind = comp.kind
        weights = {kind: {k: t.float() for k, t in load_state(ckpt).items()}}
    for v in named:  # every named variant must have the checkpoint's architecture
        want = _variant_config(v, kind)
        if want != cfg:
            raise SetupError(f"checkpoint {path} does not have the architecture of variant {v!r}")
    return ModelUnderTest("checkpoint", kind, cfg, weights)


def _variant_config(name: str, kind: str) -> Any:
    if name in list_variants() and kind == "vae":
        return load_variant(name)
    if name not in list_model_variants():
        raise SetupError(f"wan: variant {name!r} is not a whole-model variant (a {kind} checkpoint compares with "
                         f"one of {', '.join(list_model_variants())})")
    cfg = load_model_variant(name)
    return {"model": cfg, "transformer": cfg.dit, "text_encoder": cfg.text_encoder, "vae": cfg.vae,
            "image_encoder": cfg.image_encoder}[kind]


def resolve_models(variants: list[str], checkpoint: str | None, seed: int,
                   kinds: tuple[str, ...] = KINDS) -> list[ModelUnderTest]:
    try:
        if checkpoint is None:
            models = [_variant(v, seed) for v in (variants or DEFAULT_VARIANTS)]
        else:
            models = [_checkpoint(checkpoint, variants)]
    except ManifestError as e:  # CheckpointError included
        raise SetupError(str(e)) from None
    wrong = [f"{m.name} ({m.kind})" for m in models if m.kind not in kinds]
    if wrong:
        raise SetupError(f"this level runs on {' / '.join(kinds)} models; not on {', '.join(wrong)}")
    return models


# ------------------------------------------------------------------------------------------------
# Tolerances: the family contract (manifests/wan/parity.json), with per-component rows
# ------------------------------------------------------------------------------------------------

def contract_tolerance(level: str, component: str, dtype: str, device: str) -> Tolerance:
    """The contract's `component_tolerances` row for (level, component, dtype, device or "*"), else its level row.
    Components: dit, umt5, scheduler, input, vae (C0), loop (C1), frames (C4)."""
    dname, dev = DTYPE_NAMES.get(dtype, dtype), device.split(":")[0]
    path = Path(contracts.__file__).parent / "wan" / "parity.json"
    rows = json.loads(path.read_text()).get("component_tolerances", [])
    for want_dev in (dev, "*"):
        for row in rows:
            if (row["level"], row["component"], row["dtype"], row.get("device", "*")) == (level, component, dname,
                                                                                         want_dev):
                return Tolerance(**{k: v for k, v in row.items() if k in METRICS}).validate(f"{path} {row}")
    try:
        return contracts.load_parity_contract("wan").tolerance(level, dname, dev)
    except ManifestError as e:
        raise SetupError(str(e)) from None


# ------------------------------------------------------------------------------------------------
# Precision: each side's weights in a run dtype
# ------------------------------------------------------------------------------------------------

def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype, keep_fp32: tuple[str, ...],
               device: str = "cpu") -> dict[str, torch.Tensor]:
    """The state dict as upstream loads it in `dtype`: `_keep_in_fp32_modules` keys stay fp32 (upstream)."""
    return {k: v.to(device, torch.float32 if any(m in k.split(".") for m in keep_fp32) else dtype)
            for k, v in state.items()}


def load_reference_dit(cfg: WanDiTConfig, state, device: str, dtype: torch.dtype) -> ref.WanTransformer:
    return ref.load_wan_transformer(cfg, cast_state(state, dtype, DIT_KEEP_FP32, device))


def load_reference_umt5(cfg: UMT5Config, state, device: str, dtype: torch.dtype) -> ref.UMT5Encoder:
    return ref.load_umt5(cfg, cast_state(state, dtype, UMT5_KEEP_FP32, device))


def load_optimized_dit(cfg: WanDiTConfig, state, device: str, dtype: torch.dtype, component_id: str = "transformer"):
    from optimized.models.wan.transformer import WanDiTFast
    return WanDiTFast(cfg, state, device, dtype, component_id=component_id)


def load_optimized_umt5(cfg: UMT5Config, state, device: str, dtype: torch.dtype):
    from optimized.models.wan.text_encoder import UMT5Fast
    return UMT5Fast(cfg, state, device, dtype)


# ------------------------------------------------------------------------------------------------
# DiT forward on both sides, with per-block traces under the optimized side's names
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DiTInputs:
    latents: torch.Tensor                 # [B, C_in, T, H, W]
    timestep: torch.Tensor                # [B] int64 / float32, or [B, S] float32
    text: torch.Tensor                    # [B, L, text_dim]
    image_embeds: torch.Tensor | None     # [B, N, image_dim]

    def to(self, device: str, dtype: torch.dtype) -> "DiTInputs":
        c = lambda t: None if t is None else t.to(device, dtype)  # noqa: E731
        return replace(self, latents=c(self.latents), timestep=self.timestep.to(device), text=c(self.text),
                       image_embeds=c(self.image_embeds))

    def row(self, i: int) -> "DiTInputs":
        s = slice(i, i + 1)
        return DiTInputs(self.latents[s], self.timestep[s], self.text[s],
                         None if self.image_embeds is None else self.image_embeds[s])

    @staticmethod
    def cat(rows: list["DiTInputs"]) -> "DiTInputs":
        img = None if rows[0].image_embeds is None else torch.cat([r.image_embeds for r in rows])
        return DiTInputs(torch.cat([r.latents for r in rows]), torch.cat([r.timestep for r in rows]),
                         torch.cat([r.text for r in rows]), img)


@contextlib.contextmanager
def reference_trace(model: ref.WanTransformer) -> Iterator[dict[str, torch.Tensor]]:
    """Forward hooks on the reference DiT's embeddings, blocks and output projection, recorded under the names the
    optimized `forward_batch(trace=...)` uses (the 6-way modulation flattened to [B(, S), 6D] as upstream's
    timestep_proj)."""
    records: dict[str, torch.Tensor] = {}
    hooks = []

    def put(name: str):
        return lambda mod, args, out: records.__setitem__(name, out.detach().clone())

    def cond(mod, args, out):
        temb, modulation, text, image = out
        records["condition_embedder"] = modulation.flatten(-2).detach().clone()
        records["condition_embedder.temb"] = temb.detach().clone()
        records["condition_embedder.text"] = text.detach().clone()
        if image is not None:
            records["condition_embedder.image"] = image.detach().clone()

    hooks.append(model.patch_embedding.register_forward_hook(put("patch_embedding")))
    hooks.append(model.condition_embedder.register_forward_hook(cond))
    hooks += [b.register_forward_hook(put(f"blocks.{i}")) for i, b in enumerate(model.blocks)]
    hooks.append(model.proj_out.register_forward_hook(put("proj_out")))
    try:
        yield records
    finally:
        for h in hooks:
            h.remove()


def run_reference_dit(model: ref.WanTransformer, x: DiTInputs, trace: dict | None = None) -> torch.Tensor:
    with torch.no_grad():
        if trace is None:
            return model(x.latents, x.timestep, x.text, x.image_embeds)
        with reference_trace(model) as rec:
            out = model(x.latents, x.timestep, x.text, x.image_embeds)
        trace.update(rec)
        return out


def run_optimized_dit(fast, x: DiTInputs, trace: dict | None = None) -> torch.Tensor:
    return fast.forward_batch(x.latents, x.timestep, x.text, x.image_embeds, trace=trace)


def localise_dit(reference_model, fast, x: DiTInputs, tol: Tolerance) -> str:
    """Both sides on the same (solo) inputs, traced; the first traced name outside tolerance."""
    want, got = {}, {}
    run_reference_dit(reference_model, x, want)
    run_optimized_dit(fast, x, got)
    div = first_divergence(got, want, tol)
    return "outputs only (every traced layer within tolerance)" if div is None else \
        f"{div.name} (rel_l2 {div.metrics.rel_l2:.2e})"


def convert_upstream(case, src) -> tuple[Any, dict[str, torch.Tensor]]:
    """A golden case's upstream component folder through fvconvert's in-memory path (the `--from` alias of the
    case's upstream_format, detected from the folder's config): (config, canonical state dict). The original Wan-AI
    layout carries no config the converter reads: its architecture is case.json `config` (the upstream config, as
    `--config`; golden/README.md), `params.variant` (as `--variant`) only for cases made before."""
    from converters import ConversionError, convert_to_state_dict
    from converters.pipeline import detect_format
    from parity.golden import case_config, config_file

    fmt = case.meta["upstream_format"]
    own = case_config(case) if fmt == "original" else None
    variant = case.meta.get("params", {}).get("variant") if fmt == "original" and own is None else None
    if fmt == "original" and own is None and variant is None:
        raise SetupError(f"golden case {case.path}: an original-layout case carries its config (case.json config)")
    try:
        with config_file(own) as conf:
            return convert_to_state_dict("wan", detect_format("wan", fmt, src), src, config=conf, variant=variant)
    except ConversionError as e:
        raise UpstreamConversionFailed(f"golden case {case.path}: {src.name}/: {e}") from None
    except ManifestError as e:
        raise SetupError(f"golden case {case.path}: {src.name}/: {e}") from None


# ------------------------------------------------------------------------------------------------
# Requests and the two pipelines
# ------------------------------------------------------------------------------------------------

def ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def make_request(cfg: WanModelConfig, seed: int, guidance: float = 5.0, text_len: int = 7, image: bool = True,
                 **kw) -> WanGenerateRequest:
    """A small request: 5 pixel frames (2 latent frames), a 2 x 2 patch grid, 4 steps; the image (and CLIP
    embeddings) the task needs, drawn from the seed."""
    vocab = cfg.text_encoder.vocab_size
    s = cfg.vae.spatial_compression * cfg.dit.patch_size[1]
    base = dict(text_ids=ids(text_len, 1000 + seed, vocab), negative_text_ids=ids(4, 2000 + seed, vocab),
                num_frames=5, height=2 * s, width=2 * s, num_steps=4, guidance_scale=guidance, seed=seed)
    base.update(kw)
    g = torch.Generator().manual_seed(3000 + seed)
    if cfg.task == "i2v" or (cfg.task == "ti2v" and image):
        base.setdefault("image", torch.rand(3, base["height"], base["width"], generator=g) * 2 - 1)
    if cfg.dit.has_image_branch:
        base.setdefault("image_embeds", torch.randn(3, cfg.dit.image_dim, generator=g))
    return WanGenerateRequest(**base).validate(cfg)


# ------------------------------------------------------------------------------------------------
# Golden wan.generate cases from an image (2.1 I2V with its CLIP image encoder)
# ------------------------------------------------------------------------------------------------

IMAGE_INPUT = "image_rgb"   # uint8 [H, W, 3]: the image upstream was given (as a PIL image), not yet resized


def golden_components(cfg: WanModelConfig) -> dict[str, Any]:
    """{upstream/<component>: its config} a golden model needs (the image encoder when the model has one)."""
    want = {"transformer": cfg.dit, "text_encoder": cfg.text_encoder, "vae": cfg.vae}
    if cfg.two_experts:
        want["transformer_2"] = cfg.dit_2
    if cfg.has_image_encoder:
        want["image_encoder"] = cfg.image_encoder
    return want


def write_image_processor(cfg: WanModelConfig, folder: Path) -> None:
    """folder/preprocessor_config.json: the model's CLIPImageProcessor as a diffusers pipeline root stores it."""
    p = cfg.image_processor
    folder.mkdir(parents=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": p.shortest_edge},
         "crop_size": {"height": p.crop_height, "width": p.crop_width}, "image_mean": list(p.image_mean),
         "image_std": list(p.image_std), "resample": p.resample}))


def golden_image_request(case, cfg: WanModelConfig, weights, req: WanGenerateRequest, side: str):
    """(the side's request, its rows): for a case storing `image_rgb`, each side's own processor makes the VAE
    pixels (resized to height x width) and its own pipeline's image encoder the image_embeds of the ORIGINAL image,
    checked against upstream's `image_embeds` when stored. Other cases: the request as stored, no rows."""
    from PIL import Image

    from parity.report import tensor_check

    if IMAGE_INPUT not in case.inputs:
        return req, []
    if not cfg.has_image_encoder:
        raise SetupError(f"golden case {case.path}: {IMAGE_INPUT} needs a model_config with an image_encoder")
    image = Image.fromarray(case.inputs[IMAGE_INPUT].numpy())
    if side == "reference":
        from reference.wan.processor import vae_pixels
        pixels = vae_pixels(image, req.height, req.width)[0]
        embeds = ref.WanReferencePipeline(cfg, weights).encode_image(image)
    else:   # the serving path: the loaded model's encoder as media.py hands it to the processor / request builder
        from optimized.models.wan.media import image_encoder_of
        from optimized.models.wan.processor import WanProcessor
        pixels = WanProcessor.vae_image(image, req.height, req.width)[0]
        engine = optimized.Engine.from_weights(cfg, weights, weights_version="golden")
        embeds = image_encoder_of(engine)([WanProcessor.clip_source(image)])[0]
    rows = []
    if "image_embeds" in case.outputs:
        rows.append(tensor_check(f"{case.name}/{side}:image_embeds", embeds, case.outputs["image_embeds"],
                                 case.tolerance, "image_encoder", "CLIP hidden_states[-2] of the original image"))
    try:
        return replace(req, image=pixels, image_embeds=embeds).validate(cfg), rows
    except ValueError as e:
        raise SetupError(f"golden case {case.path}: {e}") from None


def reference_pipeline(m: ModelUnderTest, device: str = "cpu") -> ref.WanReferencePipeline:
    """The readable pipeline on the fp32 CPU weights (its only precision and device; any engine is compared to it).
    `device` is where the caller's engine runs; the reference stays on CPU (it draws its noise there, as upstream)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError("--device cuda requested but CUDA is not available")
    return ref.WanReferencePipeline(m.cfg, m.weights)


def engine_for(m: ModelUnderTest, device: str, dtype: torch.dtype, seed: int, cfg_policy: str = "batched"):
    return optimized.Engine.from_weights(m.cfg, m.weights, device, dtype, weights_version=f"parity:{m.name}:{seed}",
                                         cfg_policy=cfg_policy, batching="greedy")


def optimized_step_input(loop, request: WanGenerateRequest, latents: torch.Tensor | None = None, step: int = 0):
    """The optimized loop's DiT input (cond branch) for `request` at `step`, from `latents` (default: its initial
    latents): (state, BranchInput)."""
    state = loop.init_state(WanDenoiseJob(request))
    if latents is not None:
        state = replace(state, latents=latents.to(state.latents), step=step)
    return state, loop._branch(state, state.text)


# ------------------------------------------------------------------------------------------------
# Engine-side decode: the family's own media chain (de-normalise), then its VAE decode loop under the scheduler
# ------------------------------------------------------------------------------------------------

def engine_decode(engine, latents: torch.Tensor, chunk_frames: int = 1) -> torch.Tensor:
    """Final latents -> video [1, 3, F, H, W] in [-1, 1] the way the engine serves them: the wan entry's media chain
    builds the decode request (WanPipeline's de-normalisation, optimized/models/wan/media.py), the engine's
    `vae_decode` loop runs it through the scheduler."""
    request = engine.family.media(engine).decode_request("parity/decode", latents)
    if chunk_frames != request.chunk_frames:
        request = replace(request, chunk_frames=chunk_frames)
    return engine.generate(request)


def fmt_drift(values: list[float]) -> str:
    if not values:
        return "no steps"
    shown = ", ".join(f"{v:.1e}" for v in values)
    first = next((v for v in values if v > 0), 0.0)
    growth = values[-1] / first if first > 0 and math.isfinite(values[-1]) else float("nan")
    return f"rel L2 per step [{shown}]" + (f", x{growth:.1f} first to last" if growth == growth else "")
