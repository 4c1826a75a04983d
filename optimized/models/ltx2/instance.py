"""One resident LTX-2 model: the DiT, the text connectors, the Gemma 3 text path, the video VAE, the audio VAE and
the vocoder (manifests/ltx2/model.py Ltx2ModelConfig), loaded once and shared by every loop.

`weights` maps a component name to its canonical state dict (manifests/ltx2/layout.py): transformer, connectors,
text_encoder, vae, audio_vae, vocoder. The media components (VAEs, vocoder) run in fp32 unless asked otherwise.
"""

from __future__ import annotations

import hashlib
import json

import torch

from manifests.ltx2.audio_vae import AUDIO_VAE_GAINS, audio_vae_key_shapes
from manifests.ltx2.connectors import connector_gains, connector_key_shapes
from manifests.ltx2.gemma3 import gemma3_key_shapes
from manifests.ltx2.keys import GAINS, key_shapes
from manifests.ltx2.model import COMPONENTS, Ltx2ModelConfig
from manifests.ltx2.video_vae import VIDEO_VAE_GAINS, video_vae_key_shapes
from manifests.ltx2.vocoder import vocoder_key_shapes
from optimized.models.ltx2.audio_vae import load_audio_vae
from optimized.models.ltx2.connectors import load_connectors
from optimized.models.ltx2.gemma3 import FastGemma3Text
from optimized.models.ltx2.model import load_model
from optimized.models.ltx2.video_vae import load_video_vae
from optimized.models.ltx2.vocoder import load_vocoder
from optimized.runtime.cache import CacheKey, CacheStore, content_hash
from optimized.runtime.family import seeded_random_state

TEXT_CONTRACT_VERSION = "ltx2.gemma3_hidden_states/1"


