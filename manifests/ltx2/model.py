"""ltx2 whole model: what one canonical model directory (`fvconvert ltx2 --from diffusers <LTX2Pipeline root> OUT`)
holds, as one typed config both sides load from: the DiT, the text connectors, the Gemma 3 text encoder, the video
VAE, the audio VAE, the vocoder, LTX's FlowMatch scheduler, and the prompt length the pipeline pads to.

The components must fit together the way LTX2Pipeline plugs them (checked by `validate`, one message naming both
sides): Gemma's hidden size and layer count are the connectors' caption_channels / text_proj_in_factor; the
connectors' outputs are the DiT's caption_channels (LTX-2.0, caption projection); the video VAE's latent channels are
the DiT's in_channels; the audio VAE's latent channels x latent mel bins are the DiT's audio_in_channels (and the width
of its latent statistics); the vocoder reads the audio VAE's output channels x mel bins.

`media()` gives the VAE facts the loop needs (manifests/ltx2/sampling.py Ltx2Media) from the VAE configs, with
upstream's compression attributes (`vae.spatial_compression_ratio` as the pipeline reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from manifests.errors import ManifestError
from manifests.ltx2.audio_vae import (
    LATENT_DOWNSAMPLE_FACTOR,
    Ltx2AudioVaeConfig,
    load_audio_vae_variant,
)
from manifests.ltx2.config import Ltx2Config, load_variant
from manifests.ltx2.connectors import Ltx2ConnectorsConfig, load_connectors_variant
from manifests.ltx2.gemma3 import TINY as TINY_GEMMA
from manifests.ltx2.gemma3 import Gemma3TextSpec
from manifests.ltx2.sampling import Ltx2Media, Ltx2SchedulerConfig
from manifests.ltx2.video_vae import Ltx2VideoVaeConfig, load_video_vae_variant
from manifests.ltx2.vocoder import Ltx2VocoderConfig, load_vocoder_variant
from manifests.serialise import config_from_dict, config_to_dict

COMPONENTS = ("transformer", "connectors", "text_encoder", "vae", "audio_vae", "vocoder")


def gemma_to_dict(c: Gemma3TextSpec) -> dict[str, Any]:
    return config_to_dict(c)


def gemma_from_dict(d: dict[str, Any]) -> Gemma3TextSpec:
    """The canonical text_encoder config.json (Gemma3TextSpec fields), or a transformers Gemma 3 config (it has a
    model_type / architectures)."""
    if "model_type" in d or "architectures" in d or "text_config" in d:
        if d.get("model_type") not in (None, "gemma3", "gemma3_text"):
            raise ManifestError(f"ltx2 text encoder: model_type {d.get('model_type')!r} is not gemma3")
        return Gemma3TextSpec.from_transformers_config(d)
    return config_from_dict(Gemma3TextSpec, d, "ltx2 text encoder (gemma3)")


def video_vae_ratios(c: Ltx2VideoVaeConfig) -> tuple[int, int]:
    """(spatial, temporal) compression as upstream's attributes give them: the config's values when set, else
    patch_size * 2 ** (scaled blocks) and 2 ** (scaled blocks) (every scaled block counted as both: upstream)."""
    n = sum(c.spatio_temporal_scaling)
    return (c.spatial_compression_ratio or c.patch_size * 2 ** n, c.temporal_compression_ratio or 2 ** n)


@dataclass(frozen=True)
class Ltx2ModelConfig:
    transformer: Ltx2Config
    connectors: Ltx2ConnectorsConfig
    text_encoder: Gemma3TextSpec
    vae: Ltx2VideoVaeConfig
    audio_vae: Ltx2AudioVaeConfig
    vocoder: Ltx2VocoderConfig
    scheduler: Ltx2SchedulerConfig = field(default_factory=Ltx2SchedulerConfig)
    max_sequence_length: int = 1024           # the tokenizer pads every prompt (left) to this length (upstream)

    @property
    def vocab_size(self) -> int:
        return self.text_encoder.vocab_size

    def media(self) -> Ltx2Media:
        s, t = video_vae_ratios(self.vae)
        a = self.audio_vae
        return Ltx2Media(spatial_compression=s, temporal_compression=t, latent_channels=self.transformer.in_channels,
                         audio_latent_channels=a.latent_channels, mel_bins=a.mel_bins or 64,
                         mel_compression=LATENT_DOWNSAMPLE_FACTOR, audio_temporal_compression=LATENT_DOWNSAMPLE_FACTOR,
                         sample_rate=a.sample_rate, hop_length=a.mel_hop_length)

    @property
    def sample_rate(self) -> int:
        """The waveform's rate (the vocoder's output_sampling_rate)."""
        return self.vocoder.output_sampling_rate

    def validate(self) -> Ltx2ModelConfig:
        t, c, g, v, a, w = (self.transformer.validate(), self.connectors.validate(), self.text_encoder.validate(),
                            self.vae.validate(), self.audio_vae.validate(), self.vocoder.validate())
        s = self.scheduler.validate()
        problems = []

        def need(ok: bool, what: str) -> None:
            if not ok:
                problems.append(what)

        need(g.hidden_size == c.caption_channels,
             f"text_encoder.hidden_size {g.hidden_size} != connectors.caption_channels {c.caption_channels}")
        need(g.num_hidden_layers + 1 == c.text_proj_in_factor,
             f"text_encoder.num_hidden_layers + 1 = {g.num_hidden_layers + 1} != connectors.text_proj_in_factor "
             f"{c.text_proj_in_factor}")
        if t.use_prompt_embeddings:
            for stream in ("video", "audio"):
                need(c.inner_dim(stream) == t.caption_channels,
                     f"connectors {stream} width {c.inner_dim(stream)} != transformer.caption_channels "
                     f"{t.caption_channels}")
        need(v.latent_channels == t.in_channels,
             f"vae.latent_channels {v.latent_channels} != transformer.in_channels {t.in_channels}")
        mel = a.mel_bins or 64
        packed = a.latent_channels * (mel // LATENT_DOWNSAMPLE_FACTOR)
        need(packed == t.audio_in_channels, f"audio_vae.latent_channels x mel_bins / {LATENT_DOWNSAMPLE_FACTOR} = "
             f"{packed} != transformer.audio_in_channels {t.audio_in_channels}")
        need(a.base_channels == packed, f"audio_vae.base_channels {a.base_channels} (its latent statistics) != the "
             f"packed audio latent width {packed}")
        need(w.in_channels == a.output_channels * mel,
             f"vocoder.in_channels {w.in_channels} != audio_vae.output_channels x mel_bins {a.output_channels * mel}")
        spatial, temporal = video_vae_ratios(v)
        need((spatial, temporal) == (v.spatial_ratio, v.temporal_ratio),
             f"vae compression attributes {spatial} / {temporal} differ from its strides' {v.spatial_ratio} / "
             f"{v.temporal_ratio} (set spatial_compression_ratio / temporal_compression_ratio in its config)")
        need(isinstance(self.max_sequence_length, int) and self.max_sequence_length >= 1,
             f"max_sequence_length must be a positive int, got {self.max_sequence_length!r}")
        if problems:
            raise ManifestError("ltx2 model: the components do not fit together: " + "; ".join(problems))
        return replace(self, transformer=t, connectors=c, text_encoder=g, vae=v, audio_vae=a, vocoder=w, scheduler=s)

    def components(self) -> dict[str, Any]:
        return {"transformer": self.transformer, "connectors": self.connectors, "text_encoder": self.text_encoder,
                "vae": self.vae, "audio_vae": self.audio_vae, "vocoder": self.vocoder}

    def to_dict(self) -> dict[str, Any]:
        return {"transformer": self.transformer.to_dict(), "connectors": self.connectors.to_dict(),
                "text_encoder": gemma_to_dict(self.text_encoder), "vae": self.vae.to_dict(),
                "audio_vae": self.audio_vae.to_dict(), "vocoder": self.vocoder.to_dict(),
                "scheduler": config_to_dict(self.scheduler), "max_sequence_length": self.max_sequence_length}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ltx2ModelConfig:
        if not isinstance(d, dict):
            raise ManifestError("ltx2 model config: expected a JSON object")
        known = set(COMPONENTS) | {"scheduler", "max_sequence_length"}
        unknown, missing = sorted(set(d) - known), [k for k in COMPONENTS if k not in d]
        if unknown or missing:
            raise ManifestError(f"ltx2 model config: unknown keys {unknown}, missing keys {missing}")
        return cls(transformer=Ltx2Config.from_dict(d["transformer"]),
                   connectors=Ltx2ConnectorsConfig.from_dict(d["connectors"]),
                   text_encoder=gemma_from_dict(d["text_encoder"]), vae=Ltx2VideoVaeConfig.from_dict(d["vae"]),
                   audio_vae=Ltx2AudioVaeConfig.from_dict(d["audio_vae"]),
                   vocoder=Ltx2VocoderConfig.from_dict(d["vocoder"]),
                   scheduler=config_from_dict(Ltx2SchedulerConfig, d.get("scheduler", {}), "ltx2 scheduler"),
                   max_sequence_length=d.get("max_sequence_length", 1024)).validate()


def _tiny() -> Ltx2ModelConfig:
    """Every component's tiny variant (CPU, seconds): 64 x 64 x 9 frames <-> 8 x 3 x 8 x 8 video latents."""
    return Ltx2ModelConfig(transformer=load_variant("tiny"), connectors=load_connectors_variant("tiny"),
                           text_encoder=TINY_GEMMA, vae=load_video_vae_variant("tiny"),
                           audio_vae=load_audio_vae_variant("tiny"), vocoder=load_vocoder_variant("tiny"),
                           max_sequence_length=16)


MODEL_VARIANTS = {"tiny": _tiny}


def list_model_variants() -> list[str]:
    return sorted(MODEL_VARIANTS)


def load_model_variant(name: str) -> Ltx2ModelConfig:
    if name not in MODEL_VARIANTS:
        raise ManifestError(f"unknown ltx2 model variant {name!r}; variants: {', '.join(list_model_variants())}")
    return MODEL_VARIANTS[name]().validate()


__all__ = ["COMPONENTS", "Ltx2ModelConfig", "gemma_from_dict", "gemma_to_dict", "list_model_variants",
           "load_model_variant", "video_vae_ratios"]
