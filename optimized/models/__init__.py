"""Per-family fast implementations: `optimized.models.<family>` = spec + packing + fast model."""
