"""wan manifests: the Wan VAE (2.1 / 2.2) config + variants, the DiT and UMT5 configs, whole-model variants
(`models/*.json`), the generation request contract, canonical checkpoint key sets, parity contract."""

from manifests.wan.config import WanVAEConfig, list_variants, load_config_file, load_variant
from manifests.wan.dit import UMT5Config, WanDiTConfig, dit_key_shapes, umt5_key_shapes
from manifests.wan.keys import canonical_key_shapes, decoder_key_shapes, encoder_key_shapes
from manifests.wan.model import WanModelConfig, list_model_variants, load_model_variant
from manifests.wan.sampling import WanGenerateRequest

__all__ = ["UMT5Config", "WanDiTConfig", "WanGenerateRequest", "WanModelConfig", "WanVAEConfig",
           "canonical_key_shapes", "decoder_key_shapes", "dit_key_shapes", "encoder_key_shapes", "list_model_variants",
           "list_variants", "load_config_file", "load_model_variant", "load_variant", "umt5_key_shapes"]
