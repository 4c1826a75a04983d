"""ltx2 reference: the readable single-device LTX-2 (the oracle): transformer (model.py), text connectors
(connectors.py), the LTX2Pipeline latents loop (pipeline.py), the video VAE (video_vae.py, by ltxmedia)."""

from reference.ltx2.model import Ltx2Model, load_model
from reference.ltx2.video_vae import Ltx2VideoVae, load_video_vae

__all__ = ["Ltx2Model", "Ltx2VideoVae", "load_model", "load_video_vae"]
