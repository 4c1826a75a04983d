"""One attention seam for packed (varlen / multimodal) batches: padded SDPA with a key mask, selectable backend.

Every family's optimized attention goes through `attend(q, k, v, key_mask=..., causal=..., backend=...)` on padded
[B, heads, N, d] tensors, so a batch of samples of different lengths is ONE kernel call (no Python loop per sample):
  * `key_mask` [B, 1, 1 | N, M] bool: True = this key is real. Pad keys are masked; pad query rows still see the
    real keys (no all-masked row, so no NaN) and their outputs are discarded by the caller.
  * GQA without repeating K/V (`enable_gqa`), as upstream's SDPA call.
Backends: "auto" (PyTorch's choice), "math", "efficient", "flash", "cudnn" (SDPA kernels; those a device lacks raise
when selected), "flex" (FlexAttention with a block mask built from the same key mask). The backend is part of every
compile-cache key (optimized/runtime/compile.py): two backends may round differently.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "math", "efficient", "flash", "cudnn", "flex")


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return name


def key_padding_mask(lengths: list[tuple[int, int]], text_pad: int, gen_pad: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, 1, 1, text_pad + gen_pad] bool for keys laid out as [text (padded) | gen (padded)] per sample;
    `lengths` = (real text keys, real gen keys) per sample. Built once per layout (host), cached on the device."""
    B = len(lengths)
    mask = torch.zeros(B, text_pad + gen_pad, dtype=torch.bool)
    for s, (t, g) in enumerate(lengths):
        mask[s, :t] = True
        mask[s, text_pad:text_pad + g] = True
    return mask.view(B, 1, 1, -1).to(device)


def _flex(q, k, v, key_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, _, N, _ = q.shape
    M = k.shape[2]
    if key_mask is not None and key_mask.shape[-2] != 1:
        raise ValueError("flex backend takes a per-key mask [B, 1, 1, M]")
    valid = None if key_mask is None else key_mask.reshape(B, M)

    def mask_mod(b, h, qi, kj):
        ok = valid[b, kj] if valid is not None else kj >= 0
        return ok & (kj <= qi) if causal else ok

    block = create_block_mask(mask_mod, B, None, N, M, device=q.device)
    return flex_attention(q, k, v, block_mask=block, enable_gqa=q.shape[1] != k.shape[1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_mask: torch.Tensor | None = None,
           causal: bool = False, backend: str = "auto") -> torch.Tensor:
    """q [B, H, N, d], k/v [B, K, M, d] (H a multiple of K), key_mask [B, 1, 1|N, M] bool -> [B, H, N, d]."""
    if backend == "flex":
        return _flex(q, k, v, key_mask, causal)
    mask = key_mask
    if causal and mask is not None:  # causal AND padding: one boolean mask (SDPA takes one or the other)
        N, M = q.shape[2], k.shape[2]
        mask = mask & torch.ones(N, M, dtype=torch.bool, device=q.device).tril(M - N)
        causal = False
    ctx = contextlib.nullcontext() if backend == "auto" else _kernel(backend)
    with ctx:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])


def _kernel(backend: str):
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(_sdpa_backend(check_backend(backend)))
