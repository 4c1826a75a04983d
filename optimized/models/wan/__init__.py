"""wan on the v2 runtime: the VAE (2.1 / 2.2) as chunked encode/decode loops with typed conv-cache state."""

from optimized.models.wan.loop import (Cancelled, DecodeRequest, EncodeRequest, FastPosterior, MemoryLedger,
                                       ReservationError, VideoChunkEvent, WanVaeDecodeKernel, WanVaeEncodeKernel,
                                       chunk_bytes, run, run_batched, stream)
from optimized.models.wan.spec import DECODE_LOOP, ENCODE_LOOP, vae_component, wan_vae_model_spec
from optimized.models.wan.vae import ConvCache, FastWanVAE, load_fast_vae

__all__ = ["Cancelled", "ConvCache", "DECODE_LOOP", "DecodeRequest", "ENCODE_LOOP", "EncodeRequest", "FastPosterior",
           "FastWanVAE", "MemoryLedger", "ReservationError", "VideoChunkEvent", "WanVaeDecodeKernel",
           "WanVaeEncodeKernel", "chunk_bytes", "load_fast_vae", "run", "run_batched", "stream", "vae_component",
           "wan_vae_model_spec"]
