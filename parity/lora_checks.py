"""LoRA parity: the engine's unmerged per-row adapters (one batched step, rows with different adapters or none)
against the reference's merge-then-run, and the engine's merged path against its unmerged one. A failing request
is localised by one DiT forward on both sides, compared after every block and the output head.

Planted faults (`FAULTS`, negative controls that must fail here and name the layer):
    lora-scale-off          the engine drops alpha / r (PEFT scaling) from its prepared pairs
    lora-wrong-projection   the engine lands attn1 deltas on the next fused slice (q -> k, k -> v)
    lora-stale-cache        the prepared-adapter cache key omits adapter_versions: a second adapter reads the first's
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch

from manifests.lora import LoraAdapter, LoraPair
from optimized.adapters import prepare as opt_prepare
from optimized.engine import Engine
from reference.wan.lora import merge_lora
from reference.wan.pipeline import WanReferencePipeline


@dataclass(frozen=True)
class LoraCheck:
    name: str
    passed: bool
    max_abs: float
    tolerance: float
    where: str = ""          # the first layer that diverges (failures only)


def _stale_key(*args, **kw):
    key = _real_key(*args, **kw)
    return dataclasses.replace(key, adapter_versions=())


_real_key = opt_prepare.prepared_key
_real_layout = opt_prepare.fused_layout


def _shifted_layout(spec):
    layout, totals = _real_layout(spec)
    for mod, (fused, offset, rows) in list(layout.items()):
        if fused.endswith("attn1.qkv") and offset + rows < totals[fused]:
            layout[mod] = (fused, offset + rows, rows)
    return layout, totals


@contextlib.contextmanager
def planted(fault: str | None) -> Iterator[None]:
    """Plant one of FAULTS on the engine side for the duration (None: clean)."""
    if fault is None:
        yield
        return
    if fault not in FAULTS:
        raise KeyError(f"unknown LoRA fault {fault!r}; faults: {sorted(FAULTS)}")
    with contextlib.ExitStack() as stack:
        mp = stack.enter_context(_patch())
        FAULTS[fault](mp)
        yield


@contextlib.contextmanager
def _patch():
    undo: list[tuple[object, str, object]] = []

    def setattr_(obj, name, value):
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)
    try:
        yield setattr_
    finally:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)


FAULTS = {
    "lora-scale-off": lambda mp: mp(LoraPair, "factor", property(lambda self: 1.0)),
    "lora-wrong-projection": lambda mp: mp(opt_prepare, "fused_layout", _shifted_layout),
    "lora-stale-cache": lambda mp: mp(opt_prepare, "prepared_key", _stale_key),
}


def localise(cfg, weights, adapters: dict[str, LoraAdapter], request, engine: Engine, tol: float) -> str:
    """The first of blocks.0 .. blocks.N-1, proj_out where one DiT forward of `request` (its initial latents, first
    timestep, its text) differs between the engine (unmerged rows) and the reference (merged weights)."""
    loop = engine.loop(engine.family.loop_for(request))
    state = loop.init_state(request)
    row = loop._branch(state, state.text)
    dit = engine.model.expert(1)
    trace: dict = {}
    refs = tuple(request.lora)
    lora = dit.lora_bank.rows(dit, [refs]) if refs else None
    dit.forward_batch(row.latents, row.timestep, row.text, row.image_embeds, trace=trace, lora=lora)
    ref = WanReferencePipeline(cfg, merge_lora(weights, [(adapters[r.name], r.scale) for r in refs])).transformer
    got: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda _m, _a, out, n=n: got.__setitem__(n, out))
             for n, m in [(f"blocks.{i}", b) for i, b in enumerate(ref.blocks)] + [("proj_out", ref.proj_out)]]
    try:
        with torch.no_grad():
            ref(row.latents, row.timestep, row.text, row.image_embeds)
    finally:
        for h in hooks:
            h.remove()
    for name in [f"blocks.{i}" for i in range(len(ref.blocks))] + ["proj_out"]:
        if (trace[name].float() - got[name].float()).abs().max().item() > tol:
            return name
    return "none (every layer within tolerance; the loop differs)"


def lora_parity(cfg, weights, adapters: dict[str, LoraAdapter], requests: list, tol: float = 1e-4,
                fault: str | None = None) -> list[LoraCheck]:
    """Every request submitted at once to one engine (must share every step's batch), each against the reference
    with its adapters merged; then the first adapter merged into the engine against its unmerged rows."""
    checks: list[LoraCheck] = []
    with planted(fault):
        engine = Engine.from_weights(cfg, weights, batching="greedy")   # tiny shapes: batch whatever the timings
        for name, adapter in adapters.items():
            engine.loras.load(name, adapter)
        sizes: list[int] = []
        engine.subscribe(lambda ev: sizes.append(ev.data.get("batch_size", 0))
                         if ev.data.get("phase") == "denoise_step" else None, "trace.step")
        handles = [engine.submit(r) for r in requests]
        outs = [h.result()["latents"]["vision"] for h in handles]
        checks.append(LoraCheck("batched/one_step", bool(sizes) and set(sizes) == {len(requests)},
                                float(min(sizes or [0])), float(len(requests))))
        for i, (r, out) in enumerate(zip(requests, outs)):
            uses = [(adapters[x.name], x.scale) for x in r.lora]
            ref = WanReferencePipeline(cfg, merge_lora(weights, uses)).generate(dataclasses.replace(r, lora=()))
            err = (out - ref.latents).abs().max().item()
            where = "" if err <= tol else localise(cfg, weights, adapters, r, engine, tol)
            checks.append(LoraCheck(f"request{i}/unmerged_vs_reference", err <= tol, err, tol, where))
        with_lora = [(i, r) for i, r in enumerate(requests) if len(r.lora) == 1]
        if with_lora:
            i, r = with_lora[0]
            engine.loras.merge(r.lora[0].name, r.lora[0].scale)
            merged = engine.generate(dataclasses.replace(r, lora=()))["latents"]["vision"]
            err = (merged - outs[i]).abs().max().item()
            checks.append(LoraCheck(f"request{i}/merged_vs_unmerged", err <= tol, err, tol))
    return checks
