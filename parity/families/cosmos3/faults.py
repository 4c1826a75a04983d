"""cosmos3's planted faults (negative controls): each breaks ONE side, or logic both sides share, in one known
place. A harness that passes with a fault planted, or fails without naming the layer, is broken.

One mechanism: a context manager that patches a module (or class) attribute at a declared seam and restores it on
exit; production code carries no fault flags. Seams: the optimized side's module-level functions (ops, packing,
loops, solvers, reasoner, the captured step's optimized.runtime.compile
static_buffers / copy_in / copy_out), the reference side's
(reference.cosmos3.packing.grid_position_ids,
reference.cosmos3.sampler.initial_latents, reference.cosmos3.model.Cosmos3Transformer.timestep_embedding) and the
shared manifests (manifests.cosmos3.sampling.Cosmos3GenerateRequest.uses_cfg). C0 faults are planted around a
loaded pair of models, C1 faults around an Engine and the reference loops, C4 faults in the C4 engine side
(parity/families/cosmos3/c4_setup.py). Faults on logic both sides share can only be caught against upstream: C1
runs the seeded upstream anchors (c1.UPSTREAM_ANCHORS) for that."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

import torch

from manifests.cosmos3 import Cosmos3Config
from parity.family import Fault
from parity.patching import patched as _patched


def fault_layer(cfg: Cosmos3Config) -> int:
    return min(1, cfg.num_layers - 1)


@contextlib.contextmanager
def _perturbed_weight(fast, cfg: Cosmos3Config) -> Iterator[None]:
    """One weight of layer k's gen MLP nudged by 1e-2 (in place, so every use of it sees the change)."""
    w = fast.params[f"layers.{fault_layer(cfg)}.gen.mlp.down_proj.weight"]
    saved = w.clone()
    w[0, 0] += 1e-2
    try:
        yield
    finally:
        w.copy_(saved)


def _rope_interleave(fast, cfg: Cosmos3Config):
    """mRoPE columns with the H and W axes swapped (a wrong interleave convention)."""
    from optimized.models.cosmos3 import ops

    def swapped(original):
        def axis_of_column(half_dim, rope_axes_dim):
            axis = original(half_dim, rope_axes_dim).clone()
            h, w = axis == 1, axis == 2
            axis[h], axis[w] = 2, 1
            return axis
        return axis_of_column
    return _patched(ops, "mrope_axis_of_column", swapped)


def _timestep_on_cond(fast, cfg: Cosmos3Config):
    """The timestep embedding also added to conditioned (clean) vision frames."""
    from optimized.models.cosmos3 import packing

    def every_vision_row(original):
        def rows(layout):
            noisy = original(layout)
            return torch.unique(torch.cat([noisy, layout.vision_sequence_indexes.to(noisy.device)]))
        return rows
    return _patched(packing, "timestep_embedding_rows", every_vision_row)


def _ref_fps_one_row_action(fast, cfg: Cosmos3Config):
    """Reference side: fps modulation applied to a one-row action segment (upstream never modulates a segment
    of one temporal step)."""
    from reference.cosmos3 import packing as ref_packing

    def modulated(original):
        def grid_position_ids(cfg, t, h, w, offset, fps, **kw):
            action_segment = kw.get("tcf") == 1 and kw.get("start_frame") == 1 and kw.get("base_tcf") != 1
            if t == 1 and action_segment and cfg.enable_fps_modulation and fps is not None:
                return original(cfg, 2, h, w, offset, fps, **kw)[:, : h * w]  # row 0 of a modulated 2-row grid
            return original(cfg, t, h, w, offset, fps, **kw)
        return grid_position_ids
    return _patched(ref_packing, "grid_position_ids", modulated)


def _ref_time_embed_bf16(fast, cfg: Cosmos3Config):
    """Reference side: the timestep MLP run in bf16 (upstream keeps the time embedder fp32). Inside the C0 bf16
    tolerance of a whole forward; the time_embed check sees it at every run dtype."""
    from reference.cosmos3.model import Cosmos3Transformer

    def low_precision(original):
        def timestep_embedding(self, timestep, n, dtype):
            params = list(self.time_embed.parameters())
            saved = [p.data for p in params]
            for p in params:
                p.data = p.data.to(torch.bfloat16)
            try:
                return original(self, timestep, n, dtype)
            finally:
                for p, d in zip(params, saved):
                    p.data = d
        return timestep_embedding
    return _patched(Cosmos3Transformer, "timestep_embedding", low_precision)


