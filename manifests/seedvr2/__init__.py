"""seedvr2 manifests: NaDiT (3B dit_v2 / 7B dit) and VAE configs + variants, canonical key sets, parity contract."""

from manifests.seedvr2.config import (NaDiTConfig, VAEConfig, list_variants, load_vae_variant, load_variant,
                                      nadit_from_upstream_config, vae_from_upstream_config)
from manifests.seedvr2.keys import nadit_key_shapes, vae_key_shapes

__all__ = ["NaDiTConfig", "VAEConfig", "list_variants", "load_vae_variant", "load_variant", "nadit_from_upstream_config",
           "nadit_key_shapes", "vae_from_upstream_config", "vae_key_shapes"]
