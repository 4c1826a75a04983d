"""Accelerations in the engine (model-agnostic: the runtime never names a family).

`rules`: the step / residual caches' decision rules, one instance per request and CFG branch; `residual`: the
residual store (a typed cache class over the engine's CacheStore); `stack`: one batched DiT step whose rows made
different decisions. Sparse attention lives in `sparse` (the sparse-attention work).
"""
