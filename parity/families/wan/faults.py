"""wan's planted faults (negative controls): each breaks the optimized side in one known place. A harness that
passes with a fault planted, or fails without naming the layer / step, is broken.

Where each is planted (context managers; everything is restored on exit, caches cleared on both edges):
    DiT      (WanDiTFast)      rope-wrong-axis, perturbed-weight
    UMT5     (UMT5Fast)        text-padding-not-zeroed
    VAE      (FastWanVAE)      vae-perturbed-weight, rep-context, dropped-cache   (parity/families/wan/vae.py)
    loop     (wan.denoise)     expert-switch-late
    graph    (optimized.runtime.compile static_buffers / copy_in / copy_out, every DiT expert; parity/graph_faults.py)
                                                             stale-static-buffer, static-output-handback,
                                                             aliased-static-inputs
    decode   (media chain)     inverted-latents-std
    parallel (patched in every rank by the rank's own entry, before the model is parallelized; C1 with --plan)
             optimized.parallel.sp.split_head_groups         ulysses-heads-permuted   (--plan ulysses*)
             CFGParallel.branch_rows                          cfg-branches-swapped     (--plan cfgp2*)
             CFGParallel.run                                  cfg-rows-halved          (--plan cfgp2*; fails in
                                                                                         batches mixing guided and
                                                                                         unguided requests)
             optimized.parallel.sp.sequence_to_heads          ulysses-heads-interleaved (--plan ulysses*; fails on
                                                                                         the more-heads variant only)
             optimized.models.wan.parallelize.tp_slice        tp-wrong-slice           (--plan tp*)
             optimized.models.wan.transformer.key_mask_shard  pad-keys-not-masked      (--plan ulysses*; fails in
                                                                                         the sp_padded loop only)
             optimized.parallel.sp.attention_lse              ring-no-max-shift        (--plan ring*; fails in the
                                                                                         sp_ring_large_logits loop only)
DiT / UMT5 faults are planted in the C0 components and, for C1, in the engine's model instance too.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from parity.errors import SetupError
from parity.families.wan import vae
from parity.family import Fault
from parity.graph_faults import GRAPH_FAULTS, planted_graph_fault
from parity.patching import patched as _patched

FAULT_LAYER = 1   # perturbed-weight nudges this block (the last one when the DiT has fewer layers)

FAULTS = (
    Fault("rope-wrong-axis", "DiT rope: h and w patch positions swapped (h channels rotated by the w position)",
          "C0", "blocks.0"),
    Fault("perturbed-weight", f"one weight of DiT block {FAULT_LAYER}'s FFN output projection nudged", "C0",
          f"blocks.{FAULT_LAYER}"),
    Fault("text-padding-not-zeroed", "UMT5 prompt embeds keep the encoder's outputs at padded positions instead of "
          "WanPipeline's zeros (C1 catches it too: the DiT sees the padded rows)", "C0", "text_encoder.padding"),
    Fault("vae-perturbed-weight", "one weight of VAE decoder stage 1 nudged", "C0", "decoder.up_blocks.1"),
    Fault("widget-shifted-by-one", "ComfyUI UI export: widgets_values read without KSampler's control_after_generate "
          "slot (C4 workflow rows)", "C4", "ui/compile"),
    Fault("cfg-read-as-steps", "ComfyUI compiler: KSampler's steps read from its cfg widget (C4 workflow rows)", "C4",
          "settings"),
    Fault("clip-perturbed-weight", "one weight of the CLIP image encoder's layer-0 MLP nudged (i2v models)", "C0",
          "encoder.layers.0"),
    Fault("rep-context", "VAE temporal upsample conv sees frame 0 as context (upstream's 'Rep' quirk ignored)", "C0"),
    Fault("dropped-cache", "VAE decoder.conv_in's conv cache not carried between chunks", "C0", "decoder.conv_in"),
    Fault("expert-switch-late", "two-expert loop switches to transformer_2 one step after the boundary", "C1",
          "step 2: expert 1, reference expert 2"),
    Fault("inverted-latents-std", "the engine's media chain de-normalises with z * (1 / std) + mean", "C4",
          "vae decode"),
    Fault("stale-static-buffer", "the DiT's captured block stack replayed without copying new inputs into its "
          "static buffers (emulated graph on CPU)", "C1", "step 1"),
    Fault("static-output-handback", "the DiT's captured block stack hands back its static output buffers: a later "
          "replay overwrites what an earlier caller holds (emulated graph on CPU)", "C1", "held output overwritten"),
    Fault("aliased-static-inputs", "the DiT's captured block stack keeps the first call's input tensors as its "
          "static buffers (emulated graph on CPU)", "C1", "caller inputs overwritten"),
)
# planted in every rank of a C1 run under --plan (tests/test_wan_sp.py, tests/test_wan_tp.py), so kept apart from
# the one-process FAULTS
PARALLEL_FAULT_DECLS = (
    Fault("ulysses-heads-permuted", "Ulysses SP: the forward all-to-all sends each head group to the wrong rank "
          "(C1 with --plan ulysses2)", "C1", "step 0, cond branch, layer blocks.0"),
    Fault("cfg-branches-swapped", "CFG-parallel: each rank runs the other rank's branch and reports it as its own "
          "(C1 with --plan cfgp2)", "C1", "step 0, no layer (rank 0): the DiT agrees on the reference's input"),
    Fault("tp-wrong-slice", f"TP: block {FAULT_LAYER}'s FFN down projection (row-parallel) loaded from the next "
          "rank's slice (C1 with --plan tp2)", "C1", f"step 0, cond branch, layer blocks.{FAULT_LAYER}"),
    Fault("pad-keys-not-masked", "SP: the keys padding the sharded sequence to a multiple of ulysses x ring join "
          "self-attention unmasked (C1 with --plan ulysses2: the sp_padded loop)", "C1",
          "step 0, cond branch, layer blocks.0"),
    Fault("ring-no-max-shift", "ring SP: each ring partial attention from raw exp sums, without the running max "
          "(C1 with --plan ring2: exp overflows in the sp_ring_large_logits loop only)", "C1",
          "step 0, cond branch, layer blocks.0"),
    Fault("cfg-rows-halved", "CFG-parallel: the gathered predictions split in half (cond = first half), not by "
          "branch (C1 with --plan cfgp2: only a batch mixing guided and unguided rows tells)", "C1"),
    Fault("ulysses-heads-interleaved", "Ulysses SP: the inverse all-to-all lays the heads out interleaved (C1 with "
          "--plan ulysses2: only a rank holding 2+ heads tells, the plan's more-heads variant)", "C1",
          "step 0, cond branch, layer blocks.0"),
)
FAULT_NAMES = tuple(f.name for f in FAULTS)
DIT_FAULTS = ("rope-wrong-axis", "perturbed-weight")
UMT5_FAULTS = ("text-padding-not-zeroed",)
CLIP_FAULTS = ("clip-perturbed-weight",)   # clip.py plants it
VAE_FAULTS = {"vae-perturbed-weight": "perturbed-weight", "rep-context": "rep-context",
              "dropped-cache": "dropped-cache"}   # family name -> the name vae.py plants
LOOP_FAULTS = ("expert-switch-late",)
DECODE_FAULTS = ("inverted-latents-std",)
WORKFLOW_FAULTS = ("widget-shifted-by-one", "cfg-read-as-steps")   # parity/workflow_checks.py plants them
PARALLEL_FAULT_AXES = {"ulysses-heads-permuted": "sp_ulysses", "cfg-branches-swapped": "cfgp",
                       "tp-wrong-slice": "tp", "pad-keys-not-masked": "sp_ulysses",
                       "ring-no-max-shift": "sp_ring", "cfg-rows-halved": "cfgp",
                       "ulysses-heads-interleaved": "sp_ulysses"}   # fault -> its plan axis
PARALLEL_FAULTS = tuple(PARALLEL_FAULT_AXES)

C0_FAULTS = DIT_FAULTS + UMT5_FAULTS + CLIP_FAULTS + tuple(VAE_FAULTS)
C1_FAULTS = DIT_FAULTS + UMT5_FAULTS + LOOP_FAULTS + GRAPH_FAULTS + PARALLEL_FAULTS
C4_FAULTS = DECODE_FAULTS + WORKFLOW_FAULTS


def check_fault(fault: str | None, level: str, allowed: tuple[str, ...]) -> None:
    if fault is not None and fault not in allowed:
        raise SetupError(f"unknown {level} fault {fault!r} for wan; known at {level}: {', '.join(allowed)} "
                         f"(all: {', '.join(FAULT_NAMES)})")


# ------------------------------------------------------------------------------------------------
# DiT
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _rope_wrong_axis(fast) -> Iterator[None]:
    """rope tables built with the h and w positions exchanged (h channels rotate by w, w channels by h)."""
    (cos_t, sin_t), (cos_h, sin_h), (cos_w, sin_w) = fast._rope_axes

    def swapped(grid):
        f, h, w = grid
        cos = torch.cat([cos_t[:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                         cos_h[:w].view(1, 1, w, -1).expand(f, h, w, -1),
                         cos_w[:h].view(1, h, 1, -1).expand(f, h, w, -1)], -1)
        sin = torch.cat([sin_t[:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                         sin_h[:w].view(1, 1, w, -1).expand(f, h, w, -1),
                         sin_w[:h].view(1, h, 1, -1).expand(f, h, w, -1)], -1)
        return cos.reshape(f * h * w, 1, -1).to(fast.device), sin.reshape(f * h * w, 1, -1).to(fast.device)

    fast._rope_cache.clear()
    fast.rope_tables = swapped
    try:
        yield
    finally:
        del fast.rope_tables
        fast._rope_cache.clear()


@contextlib.contextmanager
def _perturbed_weight(fast) -> Iterator[None]:
    w = fast.params[f"blocks.{min(FAULT_LAYER, fast.cfg.num_layers - 1)}.ffn.net.2.weight"]
    saved = w.clone()
    w.view(-1)[0] += 0.5 * w.abs().max()   # in place: the block's weights view the same tensor
    try:
        yield
    finally:
        w.copy_(saved)


@contextlib.contextmanager
def planted_dit(fault: str | None, fast) -> Iterator[None]:
    if fault == "rope-wrong-axis":
        with _rope_wrong_axis(fast):
            yield
    elif fault == "perturbed-weight":
        with _perturbed_weight(fast):
            yield
    else:
        yield


# ------------------------------------------------------------------------------------------------
# UMT5
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def planted_umt5(fault: str | None, encoder) -> Iterator[None]:
    if fault != "text-padding-not-zeroed":
        yield
        return

    def untrimmed(prompts, max_sequence_length):
        """Every row of the padded batch kept: the encoder's outputs at padded positions reach the DiT."""
        L = max_sequence_length
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        mask = torch.zeros(len(prompts), L, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, :p.numel()], mask[r, :p.numel()] = p, 1
        out = encoder.forward(ids, mask)
        return [out[r].clone() for r in range(len(prompts))]

    encoder.clear_cache()
    encoder._run = untrimmed
    try:
        yield
    finally:
        del encoder._run
        encoder.clear_cache()   # nothing encoded under the fault survives it


