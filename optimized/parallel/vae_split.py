"""Temporal split of the Wan VAE decode across ranks, exact: a pipeline over the causal chunk chain.

The decode is causal over latent frames: chunk i needs the conv caches left by chunks < i (`ConvCache`). Rank r of
the axis owns a contiguous range of latent frames; for each video it waits for the cache of rank r - 1 (after
r - 1's last chunk), decodes its range chunk by chunk exactly as one process would (same chunks, same `first`
flag, same cache), and hands its cache to rank r + 1 without waiting for it to be taken (isend). Decoded frames
go to `gather_to` (rank 0), so every frame is computed by exactly the op sequence of the single-process decode.

For one video this buys memory (each rank holds its frames' activations and output only), not latency: the chain
is sequential. For several videos it pipelines: rank 0 starts video k + 1 while rank 1 decodes video k. A spatial
split with halo exchange (which cuts single-video latency) needs halos inside every conv: a follow-up.
"""

from __future__ import annotations

from typing import Sequence

import torch

from optimized.parallel.cfg_parallel import split_rows
from optimized.parallel.group import AxisGroup


def frame_ranges(latent_frames: int, ranks: int) -> list[tuple[int, int]]:
    """Latent frames per rank, contiguous and balanced (a rank may own none when frames < ranks)."""
    return split_rows(latent_frames, ranks)


def _decode_range(vae, z: torch.Tensor, a: int, b: int, cache, chunk_frames: int = 1):
    from optimized.models.wan.vae import ConvCache  # the VAE lives with the model; imported where it is used

    cache = cache if cache is not None else ConvCache()
    frames = []
    with torch.no_grad():
        for i in range(a, b, chunk_frames):
            video, cache = vae.decode_chunk(z[:, :, i:min(i + chunk_frames, b)], cache, first=i == 0)
            frames.append(video)
    return frames, cache


def decode_split(vae, latents: Sequence[torch.Tensor], group: AxisGroup, gather_to: int = 0,
                 chunk_frames: int = 1) -> list[torch.Tensor] | None:
    """Decode each [B, z, T, h, w] (de-normalised decoder input) across the axis; the videos on rank `gather_to`
    (None on the others). `chunk_frames` must divide every rank's range boundaries the way the single-process
    decode chunks (1, upstream's, always does)."""
    from optimized.models.wan.vae import ConvCache

    n, r = group.world_size, group.rank
    if n == 1:
        return [torch.cat(_decode_range(vae, z, 0, z.shape[2], None, chunk_frames)[0], 2) for z in latents]
    pending, mine = [], []
    for k, z in enumerate(latents):
        a, b = frame_ranges(z.shape[2], n)[r]
        first_owner = next(q for q, (qa, qb) in enumerate(frame_ranges(z.shape[2], n)) if qb > qa)
        cache = None
        if a < b and r != first_owner:                 # the chain's cache arrives from the previous owner
            prev = max(q for q, (qa, qb) in enumerate(frame_ranges(z.shape[2], n)) if qb > qa and q < r)
            cache = ConvCache(group.recv_tensors(prev, z.device))
        frames, cache = _decode_range(vae, z, a, b, cache, chunk_frames) if a < b else ([], None)
        later = [q for q, (qa, qb) in enumerate(frame_ranges(z.shape[2], n)) if qb > qa and q > r]
        if a < b and later:
            pending += group.isend_tensors(dict(cache.frames), later[0])
        mine.append(torch.cat(frames, 2) if frames else None)
    out = None
    if r == gather_to:
        out = []
        for k, z in enumerate(latents):
            parts = []
            for q, (qa, qb) in enumerate(frame_ranges(z.shape[2], n)):
                if qb <= qa:
                    continue
                parts.append(mine[k] if q == r else group.recv_tensors(q, z.device)["video"])
            out.append(torch.cat(parts, 2))
    else:
        for k, video in enumerate(mine):
            if video is not None:
                pending += group.isend_tensors({"video": video}, gather_to)
    for h in pending:
        if hasattr(h, "wait"):
            group._run("isend wait", h.wait)
    return out