# name -> (context factory, the canonical trace name the harness must report as first divergence)
COSMOS3_FAULTS = {
    "perturbed-weight": (_perturbed_weight, lambda cfg: f"layers.{fault_layer(cfg)}.gen"),
    "rope-interleave": (_rope_interleave, lambda cfg: "layers.0.gen"),
    "timestep-on-cond": (_timestep_on_cond, lambda cfg: "embed"),
    "ref-fps-one-row-action": (_ref_fps_one_row_action, lambda cfg: "layers.0.gen"),
    "ref-time-embed-bf16": (_ref_time_embed_bf16, lambda cfg: "time_embed"),
}


@contextlib.contextmanager
def planted(fault: str | None, fast, cfg: Cosmos3Config) -> Iterator[None]:
    if fault is None:
        yield
        return
    factory, _ = COSMOS3_FAULTS[fault]
    fast.clear_und_cache()
    with factory(fast, cfg):
        yield
    fast.clear_und_cache()  # nothing computed under the fault survives it


# ------------------------------------------------------------------------------------------------
# C1 (loop) faults, planted in an Engine
# ------------------------------------------------------------------------------------------------

def _wrong_flow_shift(engine):
    """The optimized schedule applies flow_shift * 1.5."""
    from optimized.solvers import unipc
    return _patched(unipc, "shifted_sigmas", lambda original: lambda base, shift: original(base, shift * 1.5))


def _swapped_cfg(engine):
    """Guidance combine with cond and uncond swapped."""
    from optimized.models.cosmos3 import loops
    return _patched(loops, "cfg_combine", lambda original: lambda c, u, scale: original(u, c, scale))


@contextlib.contextmanager
def _stale_und_cache(engine) -> Iterator[None]:
    """The und-stream cache key forgets the prompt content: a changed prompt of the same length reuses the
    previous prompt's K/V."""
    if engine is None:  # planted per engine; the AR checks build engines of their own
        yield
        return
    fast = engine.model
    original = fast.und_cache_key
    fast.und_cache_key = lambda text_ids, *a, **kw: replace(original(text_ids, *a, **kw), input_hashes=())
    try:
        yield
    finally:
        del fast.und_cache_key


def _shared_solver_state(engine):
    """Requests of the same shape share one solver state (one scheduler object per shape, as if the
    scheduler were not per-request loop state): each step of one advances the other."""
    from optimized.models.cosmos3 import loops
    shared: dict[tuple, object] = {}

    def sharing(original):
        def advance(solver, velocity, x):
            key = (tuple(x.shape), solver.num_steps)
            state = shared.get(key, solver)
            if state.index >= state.num_steps:  # a fresh request of this shape starts over
                state = solver
            new_state, x_next = original(state, velocity, x)
            shared[key] = new_state
            return new_state, x_next
        return advance
    return _patched(loops, "advance", sharing)


def _rope_off_by_one_decode(engine):
    """The AR decode path rotates each new token as if it sat one position later."""
    from optimized.models.cosmos3 import reasoner
    return _patched(reasoner, "text_positions", lambda original: lambda cfg, start, n: original(cfg, start + 1, n))


def _ref_noise_order(engine):
    """Reference side: the seeded draw takes sound noise before vision noise (upstream: vision, sound, action)."""
    from reference.cosmos3 import sampler

    def sound_first(original):
        def initial_latents(cfg, req, gen=None):
            if gen is None and req.seed is not None:
                gen = torch.Generator().manual_seed(req.seed)
            if req.sound_frames and req.noise_sound is None and gen is not None:
                req = replace(req, noise_sound=torch.randn(cfg.sound_dim, req.sound_frames, generator=gen))
            return original(cfg, req, gen)
        return initial_latents
    return _patched(sampler, "initial_latents", sound_first)


def _manifest_uses_cfg_gt1(engine):
    """Shared manifest logic: `uses_cfg` written `guidance > 1` instead of `!= 1` (both sides agree: guidance
    below 1 silently drops CFG everywhere; only upstream tells)."""
    from manifests.cosmos3.sampling import Cosmos3GenerateRequest
    return _patched(Cosmos3GenerateRequest, "uses_cfg",
                    lambda original: property(lambda self: self.guidance_scale > 1.0))


def _batched_timestep_first(engine):
    """Optimized side: a batched forward embeds every sample with the FIRST sample's timestep (harmless alone or
    when the batch mates share a step; wrong for requests batched at different steps)."""
    from optimized.models.cosmos3 import ops
    return _patched(ops, "time_embedding", lambda original: lambda t, *a, **kw:
                    original(t[:1].expand(t.shape[0]).contiguous(), *a, **kw))


def _graph_fault(fault: str):
    """A fault of the captured step path (parity/graph_faults.py: stale-static-buffer, static-output-handback,
    aliased-static-inputs) in the gen step and the AR decode step (emulated graph on CPU)."""
    @contextlib.contextmanager
    def plant(engine) -> Iterator[None]:
        from parity.graph_faults import planted_graph_fault
        if engine is None:  # the AR checks build engines of their own: planted in each (ar_engine_planter)
            yield
            return
        with planted_graph_fault(fault, [engine.model]):
            yield
    return plant