# ------------------------------------------------------------------------------------------------
# VAE (vae.py plants them), loop, decode
# ------------------------------------------------------------------------------------------------

def planted_vae(fault: str | None, fast_vae):
    return vae.planted(VAE_FAULTS.get(fault), fast_vae)


def _expert_switch_late():
    from optimized.models.wan import denoise

    def late(original):
        def schedule(cfg, timesteps):
            experts = list(original(cfg, timesteps))
            if 2 in experts:
                experts[experts.index(2)] = 1   # the first low-noise step still runs the high-noise expert
            return tuple(experts)
        return schedule
    return _patched(denoise, "expert_schedule", late)


@contextlib.contextmanager
def planted_engine(fault: str | None, engine) -> Iterator[None]:
    """C1: a DiT / UMT5 / loop fault in an engine's model instance or loop."""
    with contextlib.ExitStack() as stack:
        if fault in DIT_FAULTS:
            stack.enter_context(planted_dit(fault, engine.model.dit))
        elif fault in UMT5_FAULTS:
            stack.enter_context(planted_umt5(fault, engine.model.text_encoder))
        elif fault == "expert-switch-late":
            stack.enter_context(_expert_switch_late())
        elif fault in GRAPH_FAULTS:   # parity/graph_faults.py, in every DiT expert of the engine
            stack.enter_context(planted_graph_fault(fault, engine.model.experts()))
        yield   # parallel faults: planted by the rank itself around loading (planted_parallel)


