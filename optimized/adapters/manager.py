"""An engine's LoRA adapters: hot load / unload, per-request use (unmerged) and merge / unmerge (fused weights).

    engine.loras.load("style", "style.safetensors")      # any format manifests/lora_files.py reads; checked
    engine.submit(replace(request, lora=(LoraRef("style", 0.8),)))   # per request: rows of one batch may differ
    engine.loras.merge("style", 1.0)                     # fused into the weights: a new weights version
    engine.loras.unmerge()                               # back to the base weights (and their version)

Per request: every fast component that applies row deltas (it has `lora_layers()`) gets `lora_bank = manager`; its
forward asks `rows(component, per_row_refs)` for the prepared pairs (cached by CacheKey with adapter_versions).
Merged: the base canonical weights (the engine's checkpoint, or the weights it was built from) plus
scale * alpha / r * B @ A per target, swapped in through `Engine.update_weights` (in-flight requests finish on the
version they started with; records, results and the deployment card report the new version).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from manifests.lora import LoraAdapter, LoraRef, check_name
from manifests.lora_files import load_adapter
from optimized.adapters import prepare as prep
from optimized.adapters.rows import PreparedLora, RowLora, row_lora
from optimized.runtime.cache import CacheStore, state_dict_hash

AdapterError = prep.AdapterError


@dataclass(frozen=True)
class MergedAdapter:
    name: str
    version: str
    scale: float


def merged_weights(base: dict[str, dict[str, torch.Tensor]], adapters: list[tuple[LoraAdapter, float]]
                   ) -> dict[str, dict[str, torch.Tensor]]:
    """Base canonical weights with each adapter fused in: W + scale * alpha / r * B @ A (fp32, cast back to W's
    dtype); untouched tensors are shared, never copied."""
    out = {comp: dict(state) for comp, state in base.items()}
    for adapter, scale in adapters:
        for comp, mods in adapter.targets.items():
            for mod, pair in mods.items():
                key = f"{mod}.weight"
                w = out[comp][key]
                delta = (pair.up.double() @ pair.down.double()) * (pair.factor * scale)
                out[comp][key] = (w.double() + delta).to(w.dtype)
    return out


class AdapterManager:
    def __init__(self, engine: Any, max_prepared_bytes: int = 1 << 30):
        self.engine = engine
        self.adapters: dict[str, LoraAdapter] = {}
        self.merged: list[MergedAdapter] = []
        self.base_version: str | None = None        # the weights version before the first merge
        self.prepared = CacheStore(max_prepared_bytes, name="lora.prepared")

    # ---- the fast components that take per-row deltas
    def components(self) -> list[Any]:
        model = self.engine.model
        return [c for c in vars(model).values() if callable(getattr(c, "lora_layers", None))]

    def attach(self) -> None:
        for comp in self.components():
            comp.lora_bank = self

    # ---- load / unload
    def load(self, name: str, source: str | Path | LoraAdapter, replace: bool = False) -> LoraAdapter:
        """Read and check an adapter against the resident model, prepare it for every component it targets, and
        serve it under `name`. AdapterError (or LoraFormatError) when it cannot be used; nothing changes then."""
        check_name(name)
        if name in self.adapters and not replace:
            raise AdapterError(f"LoRA {name!r} is already loaded (unload it first, or load with replace)")
        if any(m.name == name for m in self.merged):
            raise AdapterError(f"LoRA {name!r} is merged into the weights; unmerge before replacing it")
        family, cfg = self.engine.family.name, self.engine.model.cfg
        adapter = source.with_name(name) if isinstance(source, LoraAdapter) else load_adapter(source, family, cfg, name)
        if adapter.family != family:
            raise AdapterError(f"LoRA {name!r} is a {adapter.family} adapter; this engine serves {family}")
        by_id = {c.component_id: c for c in self.components()}
        missing = sorted(set(adapter.targets) - set(by_id))
        if missing:
            raise AdapterError(f"LoRA {name!r} targets {missing}, which this model has no fast component for")
        for comp_id in adapter.targets:   # fail now, not at the first request
            self._prepared(by_id[comp_id], adapter)
        if name in self.adapters:
            self._evict(self.adapters[name])
        self.adapters[name] = adapter
        self.attach()
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"no LoRA named {name!r} is loaded (loaded: {sorted(self.adapters)})")
        if any(m.name == name for m in self.merged):
            raise AdapterError(f"LoRA {name!r} is merged into the weights; unmerge it first")
        users = self.in_flight_users(name)
        if users:
            raise AdapterError(f"LoRA {name!r} is used by requests in flight: {users[:5]}")
        self._evict(self.adapters.pop(name))

    def in_flight_users(self, name: str) -> list[str]:
        out = []
        for rid, rec in self.engine.scheduler.records.items():
            refs = getattr(getattr(rec.state, "request", None), "lora", ()) or ()
            if rec.status in ("waiting", "running") and any(r.name == name for r in refs):
                out.append(rid)
        return out

    def _evict(self, adapter: LoraAdapter) -> None:
        self.prepared.evict_where(lambda k: (adapter.name, adapter.version) in k.adapter_versions)

    def list(self) -> list[dict]:
        merged = {m.name: m for m in self.merged}
        return [{"name": a.name, "version": a.version, "family": a.family, "source_format": a.source_format,
                 "ranks": a.ranks(), "layers": len(a.modules()), "components": sorted(a.targets),
                 "merged": a.name in merged, "merged_scale": merged[a.name].scale if a.name in merged else None}
                for a in sorted(self.adapters.values(), key=lambda a: a.name)]

    # ---- per request
    def check_refs(self, refs: Any) -> tuple[LoraRef, ...]:
        """A request's `lora` refs, checked against what is loaded (AdapterError naming the adapter)."""
        refs = tuple(refs or ())
        for r in refs:
            if not isinstance(r, LoraRef):
                raise AdapterError(f"lora entries must be LoraRef(name, scale), got {type(r).__name__}")
            r.validate()
            if r.name not in self.adapters:
                raise AdapterError(f"lora {r.name!r} is not loaded (loaded: {sorted(self.adapters) or 'none'})")
            if any(m.name == r.name for m in self.merged):
                raise AdapterError(f"lora {r.name!r} is merged into the weights already; a request naming it "
                                   f"would apply it twice")
        if refs:
            self.attach()
        return refs

    def _prepared(self, component: Any, adapter: LoraAdapter) -> PreparedLora:
        key = prep.prepared_key(self.engine.family.name, component.component_id, component.weights_version,
                                component.dtype, component.device, adapter)
        hit = self.prepared.get(key)
        if hit is None:
            hit = prep.prepare(adapter, component.component_id, component.component, component.dtype,
                               component.device, component.lora_layers())
            self.prepared.put(key, hit, nbytes=sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                                                   for a, b in hit.pairs.values()))
        return hit

    def rows(self, component: Any, per_row: list[tuple[LoraRef, ...]]) -> RowLora | None:
        """Each row's adapters for one batched forward of `component` (None: no row uses one)."""
        uses = []
        for refs in per_row:
            row = []
            for r in refs:
                adapter = self.adapters.get(r.name)
                if adapter is None:
                    raise AdapterError(f"lora {r.name!r} was unloaded while a request used it")
                if component.component_id in adapter.targets:
                    row.append((self._prepared(component, adapter), r.scale))
            uses.append(row)
        return row_lora(uses, component.device)

    # ---- merge / unmerge
    def _base_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        engine = self.engine
        ckpt = getattr(engine, "checkpoint", None)
        if ckpt is not None:
            from manifests.checkpoint import load_state
            names = [c.component_id for c in engine.family.components(engine.model.cfg)]
            return {n: load_state(ckpt, component=n if ckpt.is_model else None) for n in names}
        base = getattr(engine, "base_weights", None)
        if base is None:
            raise AdapterError("merging a LoRA needs the base weights: build the engine from a checkpoint "
                               "(Engine.from_checkpoint) or from weights (Engine.from_weights)")
        return base

    def merge(self, name: str, scale: float = 1.0) -> str:
        """Fuse `name` (at `scale`) into the resident weights, on top of any merged before: a new weights version
        (returned). AdapterError when it is not loaded or already merged."""
        if name not in self.adapters:
            raise AdapterError(f"no LoRA named {name!r} is loaded (loaded: {sorted(self.adapters)})")
        if any(m.name == name for m in self.merged):
            raise AdapterError(f"LoRA {name!r} is merged already")
        LoraRef(name, scale).validate()
        expected = self.merged_version() if self.merged else None
        current = self.engine.model.weights_version
        if expected is not None and current != expected:
            raise AdapterError(f"the weights changed since the last merge ({current}, expected {expected}); "
                               f"unmerge first")
        base = self._base_weights()
        if not self.merged:   # an engine built without a version: the hash update_weights would give them
            self.base_version = current or "sha256:" + hashlib.sha256("".join(
                state_dict_hash(base[c]) for c in sorted(base)).encode()).hexdigest()[:32]
        adapter = self.adapters[name]
        merged = self.merged + [MergedAdapter(name, adapter.version, float(scale))]
        weights = merged_weights(base, [(self.adapters[m.name], m.scale) for m in merged])
        version = self.merged_version(merged)
        self.engine.update_weights(weights, version=version)
        self.merged = merged
        self.attach()
        return version

    def unmerge(self) -> str:
        """Back to the base weights and their version (returned). AdapterError when nothing is merged."""
        if not self.merged:
            raise AdapterError("no LoRA is merged")
        self.engine.update_weights(self._base_weights(), version=self.base_version)
        self.merged = []
        self.attach()
        return str(self.base_version)

    def merged_version(self, merged: list[MergedAdapter] | None = None) -> str:
        merged = self.merged if merged is None else merged
        return f"{self.base_version}+" + "+".join(f"{m.name}:{m.version}@{m.scale:g}" for m in merged)
