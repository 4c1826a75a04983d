"""cosmos3 manifests: architecture config + variants, canonical checkpoint key set, parity contract."""

from manifests.cosmos3.config import Cosmos3Config, list_variants, load_config_file, load_variant
from manifests.cosmos3.keys import canonical_key_shapes

__all__ = ["Cosmos3Config", "canonical_key_shapes", "list_variants", "load_config_file", "load_variant"]
