"""wan manifests: the Wan VAE (2.1 / 2.2) config + variants, canonical checkpoint key set, parity contract."""

from manifests.wan.config import WanVAEConfig, list_variants, load_config_file, load_variant
from manifests.wan.keys import canonical_key_shapes, decoder_key_shapes, encoder_key_shapes

__all__ = ["WanVAEConfig", "canonical_key_shapes", "decoder_key_shapes", "encoder_key_shapes", "list_variants",
           "load_config_file", "load_variant"]
