"""One resident Wan model: DiT expert(s), UMT5 text encoder, VAE [and 2.1 I2V's CLIP image encoder], loaded once and
shared by every loop.

`weights` maps a component name to its canonical state dict (the names `WanReferencePipeline` uses):
    transformer      `dit_key_shapes(cfg.dit)`            -> `dit`    (WanDiTFast)
    transformer_2    `dit_key_shapes(cfg.dit_2)`          -> `dit_2`  (two-expert models only)
    text_encoder     `umt5_key_shapes(cfg.text_encoder)`  -> `text_encoder` (UMT5Fast, content-hash cached)
    vae              `canonical_key_shapes(cfg.vae)`      -> `vae`    (FastWanVAE, fp32 unless asked otherwise)
    image_encoder    `clip_vision_key_shapes(cfg.image_encoder)` -> `image_encoder` (CLIPVisionFast, content-hash
                     cached) + `image_processor` (CLIPPixels); only when the config has one (2.1 I2V)
The image encoder is the last component: adding it left the random weights of the others unchanged.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from manifests.wan import WanModelConfig, canonical_key_shapes, dit_key_shapes, umt5_key_shapes
from manifests.wan.clip import clip_vision_key_shapes
from optimized.models.wan.image_encoder import IMAGE_ENCODER, CLIPPixels, CLIPVisionFast
from optimized.models.wan.parallelize import read_sharded_state
from optimized.models.wan.text_encoder import UMT5Fast
from optimized.models.wan.transformer import WanDiTFast
from optimized.models.wan.vae import FastWanVAE, load_fast_vae

TRANSFORMER, TRANSFORMER_2, TEXT_ENCODER, VAE = "transformer", "transformer_2", "text_encoder", "vae"


def component_names(cfg: WanModelConfig) -> tuple[str, ...]:
    return (TRANSFORMER,) + ((TRANSFORMER_2,) if cfg.two_experts else ()) + (TEXT_ENCODER, VAE) + \
        ((IMAGE_ENCODER,) if cfg.has_image_encoder else ())


def component_key_shapes(cfg: WanModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    shapes = {TRANSFORMER: dit_key_shapes(cfg.dit), TEXT_ENCODER: umt5_key_shapes(cfg.text_encoder),
              VAE: canonical_key_shapes(cfg.vae)}
    if cfg.two_experts:
        shapes[TRANSFORMER_2] = dit_key_shapes(cfg.dit_2)
    if cfg.has_image_encoder:
        shapes[IMAGE_ENCODER] = clip_vision_key_shapes(cfg.image_encoder)
    return {name: shapes[name] for name in component_names(cfg)}


class WanModelInstance:
    """Built from (config, canonical state dicts per component, device, dtype). The VAE runs in `vae_dtype`
    (fp32 by default, as the Wan pipelines' documented set-up loads it)."""

    def __init__(self, cfg: WanModelConfig, weights: dict[str, dict[str, torch.Tensor]], device: str = "cpu",
                 dtype: torch.dtype = torch.float32, weights_version: str | None = None,
                 vae_dtype: torch.dtype = torch.float32, tp=None):
        self.cfg = cfg.validate()
        names = component_names(cfg)
        missing, unknown = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
        if missing or unknown:
            raise ValueError(f"wan {cfg.task} model: components must be exactly {list(names)}; "
                             f"missing {missing}, unexpected {unknown}")
        self.device, self.dtype, self.vae_dtype = torch.device(device), dtype, vae_dtype
        self.weights_version = weights_version

        def version(component: str) -> str | None:  # None: the component hashes its own weights
            return f"{weights_version}:{component}" if weights_version else None

        # tp: the DiT weights given are this tensor-parallel rank's shards (optimized/models/wan/parallelize.py)
        self.dit = WanDiTFast(cfg.dit, weights[TRANSFORMER], device, dtype, weights_version=version(TRANSFORMER),
                              tp=tp)
        self.dit_2 = WanDiTFast(cfg.dit_2, weights[TRANSFORMER_2], device, dtype,
                                weights_version=version(TRANSFORMER_2), component_id=TRANSFORMER_2, tp=tp) \
            if cfg.two_experts else None
        self.text_encoder = UMT5Fast(cfg.text_encoder, weights[TEXT_ENCODER], device, dtype,
                                     weights_version=version(TEXT_ENCODER))
        self.vae: FastWanVAE = load_fast_vae(cfg.vae, weights[VAE], device=str(device), dtype=vae_dtype)
        self.image_encoder: CLIPVisionFast | None = None
        self.image_processor: CLIPPixels | None = None
        if cfg.has_image_encoder:
            # fp32 whatever the DiT's dtype: the pipeline's documented set-up loads image_encoder in float32 (upstream)
            self.image_encoder = CLIPVisionFast(cfg.image_encoder, weights[IMAGE_ENCODER], device, torch.float32)
            self.image_processor = CLIPPixels(cfg.image_processor)

    def encode_image(self, images) -> torch.Tensor:
        """WanImageToVideoPipeline.encode_image: PIL images / uint8 HWC arrays -> the CLIP encoder's penultimate
        hidden states [B, N, image_dim] (float32, on CPU: what a request's `image_embeds` holds), content-cached."""
        if self.image_encoder is None:
            raise ValueError(f"wan {self.cfg.task} model has no image encoder: pass image_embeds")
        pixels = self.image_processor(images if isinstance(images, (list, tuple)) else [images])
        return self.image_encoder.encode(pixels).to("cpu", torch.float32)

    def memory_components(self):
        """The memory plane's view (optimized/runtime/memory.py): which object holds each component's weights, the
        methods that run it (only cache misses reach an encoder's), and the DiT block lists blockwise offload
        streams."""
        from optimized.runtime.memory import MemoryComponent
        out = [MemoryComponent(TRANSFORMER, self.dit, ("forward_batch",), blocks="blocks")]
        if self.dit_2 is not None:
            out.append(MemoryComponent(TRANSFORMER_2, self.dit_2, ("forward_batch",), blocks="blocks"))
        out += [MemoryComponent(TEXT_ENCODER, self.text_encoder, ("_run",), release_after_use=True),
                MemoryComponent(VAE, self.vae, ("decode_chunk", "encode_chunk"))]
        if getattr(self, "image_encoder", None) is not None:   # 2.1 I2V's CLIP encoder
            out.append(MemoryComponent("image_encoder", self.image_encoder, ("forward",), release_after_use=True))
        return out

    def experts(self) -> tuple[WanDiTFast, ...]:
        return (self.dit,) + ((self.dit_2,) if self.dit_2 is not None else ())

    def configure_graph(self, mode: str = "eager", *, attention: str | None = None, cfg_policy: str | None = None,
                        variant: str | None = None) -> "WanModelInstance":
        """How every DiT expert's block stack runs (eager / compile / cuda, through its CompileCache) and the attention
        backend; `variant` is accepted for the same call as the other families (each expert's GraphKey names its own
        component)."""
        for dit in self.experts():
            dit.configure_graph(mode, attention=attention, cfg_policy=cfg_policy)
        return self

    def expert(self, index: int) -> WanDiTFast:
        """Expert 1 (`transformer`, high noise) or 2 (`transformer_2`, low noise)."""
        if index == 2 and self.dit_2 is not None:
            return self.dit_2
        if index == 1:
            return self.dit
        raise ValueError(f"wan model has no expert {index}")

    @staticmethod
    def random_weights(cfg: WanModelConfig, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
        """Seeded random canonical weights at the config's shapes: matrices ~ N(0, 1/fan_in), biases and tables
        small, norm scales near 1, embeddings N(0, 1). One generator, components and keys in a fixed order."""
        g = torch.Generator().manual_seed(seed)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for component, shapes in component_key_shapes(cfg).items():
            state = {}
            for key, shape in sorted(shapes.items()):
                noise = torch.randn(shape, generator=g)
                leaf = key.rsplit(".", 2)
                is_norm = key.endswith(".gamma") or (key.endswith(".weight") and "norm" in leaf[-2])
                if is_norm:
                    state[key] = 1.0 + 0.1 * noise
                elif key.endswith("shared.weight"):
                    state[key] = noise
                elif len(shape) >= 2 and not key.endswith("scale_shift_table") and "relative_attention" not in key:
                    fan_in = 1
                    for d in shape[1:]:
                        fan_in *= d
                    state[key] = noise / fan_in ** 0.5
                else:
                    state[key] = 0.1 * noise
            out[component] = state
        return out

    @classmethod
    def random(cls, cfg: WanModelConfig, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
               **kw) -> "WanModelInstance":
        """Seeded random weights (benchmarks at released sizes; CPU smoke runs)."""
        digest = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
        return cls(cfg, cls.random_weights(cfg, seed), device, dtype, weights_version=f"random:{digest}:{seed}", **kw)


def load_sharded_instance(path: str | Path, mesh, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A whole-model canonical checkpoint as one tp rank's WanModelInstance: each DiT expert read as this rank's
    slices (parallelize.py `read_sharded_state`), UMT5 and the VAE whole (they replicate)."""
    from manifests.checkpoint import load_state, read_checkpoint

    ckpt = read_checkpoint(path, family="wan")
    cfg = ckpt.typed_config()
    tp = mesh.axis("tp")
    dits = {TRANSFORMER: cfg.dit, TRANSFORMER_2: cfg.dit_2}
    weights = {name: read_sharded_state(ckpt, name, dits[name], tp) if name in dits else
               load_state(ckpt, component=name, check_finite=True) for name in component_names(cfg)}
    return WanModelInstance(cfg, weights, device, dtype, ckpt.weights_version, tp=tp)