def _tp_wrong_slice():
    """Block FAULT_LAYER's ffn.net.2.weight (row-parallel) sliced as rank r + 1's columns, whether the shard is cut
    from loaded weights or read from a checkpoint (both go through parallelize.tp_slice)."""
    from optimized.models.wan import parallelize

    def wrong(original):
        def tp_slice(key, shape, tp):
            got = original(key, shape, tp)
            if got is None or key != f"blocks.{FAULT_LAYER}.ffn.net.2.weight":
                return got
            dim, start, length = got
            return dim, (start + length) % shape[dim], length
        return tp_slice
    return _patched(parallelize, "tp_slice", wrong)


def _pad_keys_not_masked():
    """The SP block stack's pad-key mask replaced by all-True: the zero rows padding the sequence to a multiple of
    ulysses x ring are attended to as if they were tokens (through the seam the wan DiT calls,
    optimized.models.wan.transformer.key_mask_shard)."""
    from optimized.models.wan import transformer
    from parity.parallel_faults import patched

    def unmasked(original):
        def key_mask_shard(batch, length, n, index, device=None):
            return torch.ones_like(original(batch, length, n, index, device))
        return key_mask_shard
    return patched(transformer, "key_mask_shard", unmasked)


def planted_parallel(fault: str | None):
    """A parallel fault, entered by every rank before its model is loaded / parallelized (a no-op otherwise)."""
    if fault == "tp-wrong-slice":
        return _tp_wrong_slice()
    if fault == "pad-keys-not-masked":
        return _pad_keys_not_masked()
    if fault in PARALLEL_FAULTS:   # the runtime's own seams (parity/parallel_faults.py)
        from parity.parallel_faults import planted
        return planted(fault)
    return contextlib.nullcontext()


def planted_decode(fault: str | None):
    """C4: the engine's media chain de-normalises with z * (1 / std) + mean (the pipeline's reciprocal std taken
    for the std: its `latent_stats` hands out 1 / std)."""
    if fault != "inverted-latents-std":
        return contextlib.nullcontext()
    from optimized.models.wan import media

    def inverted(original):
        def latent_stats(cfg, like):
            mean, std = original(cfg, like)
            return mean, 1.0 / std
        return latent_stats
    return _patched(media, "latent_stats", inverted)
