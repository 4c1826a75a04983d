"""Wan 2.1 I2V's image encoder: a CLIP vision tower (transformers `CLIPVisionModel`) and its image processor
(transformers `CLIPImageProcessor`, PIL backend), as configs and canonical keys.

WanImageToVideoPipeline (diffusers 0.42.1) feeds the DiT's image branch `image_encoder(**image_processor(image),
output_hidden_states=True).hidden_states[-2]`: the output of the PENULTIMATE encoder layer, before any final norm,
every token (class token first), [1, 1 + (image_size / patch_size) ** 2, hidden_size] (257 x 1280 for Wan 2.1).

Canonical keys are transformers' `CLIPVisionModel` state-dict names (5.x: no `vision_model.` prefix; checkpoints
saved by 4.x carry it and convert by a prefix rename):
    embeddings.class_embedding [D], embeddings.patch_embedding.weight [D, C, p, p] (no bias),
    embeddings.position_embedding.weight [1 + (S / p)^2, D], pre_layrnorm.{weight,bias} (upstream's spelling),
    encoder.layers.{i}.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}.{weight,bias},
    post_layernorm.{weight,bias} (the pooled output's norm: stored, never used by the pipeline)
"""

from __future__ import annotations

from dataclasses import dataclass

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict

Shapes = dict[str, tuple[int, ...]]
CLIP_ACTIVATIONS = ("gelu", "quick_gelu")   # transformers ACT2FN names: exact erf GELU (Wan), x * sigmoid(1.702 x)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ManifestError(f"CLIP vision config: {msg}")


@dataclass(frozen=True)
class CLIPVisionConfig:
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_layers: int = 32
    num_heads: int = 16
    image_size: int = 224
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_tokens(self) -> int:
        return 1 + (self.image_size // self.patch_size) ** 2

    def validate(self) -> "CLIPVisionConfig":
        for n in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "image_size", "patch_size",
                  "num_channels"):
            v = getattr(self, n)
            _need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{n} must be a positive int, got {v!r}")
        _need(self.num_layers >= 2, "num_layers must be >= 2 (the pipeline reads the penultimate layer)")
        _need(self.hidden_size % self.num_heads == 0, "hidden_size must be divisible by num_heads")
        _need(self.image_size % self.patch_size == 0, "image_size must be a multiple of patch_size")
        _need(self.hidden_act in CLIP_ACTIVATIONS, f"hidden_act must be one of {CLIP_ACTIVATIONS}, got "
                                                   f"{self.hidden_act!r}")
        _need(isinstance(self.layer_norm_eps, float) and self.layer_norm_eps > 0, "layer_norm_eps must be > 0")
        return self

    def to_dict(self) -> dict:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CLIPVisionConfig":
        return config_from_dict(cls, d, "CLIP vision")

    @classmethod
    def from_transformers_config(cls, c: dict) -> "CLIPVisionConfig":
        """From a transformers CLIPVisionConfig (or a CLIPConfig's `vision_config`) dict."""
        c = c.get("vision_config", c)
        try:
            return cls(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                       num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
                       image_size=c["image_size"], patch_size=c["patch_size"], num_channels=c.get("num_channels", 3),
                       layer_norm_eps=float(c.get("layer_norm_eps", 1e-5)),
                       hidden_act=c.get("hidden_act", "quick_gelu")).validate()   # transformers' default act
        except KeyError as e:
            raise ManifestError(f"CLIP vision config: the transformers config lacks {e}") from None

    def to_transformers_config(self) -> dict:
        return {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "image_size": self.image_size, "patch_size": self.patch_size, "num_channels": self.num_channels,
                "layer_norm_eps": self.layer_norm_eps, "hidden_act": self.hidden_act}


def clip_vision_key_shapes(cfg: CLIPVisionConfig) -> Shapes:
    D, F = cfg.hidden_size, cfg.intermediate_size
    s: Shapes = {"embeddings.class_embedding": (D,),
                 "embeddings.patch_embedding.weight": (D, cfg.num_channels, cfg.patch_size, cfg.patch_size),
                 "embeddings.position_embedding.weight": (cfg.num_tokens, D),
                 "pre_layrnorm.weight": (D,), "pre_layrnorm.bias": (D,)}
    for i in range(cfg.num_layers):
        p = f"encoder.layers.{i}"
        for n in ("layer_norm1", "layer_norm2"):
            s[f"{p}.{n}.weight"], s[f"{p}.{n}.bias"] = (D,), (D,)
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s[f"{p}.self_attn.{n}.weight"], s[f"{p}.self_attn.{n}.bias"] = (D, D), (D,)
        s[f"{p}.mlp.fc1.weight"], s[f"{p}.mlp.fc1.bias"] = (F, D), (F,)
        s[f"{p}.mlp.fc2.weight"], s[f"{p}.mlp.fc2.bias"] = (D, F), (D,)
    s["post_layernorm.weight"], s["post_layernorm.bias"] = (D,), (D,)
    return s


