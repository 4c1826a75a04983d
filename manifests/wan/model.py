"""A whole Wan model (what one pipeline root holds): DiT expert(s), UMT5 text encoder, VAE, scheduler defaults.

Named variants live in `manifests/wan/models/*.json` (tiny CPU variants and every released size, shapes only).
A variant's `vae` is a VAE variant name from `manifests/wan/variants/` or an inline VAE config object.

    t2v    WanPipeline: text -> video (2.1 T2V 1.3B / 14B, 2.2 T2V A14B)
    i2v    WanImageToVideoPipeline: [noisy latents, 4-channel first-frame mask, condition latents] -> DiT
           (2.1 I2V 14B also feeds CLIP image embeddings through the DiT's image branch; 2.2 I2V A14B does not)
2.1 I2V's `image_encoder` (a CLIP vision tower, manifests/wan/clip.py) and its `image_processor` are optional
(a model without them takes `image_embeds` in each request); a variant names them ("tiny", "wan2.1") or inlines
them. Both are omitted from `to_dict` when absent, so configs (and hashes) of models without them are unchanged.
    ti2v   Wan2.2 TI2V 5B: per-token timesteps (`expand_timesteps`); the image, if any, replaces latent frame 0
Two experts (2.2 A14B): `dit` runs while t >= boundary_ratio * num_train_timesteps, `dit_2` after (upstream).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manifests.errors import ManifestError
from manifests.serialise import read_json_object
from manifests.wan.clip import CLIP_VARIANTS, PROCESSOR_VARIANTS, CLIPImageProcessorConfig, CLIPVisionConfig
from manifests.wan.config import WanVAEConfig, load_variant as load_vae_variant
from manifests.wan.dit import UMT5Config, WanDiTConfig

MODELS_DIR = Path(__file__).parent / "models"
TASKS = ("t2v", "i2v", "ti2v")
SOLVERS = ("unipc", "euler")


@dataclass(frozen=True)
class WanModelConfig:
    task: str
    dit: WanDiTConfig
    text_encoder: UMT5Config
    vae: WanVAEConfig
    dit_2: WanDiTConfig | None = None               # 2.2 A14B low-noise expert (`transformer_2`)
    boundary_ratio: float | None = None
    expand_timesteps: bool = False                  # 2.2 TI2V: per-token timesteps from a first-frame mask
    max_sequence_length: int = 512                  # text padded to this many tokens (I2V needs exactly 512)
    num_train_timesteps: int = 1000
    flow_shift: float = 3.0                         # 3.0 for 480p, 5.0 for 720p (pipeline docstring)
    solver: str = "unipc"                           # default scheduler of the release
    image_encoder: CLIPVisionConfig | None = None   # 2.1 I2V: the CLIP vision tower feeding the image branch
    image_processor: CLIPImageProcessorConfig | None = None   # ... and its CLIPImageProcessor (with it or neither)

    @property
    def has_image_encoder(self) -> bool:
        return self.image_encoder is not None

    @property
    def two_experts(self) -> bool:
        return self.dit_2 is not None

    @property
    def latent_channels(self) -> int:
        return self.vae.z_dim

    def validate(self) -> "WanModelConfig":
        def need(c: bool, msg: str) -> None:
            if not c:
                raise ManifestError(f"wan model config: {msg}")

        need(self.task in TASKS, f"task must be one of {TASKS}, got {self.task!r}")
        need(self.solver in SOLVERS, f"solver must be one of {SOLVERS}, got {self.solver!r}")
        self.dit.validate(), self.text_encoder.validate(), self.vae.validate()
        need((self.dit_2 is None) == (self.boundary_ratio is None),
             "dit_2 and boundary_ratio come together (two experts) or not at all")
        need(self.boundary_ratio is None or 0.0 < self.boundary_ratio < 1.0,
             f"boundary_ratio must be in (0, 1), got {self.boundary_ratio}")
        if self.dit_2 is not None:
            self.dit_2.validate()
            need(self.dit_2.in_channels == self.dit.in_channels and self.dit_2.out_channels == self.dit.out_channels,
                 "both experts take and give the same channels")
        z = self.vae.z_dim
        need(self.dit.out_channels == z, f"DiT out_channels {self.dit.out_channels} != VAE z_dim {z}")
        want_in = 2 * z + 4 if self.task == "i2v" else z
        need(self.dit.in_channels == want_in,
             f"{self.task}: DiT in_channels must be {want_in} (VAE z_dim {z}"
             f"{' x 2 + 4 mask channels' if self.task == 'i2v' else ''}), got {self.dit.in_channels}")
        need(self.dit.text_dim == self.text_encoder.d_model,
             f"DiT text_dim {self.dit.text_dim} != UMT5 d_model {self.text_encoder.d_model}")
        need(not self.dit.has_image_branch or self.task == "i2v", "a DiT image branch needs task i2v")
        need(not self.dit.has_image_branch or self.max_sequence_length == 512,
             "the I2V image branch splits the context at L - 512 (upstream): max_sequence_length must be 512")
        need(self.expand_timesteps == (self.task == "ti2v"), "expand_timesteps is the ti2v task and only it")
        need(isinstance(self.max_sequence_length, int) and self.max_sequence_length > 0,
             "max_sequence_length must be a positive int")
        need(isinstance(self.flow_shift, (int, float)) and self.flow_shift > 0, "flow_shift must be > 0")
        need(isinstance(self.num_train_timesteps, int) and self.num_train_timesteps > 1,
             "num_train_timesteps must be an int > 1")
        need((self.image_encoder is None) == (self.image_processor is None),
             "image_encoder and image_processor come together or not at all")
        if self.image_encoder is not None:
            enc, proc = self.image_encoder.validate(), self.image_processor.validate()
            need(self.dit.has_image_branch, "an image_encoder needs a DiT with an image branch (image_dim)")
            need(enc.hidden_size == self.dit.image_dim,
                 f"image_encoder hidden_size {enc.hidden_size} != DiT image_dim {self.dit.image_dim}")
            need((proc.crop_height, proc.crop_width) == (enc.image_size, enc.image_size),
                 f"image_processor crop {proc.crop_height}x{proc.crop_width} != image_encoder image_size "
                 f"{enc.image_size}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "dit": self.dit.to_dict(), "text_encoder": self.text_encoder.to_dict(),
                "vae": self.vae.to_dict(), "dit_2": self.dit_2.to_dict() if self.dit_2 else None,
                "boundary_ratio": self.boundary_ratio, "expand_timesteps": self.expand_timesteps,
                "max_sequence_length": self.max_sequence_length, "num_train_timesteps": self.num_train_timesteps,
                "flow_shift": self.flow_shift, "solver": self.solver,
                **({"image_encoder": self.image_encoder.to_dict(), "image_processor": self.image_processor.to_dict()}
                   if self.image_encoder is not None else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WanModelConfig":
        if not isinstance(d, dict):
            raise ManifestError("wan model config: expected a JSON object")
        d = dict(d)
        d.pop("description", None)
        known = {"task", "dit", "text_encoder", "vae", "dit_2", "boundary_ratio", "expand_timesteps",
                 "max_sequence_length", "num_train_timesteps", "flow_shift", "solver", "image_encoder",
                 "image_processor"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ManifestError(f"wan model config: unknown keys {unknown}")
        missing = sorted({"task", "dit", "text_encoder", "vae"} - set(d))
        if missing:
            raise ManifestError(f"wan model config: missing keys {missing}")
        vae = d["vae"]
        d["vae"] = load_vae_variant(vae) if isinstance(vae, str) else WanVAEConfig.from_dict(vae)
        d["dit"] = WanDiTConfig.from_dict(d["dit"])
        d["dit_2"] = WanDiTConfig.from_dict(d["dit_2"]) if d.get("dit_2") is not None else None
        d["text_encoder"] = UMT5Config.from_dict(d["text_encoder"])
        d["image_encoder"] = _named(d.get("image_encoder"), CLIP_VARIANTS, CLIPVisionConfig, "image_encoder")
        d["image_processor"] = _named(d.get("image_processor"), PROCESSOR_VARIANTS, CLIPImageProcessorConfig,
                                      "image_processor")
        return cls(**d).validate()


def _named(value: Any, named: dict, cls: type, what: str) -> Any:
    """None, a named config ("tiny", "wan2.1"), or an inline config object."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in named:
            raise ManifestError(f"wan model config: unknown {what} {value!r}; known: {', '.join(sorted(named))}")
        return named[value]
    return cls.from_dict(value)


def list_model_variants() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def load_model_variant(name: str) -> WanModelConfig:
    path = MODELS_DIR / f"{name}.json"
    if not path.is_file():
        raise ManifestError(f"wan: unknown model variant {name!r}; known: {', '.join(list_model_variants())}")
    return WanModelConfig.from_dict(read_json_object(path, "wan model variant file"))
