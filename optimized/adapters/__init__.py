"""LoRA adapters on the optimized side: per-row (unmerged) deltas in batched forwards, merged weights, and the
engine's adapter manager (`engine.loras`)."""

from optimized.adapters.manager import AdapterError, AdapterManager, merged_weights
from optimized.adapters.rows import PreparedLora, RowLora, row_lora

__all__ = ["AdapterError", "AdapterManager", "PreparedLora", "RowLora", "merged_weights", "row_lora"]
