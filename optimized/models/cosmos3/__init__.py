"""cosmos3 on the v2 runtime: spec (model plane + load transforms), packing, and the fast batched model."""

from optimized.models.cosmos3 import ops, packing
from optimized.models.cosmos3.model import Cosmos3Fast, Cosmos3FastStats, UndKV, load_fast, run_layer
from optimized.models.cosmos3.packing import PackedLayout, pack_layout, timestep_embedding_rows
from optimized.models.cosmos3.spec import cosmos3_model_spec, transformer_component

__all__ = ["Cosmos3Fast", "Cosmos3FastStats", "PackedLayout", "UndKV", "cosmos3_model_spec", "load_fast", "ops",
           "pack_layout", "packing", "run_layer", "timestep_embedding_rows", "transformer_component"]
