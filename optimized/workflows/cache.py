"""Workflow caching by node signature + ancestry (ComfyUI's idea), as typed `CacheKey`s.

A node's key holds its class, a hash of its own widget values (its signature) and, for every linked input, the
digest of the upstream node's key and the output slot (its ancestry); loaders carry the resolved model's weights
version and every key the engine's precision, so a key changes exactly when something upstream that can change the
value changes. Re-running a workflow with a new KSampler seed changes the KSampler's key and its descendants' only:
the CLIPTextEncode nodes hit, their token ids come from here and their embeddings from the engine's text-embedding
cache (keyed by those ids), so no text is tokenised or encoded again.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from optimized.runtime.cache import CacheKey, CacheStore
from optimized.workflows.graph import Workflow

CONTRACT_VERSION = "comfy-node-v1"
LOADERS = ("UNETLoader", "CLIPLoader", "VAELoader")


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:24]


def signature(class_type: str, values: dict) -> str:
    """A hash of a node's class and own widget values (JSON, keys sorted)."""
    return hashlib.sha256(json.dumps([class_type, values], sort_keys=True, default=repr).encode()).hexdigest()[:24]


def node_keys(wf: Workflow, weights_version: str, precision: str) -> dict[str, CacheKey]:
    """Every node's CacheKey (the workflow is validated: a DAG with no dangling links)."""
    keys: dict[str, CacheKey] = {}

    def key(nid: str) -> CacheKey:
        if nid in keys:
            return keys[nid]
        node = wf.nodes[nid]
        inputs = {"signature": signature(node.class_type, node.values)}
        for name, link in sorted(node.links.items()):
            inputs[f"in.{name}"] = f"{_digest(key(link.source))}:{link.slot}"
        seed = node.values.get("seed") if isinstance(node.values.get("seed"), int) else None
        keys[nid] = CacheKey(model_id="comfy-workflow", component_id=node.class_type,
                             weights_version=weights_version if node.class_type in LOADERS else "upstream",
                             precision=precision, shape_signature="node", layout_signature="comfy",
                             cache_contract_version=CONTRACT_VERSION, input_hashes=inputs, seed=seed)
        return keys[nid]

    for nid in sorted(wf.nodes):
        key(nid)
    return keys


class WorkflowCache:
    """Node outputs by CacheKey (a byte-bounded `CacheStore`), with the last run's hit / miss per node."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.store = CacheStore(max_bytes, name="workflow.nodes")

    def lookup(self, key: CacheKey) -> Any | None:
        return self.store.get(key)

    def remember(self, key: CacheKey, value: Any) -> None:
        self.store.put(key, value)


__all__ = ["CONTRACT_VERSION", "WorkflowCache", "node_keys", "signature"]
