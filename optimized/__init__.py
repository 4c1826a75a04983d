"""The FastVideo v2 runtime (model plane, caches, ...) and per-family fast models under `optimized.models`.

Never imports `reference/`: parity between two modules that share code proves nothing.
"""

from optimized.engine import Engine, RequestHandle, RequestRejected

__all__ = ["Engine", "RequestHandle", "RequestRejected"]
