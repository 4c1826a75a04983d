"""The whole cosmos3 model a model directory holds (`fvconvert cosmos3 --from diffusers <pipeline root>`): the omni
transformer, the Wan2.2-geometry VAE (diffusers `AutoencoderKLWan`, stored with the wan VAE layout), the optional
sound tokenizer (AVAE) and the pipeline's UniPC scheduler settings. The engine's resident instance is the
transformer (`Cosmos3Config`); the VAE and sound decoder make its media chain."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from manifests.cosmos3.config import Cosmos3Config
from manifests.cosmos3.sound import Cosmos3SoundConfig
from manifests.errors import ManifestError
from manifests.solvers import UniPCConfig
from manifests.wan.config import WanVAEConfig

_KEYS = ("transformer", "vae", "sound", "scheduler")


@dataclass(frozen=True)
class Cosmos3ModelConfig:
    transformer: Cosmos3Config
    vae: WanVAEConfig
    sound: Cosmos3SoundConfig | None = None
    scheduler: UniPCConfig = field(default_factory=UniPCConfig)

    def validate(self) -> "Cosmos3ModelConfig":
        self.transformer.validate()
        self.vae.validate()
        self.scheduler.validate()
        if self.vae.z_dim != self.transformer.latent_channels:
            raise ManifestError(f"cosmos3 model: the VAE's z_dim ({self.vae.z_dim}) must equal the transformer's "
                                f"latent_channels ({self.transformer.latent_channels})")
        if self.sound is not None:
            self.sound.validate()
            if self.transformer.sound_dim is None:
                raise ManifestError("cosmos3 model: a sound tokenizer, but the transformer has no sound_dim")
            if self.sound.latent_dim != self.transformer.sound_dim:
                raise ManifestError(f"cosmos3 model: the sound tokenizer's latent_dim ({self.sound.latent_dim}) must "
                                    f"equal the transformer's sound_dim ({self.transformer.sound_dim})")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"transformer": self.transformer.to_dict(), "vae": self.vae.to_dict(),
                "sound": None if self.sound is None else self.sound.to_dict(),
                "scheduler": dataclasses.asdict(self.scheduler)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cosmos3ModelConfig":
        if not isinstance(d, dict):
            raise ManifestError("cosmos3 model config: expected a JSON object")
        unknown = sorted(set(d) - set(_KEYS))
        missing = [k for k in ("transformer", "vae") if k not in d]
        if unknown or missing:
            raise ManifestError(f"cosmos3 model config: unknown keys {unknown}, missing keys {missing}")
        sched = d.get("scheduler") or {}
        try:
            scheduler = UniPCConfig(**sched)
        except TypeError as e:
            raise ManifestError(f"cosmos3 model config: scheduler: {e}") from None
        return cls(transformer=Cosmos3Config.from_dict(d["transformer"]),
                   vae=WanVAEConfig.from_dict({k: v for k, v in d["vae"].items() if k != "description"}),
                   sound=None if d.get("sound") is None else Cosmos3SoundConfig.from_dict(d["sound"]),
                   scheduler=scheduler).validate()


def unipc_from_scheduler_config(c: dict[str, Any], use_native_flow_schedule: bool = False) -> UniPCConfig:
    """A diffusers `UniPCMultistepScheduler` scheduler_config.json (flow form; missing keys take diffusers'
    defaults) -> UniPCConfig. `use_native_flow_schedule` is the pipeline's option (its model_index.json)."""
    if c.get("_class_name", "UniPCMultistepScheduler") != "UniPCMultistepScheduler":
        raise ManifestError(f"cosmos3 scheduler: {c.get('_class_name')!r} is not the UniPCMultistepScheduler "
                            f"Cosmos3OmniPipeline uses")
    f = UniPCConfig(flow_shift=1.0)   # diffusers' UniPCMultistepScheduler defaults
    karras = bool(c.get("use_karras_sigmas", f.use_karras_sigmas))
    return UniPCConfig(num_train_timesteps=int(c.get("num_train_timesteps", f.num_train_timesteps)),
                       solver_order=int(c.get("solver_order", f.solver_order)),
                       solver_type=c.get("solver_type", f.solver_type),
                       lower_order_final=bool(c.get("lower_order_final", f.lower_order_final)),
                       flow_shift=float(c.get("flow_shift", f.flow_shift)), use_karras_sigmas=karras,
                       sigma_min=c.get("sigma_min") if karras else None,
                       sigma_max=c.get("sigma_max") if karras else None,
                       use_native_flow_schedule=bool(use_native_flow_schedule)).validate()


__all__ = ["Cosmos3ModelConfig", "unipc_from_scheduler_config"]