def _pad_not_masked(engine):
    """The gen stream's shape bucket pads text and gen keys without masking them (every key of the bucket is
    attended to as if real)."""
    from optimized.models.cosmos3 import packing
    return _patched(packing, "real_key_lengths", lambda original: lambda layouts, text_pad, gen_pad:
                    [(text_pad, gen_pad)] * len(layouts))


COSMOS3_C1_FAULTS = {
    "stale-static-buffer": _graph_fault("stale-static-buffer"),
    "static-output-handback": _graph_fault("static-output-handback"),
    "aliased-static-inputs": _graph_fault("aliased-static-inputs"),
    "pad-not-masked": _pad_not_masked,
    "ref-noise-order": _ref_noise_order,
    "manifest-uses-cfg-gt1": _manifest_uses_cfg_gt1,
    "batched-timestep-first": _batched_timestep_first,
    "rope-off-by-one-decode": _rope_off_by_one_decode,
    "wrong-flow-shift": _wrong_flow_shift,
    "swapped-cfg": _swapped_cfg,
    "stale-und-cache": _stale_und_cache,
    "shared-solver-state": _shared_solver_state,
}


# ------------------------------------------------------------------------------------------------
# Parallel faults: planted by every rank of a C1 run under --plan (parallel.py) at the runtime's declared seams
# (parity/parallel_faults.py: optimized.parallel.sp.split_head_groups / sequence_to_heads, CFGParallel.branch_rows /
# run; and cosmos3's own optimized.models.cosmos3.tp.tp_slice), so kept apart from the one-process FAULTS
# ------------------------------------------------------------------------------------------------

PARALLEL_FAULT_AXES = {"ulysses-heads-permuted": "sp_ulysses", "cfg-branches-swapped": "cfgp",
                       "tp-wrong-slice": "tp", "cfg-rows-halved": "cfgp",
                       "ulysses-heads-interleaved": "sp_ulysses"}   # fault -> axis
PARALLEL_FAULT_DECLS = (
    Fault("ulysses-heads-permuted", "Ulysses SP: the forward all-to-all sends each head group to the wrong rank "
          "(C1 with --plan ulysses2)", "C1", "step 0, cond branch, layer layers.0.gen"),
    Fault("cfg-branches-swapped", "CFG-parallel: each rank runs the other branch and reports it as its own (C1 "
          "with --plan cfgp2)", "C1", "step 0, no layer (rank 0): the model agrees on the reference's inputs"),
    Fault("tp-wrong-slice", "TP: layer 1's gen MLP down_proj (row-parallel) kept as the next rank's columns (C1 "
          "with --plan tp2; seam optimized.models.cosmos3.tp.tp_slice)", "C1",
          "step 0, cond branch, layer layers.1.gen"),
    Fault("cfg-rows-halved", "CFG-parallel: the gathered predictions split in half (cond = first half), not by "
          "branch (C1 with --plan cfgp2: only a batch mixing guided and unguided requests tells)", "C1"),
    Fault("ulysses-heads-interleaved", "Ulysses SP: the inverse all-to-all lays the heads out interleaved (C1 with "
          "--plan ulysses2: tiny's 4 heads put 2 on every rank)", "C1", "step 0, cond branch, layer layers.0.gen"),
)


def _tp_wrong_slice():
    """Layer fault_layer's gen mlp.down_proj.weight sliced as rank r + 1's columns when a rank cuts its shard
    (optimized.models.cosmos3.tp.tp_slice, the seam every slice goes through)."""
    from optimized.models.cosmos3 import tp
    from parity.parallel_faults import patched

    def wrong(original):
        def tp_slice(key, shape, group, cfg):
            got = original(key, shape, group, cfg)
            if got is None or key != f"layers.{fault_layer(cfg)}.gen.mlp.down_proj.weight":
                return got
            dim, start, length = got
            return dim, (start + length) % shape[dim], length
        return tp_slice
    return patched(tp, "tp_slice", wrong)


def planted_parallel(fault: str | None):
    """A parallel fault, entered by every rank before its engines are built (a no-op for other faults)."""
    if fault == "tp-wrong-slice":   # a cosmos3 seam (the runtime's own are planted by parity/parallel_faults.py)
        return _tp_wrong_slice()
    if fault in PARALLEL_FAULT_AXES:
        from parity.parallel_faults import planted
        return planted(fault)
    return contextlib.nullcontext()


# C1 faults also planted in every engine the AR checks build (their seams are in the decode step too)
AR_ENGINE_FAULTS = ("stale-static-buffer", "static-output-handback", "aliased-static-inputs")