@dataclass(frozen=True)
class CLIPImageProcessorConfig:
    """transformers CLIPImageProcessor (PIL backend): RGB, resize the shortest edge to `shortest_edge` (PIL bicubic,
    the long edge int(shortest_edge * long / short)), centre crop (offsets floor((size - crop) / 2)), x / 255 in
    float64 then float32, (x - mean) / std in float32; channels first."""
    shortest_edge: int = 224
    crop_height: int = 224
    crop_width: int = 224
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = 3          # PIL.Image.BICUBIC

    def validate(self) -> "CLIPImageProcessorConfig":
        for n in ("shortest_edge", "crop_height", "crop_width"):
            v = getattr(self, n)
            if not (isinstance(v, int) and v > 0):
                raise ManifestError(f"CLIP image processor: {n} must be a positive int, got {v!r}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ManifestError("CLIP image processor: image_mean / image_std need 3 values (std > 0)")
        if self.resample != 3:
            raise ManifestError(f"CLIP image processor: only bicubic resampling (3) is implemented, got "
                                f"{self.resample}")
        return self

    def to_dict(self) -> dict:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CLIPImageProcessorConfig":
        return config_from_dict(cls, d, "CLIP image processor")

    @classmethod
    def from_preprocessor_config(cls, c: dict) -> "CLIPImageProcessorConfig":
        """From a `preprocessor_config.json` (transformers CLIPImageProcessor); refuses flags this does not do."""
        for flag in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb"):
            if c.get(flag, True) is not True:
                raise ManifestError(f"CLIP image processor: {flag}=false is not supported")
        if abs(float(c.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-12:
            raise ManifestError("CLIP image processor: rescale_factor must be 1/255")
        size, crop = c.get("size", {"shortest_edge": 224}), c.get("crop_size", {"height": 224, "width": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if "shortest_edge" not in size:
            raise ManifestError(f"CLIP image processor: size {size} is not a shortest-edge resize")
        return cls(shortest_edge=size["shortest_edge"], crop_height=crop["height"], crop_width=crop["width"],
                   image_mean=tuple(c.get("image_mean", OPENAI_CLIP_MEAN)),
                   image_std=tuple(c.get("image_std", OPENAI_CLIP_STD)),
                   resample=int(c.get("resample", 3))).validate()


# named image-encoder configs: `wan2.1` is Wan 2.1 I2V's (open-clip ViT-H/14 as transformers CLIPVisionModel);
# `tiny` matches the tiny I2V DiT's image branch (image_dim 8) for CPU tests
CLIP_VARIANTS = {
    "wan2.1": CLIPVisionConfig(),
    "tiny": CLIPVisionConfig(hidden_size=8, intermediate_size=16, num_layers=3, num_heads=2, image_size=28,
                             patch_size=7),
}
PROCESSOR_VARIANTS = {
    "wan2.1": CLIPImageProcessorConfig(),
    "tiny": CLIPImageProcessorConfig(shortest_edge=28, crop_height=28, crop_width=28),
}


def clip_variant_for(image_dim: int) -> str:
    """The named image encoder whose width feeds a DiT image branch of `image_dim` (one clear error if none)."""
    names = [n for n, c in CLIP_VARIANTS.items() if c.hidden_size == image_dim]
    if len(names) != 1:
        raise ManifestError(f"no single CLIP image encoder variant has hidden_size {image_dim} (known: "
                            f"{ {n: c.hidden_size for n, c in CLIP_VARIANTS.items()} })")
    return names[0]


__all__ = ["CLIPImageProcessorConfig", "CLIPVisionConfig", "CLIP_VARIANTS", "PROCESSOR_VARIANTS", "clip_variant_for",
           "clip_vision_key_shapes"]