def component_key_shapes(cfg: Ltx2ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    return {"transformer": key_shapes(cfg.transformer), "connectors": connector_key_shapes(cfg.connectors),
            "text_encoder": gemma3_key_shapes(cfg.text_encoder), "vae": video_vae_key_shapes(cfg.vae),
            "audio_vae": audio_vae_key_shapes(cfg.audio_vae), "vocoder": vocoder_key_shapes(cfg.vocoder)}


def _gains(cfg: Ltx2ModelConfig) -> dict[str, tuple[str, ...]]:
    return {"transformer": GAINS, "connectors": connector_gains(cfg.connectors) or ("<none>",),
            "text_encoder": ("<none>",), "vae": VIDEO_VAE_GAINS, "audio_vae": AUDIO_VAE_GAINS,
            "vocoder": ("<none>",)}


def random_weights(cfg: Ltx2ModelConfig, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Seeded N(0, 0.02) weights per component (component i drawn from seed + i), gains near 1."""
    shapes, gains = component_key_shapes(cfg), _gains(cfg)
    return {name: seeded_random_state(shapes[name], seed + i, ones=gains[name]) for i, name in enumerate(COMPONENTS)}


class Ltx2ModelInstance:
    def __init__(self, cfg: Ltx2ModelConfig, weights: dict[str, dict[str, torch.Tensor]], device: str = "cpu",
                 dtype: torch.dtype = torch.float32, weights_version: str | None = None,
                 media_dtype: torch.dtype = torch.float32, text_cache_bytes: int = 256 << 20):
        self.cfg = cfg.validate()
        missing, unknown = sorted(set(COMPONENTS) - set(weights)), sorted(set(weights) - set(COMPONENTS))
        if missing or unknown:
            raise ValueError(f"ltx2 model: components must be exactly {list(COMPONENTS)}; missing {missing}, "
                             f"unexpected {unknown}")
        self.device, self.dtype, self.media_dtype = torch.device(device), dtype, media_dtype
        self.weights_version = weights_version
        self.transformer = load_model(cfg.transformer, weights["transformer"], device, dtype)
        self.connectors = load_connectors(cfg.connectors, weights["connectors"], device, dtype)
        self.text_encoder = FastGemma3Text(cfg.text_encoder, {k: v.to(device) for k, v in
                                                              weights["text_encoder"].items()}, dtype)
        self.vae = load_video_vae(cfg.vae, weights["vae"], device, media_dtype)
        self.audio_vae = load_audio_vae(cfg.audio_vae, weights["audio_vae"], device, media_dtype)
        self.vocoder = load_vocoder(cfg.vocoder, weights["vocoder"], device, media_dtype)
        self.media = cfg.media()
        self.text_cache = CacheStore(text_cache_bytes, name="ltx2.text_hidden_states")
        self._text_cfg_hash = hashlib.sha256(json.dumps(cfg.to_dict()["text_encoder"], sort_keys=True)
                                             .encode()).hexdigest()[:16]

    def stats(self) -> dict[str, torch.Tensor]:
        """The loop's de-normalisation: video latents_mean / (latents_std / scaling_factor), audio mean / std."""
        v, a = self.vae.p, self.audio_vae.p
        return {"video_mean": v["latents_mean"].float(),
                "video_std": v["latents_std"].float() / self.cfg.vae.scaling_factor,
                "audio_mean": a["latents_mean"].float(), "audio_std": a["latents_std"].float()}

    def text_cache_key(self, ids: torch.Tensor, pad_id: int) -> CacheKey:
        """Everything that changes one prompt's Gemma hidden states: weights, precision, device, config, the ids,
        the pad id and length they are padded with."""
        return CacheKey(model_id="ltx2", component_id="text_encoder",
                        weights_version=self.weights_version or f"unversioned:{id(self)}",
                        precision=str(self.dtype).removeprefix("torch."),
                        shape_signature=f"len={ids.numel()};pad_to={self.cfg.max_sequence_length}",
                        layout_signature=f"cfg={self._text_cfg_hash};device={self.device};pad_id={pad_id}",
                        cache_contract_version=TEXT_CONTRACT_VERSION,
                        input_hashes={"text_ids": content_hash(ids.reshape(-1).to(torch.int64).cpu())})

    def encode_text(self, ids: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts' ids -> (Gemma hidden states [B, L, C * K], masks [B, L]), each left-padded with `pad_id` to
        max_sequence_length (upstream's tokenizer call: padding="max_length", padding_side="left"). One forward per
        prompt (rows are independent), each cached by content (`text_cache`): a hit is bitwise a miss."""
        L = self.cfg.max_sequence_length
        hidden, masks = [], []
        for t in ids:
            t = t.reshape(-1).to(torch.int64)
            mask = torch.zeros((1, L), dtype=torch.int64)
            mask[0, L - t.numel():] = 1
            key = self.text_cache_key(t, pad_id)
            h = self.text_cache.get(key)
            if h is None:
                row = torch.full((1, L), pad_id, dtype=torch.int64)
                row[0, L - t.numel():] = t
                with torch.no_grad():
                    h = self.text_encoder(row.to(self.device), mask.to(self.device)).flatten(2, 3)
                self.text_cache.put(key, h)
            hidden.append(h)
            masks.append(mask)
        return torch.cat(hidden), torch.cat(masks).to(self.device)

    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """De-normalised latents [B, C, F, H, W] -> frames [B, 3, F', H', W'] (the decode timestep is upstream's
        default 0.0: with decode_noise_scale = decode_timestep the latents are unchanged)."""
        t = torch.zeros(latents.shape[0], device=latents.device) if self.cfg.vae.timestep_conditioning else None
        with torch.no_grad():
            return self.vae.decode(latents.to(self.media_dtype), t)

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """De-normalised audio latents [B, C, L, M] -> waveform [B, channels, N] (audio VAE -> mel -> vocoder)."""
        with torch.no_grad():
            mel = self.audio_vae.decode(latents.to(self.media_dtype))
            return self.vocoder(mel)


__all__ = ["Ltx2ModelInstance", "component_key_shapes", "random_weights"]