def ar_engine_planter(fault: str | None):
    """`plant(engine)` for ar.ar_checks: the fault planted in that engine when it applies to AR engines, else None."""
    return (lambda engine: planted_c1(fault, engine)) if fault in AR_ENGINE_FAULTS else None


@contextlib.contextmanager
def planted_c1(fault: str | None, engine) -> Iterator[None]:
    if fault is None:
        yield
        return
    with COSMOS3_C1_FAULTS[fault](engine):
        yield


# ------------------------------------------------------------------------------------------------
# C4 (decoded artifact) faults, planted in the C4 EngineSide
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _inverted_latents_std(side) -> Iterator[None]:
    """The optimized decode seam de-normalises with z / std + mean (the pipeline's inv_std taken for std); the
    encode seam (i2v conditioning) is left correct."""
    module = side.opt_sound
    original = module.decode_cosmos3_outputs

    def decode(vae, *args, **kw):
        cfg = vae.cfg
        vae.cfg = replace(cfg, latents_std=tuple(1.0 / s for s in cfg.latents_std))  # not validated: planted bug
        try:
            return original(vae, *args, **kw)
        finally:
            vae.cfg = cfg
    module.decode_cosmos3_outputs = decode
    try:
        yield
    finally:
        module.decode_cosmos3_outputs = original


@contextlib.contextmanager
def _swapped_stereo(side) -> Iterator[None]:
    """The optimized sound decoder returns its waveform with the left and right channels exchanged."""
    sound = side.sound
    if sound is None:  # nothing to break on a model without sound (run_c4 refuses a run where no variant has it)
        yield
        return
    original = sound.decode
    sound.decode = lambda latents: original(latents).flip(-2)
    try:
        yield
    finally:
        del sound.decode


# name -> (context factory on the EngineSide, the checks that must FAIL)
C4_FAULTS = {
    "inverted-latents-std": (_inverted_latents_std, ("frames",)),
    "swapped-stereo": (_swapped_stereo, ("audio",)),
}


@contextlib.contextmanager
def planted_c4(fault: str | None, side) -> Iterator[None]:
    if fault is None:
        yield
        return
    with C4_FAULTS[fault][0](side):
        yield


FAULTS = (
    Fault("perturbed-weight", "one weight of layer 1's gen MLP nudged by 1e-2", "C0", "layers.1.gen"),
    Fault("rope-interleave", "mRoPE columns with the H and W axes swapped", "C0", "layers.0.gen"),
    Fault("timestep-on-cond", "timestep embedding also added to conditioned (clean) vision frames", "C0", "embed"),
    Fault("ref-fps-one-row-action", "reference: fps modulation applied to a one-row action segment", "C0",
          "packing: position_ids"),
    Fault("ref-time-embed-bf16", "reference: timestep MLP run in bf16 instead of fp32", "C0", "time_embed"),
    Fault("ref-noise-order", "reference: seeded noise drawn sound first (upstream: vision, sound, action)", "C1",
          "initial latents differ"),
    Fault("manifest-uses-cfg-gt1", "shared manifest: uses_cfg written guidance > 1 instead of != 1", "C1",
          "upstream anchor gen_sound_seeded_g05"),
    Fault("batched-timestep-first", "optimized: a batched forward embeds every sample with the first sample's "
          "timestep", "C1", "layer embed (replayed batched call"),
    Fault("rope-off-by-one-decode", "AR decode rotates each new token one position late", "C1"),
    Fault("wrong-flow-shift", "optimized schedule applies flow_shift * 1.5", "C1"),
    Fault("swapped-cfg", "guidance combine with cond and uncond swapped", "C1"),
    Fault("stale-und-cache", "und-stream cache key forgets the prompt content", "C1"),
    Fault("shared-solver-state", "same-shape requests share one solver state", "C1"),
    Fault("stale-static-buffer", "captured step replayed without copying new inputs into its static buffers "
          "(emulated graph on CPU)", "C1", "step 1"),
    Fault("static-output-handback", "captured step hands back its static output buffers: a later replay "
          "overwrites what an earlier caller holds (emulated graph on CPU)", "C1", "held output overwritten"),
    Fault("aliased-static-inputs", "captured step keeps the first call's input tensors as its static buffers: "
          "later callers' copy-in overwrites them (emulated graph on CPU)", "C1", "caller inputs overwritten"),
    Fault("pad-not-masked", "shape bucket padded without masking the pad keys", "C1",
          "step 0, cond branch, layer layers.0.gen"),
    Fault("inverted-latents-std", "VAE decode de-normalises with z / std + mean", "C4", "vae decode"),
    Fault("swapped-stereo", "left/right channels of the decoded waveform exchanged", "C4", "sound decode"),
)
