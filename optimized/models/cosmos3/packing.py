"""Packing one cosmos3 forward (one CFG branch) into the joint sequence: [text | vision | sound | action].

Written from the layout facts (models/cosmos3.md 2.1-2.2), independent of any other packer:
  * text at 0..L_text-1, positions arange(L_text) on all three mRoPE axes (float32 with fps modulation);
  * vision, sound and action are temporal siblings: all start at off = L_text + temporal_modality_margin;
  * a segment with T frames, grid (h, w), compression tcf / base_tcf and start s gets, when fps
    modulation is on and T > 1, t = (i + s) / (fps / tcf) * (base_fps / base_tcf) + off (float32),
    else t = i + off + s (int64); h/w ids are 0-based on the patch grid (+ int(off) without reset);
      vision: tcf = base_tcf = vae_temporal_compression, s = 0, fps = fps_vision
      sound:  tcf = base_tcf = 1, s = 0, fps = fps_sound, grid 1x1
      action: tcf = 1, base_tcf = vae_temporal_compression, s = 1, fps = fps_vision, grid 1x1;
  * position_ids [3, L] is float32 with fps modulation (the text part is float), else int64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from manifests.cosmos3.config import Cosmos3Config
from manifests.cosmos3.io import Cosmos3ForwardInputs
from optimized.runtime.compile import ShapeBuckets


@dataclass(frozen=True)
class PackedLayout:
    """The packed layout of one sample. Index tensors are int64 positions in the joint sequence."""

    text_len: int
    seq_len: int
    temporal_offset: int
    position_ids: torch.Tensor                      # [3, L]
    vision_grid: tuple[int, int, int]               # (T, h, w) on the patch grid
    vision_latent_hw: tuple[int, int]               # (H, W) of the latent, before padding
    vision_noisy_frames: torch.Tensor               # latent frame ids that are noisy
    vision_sequence_indexes: torch.Tensor
    vision_mse_loss_indexes: torch.Tensor           # tokens of the noisy frames (the predicted ones)
    sound_noisy_frames: torch.Tensor | None = None
    sound_sequence_indexes: torch.Tensor | None = None
    sound_mse_loss_indexes: torch.Tensor | None = None
    action_noisy_frames: torch.Tensor | None = None
    action_sequence_indexes: torch.Tensor | None = None
    action_mse_loss_indexes: torch.Tensor | None = None

    @property
    def gen_len(self) -> int:
        return self.seq_len - self.text_len

    @property
    def num_vision_tokens(self) -> int:
        return self.vision_sequence_indexes.numel()

    @property
    def num_sound_tokens(self) -> int:
        return 0 if self.sound_sequence_indexes is None else self.sound_sequence_indexes.numel()

    @property
    def num_action_tokens(self) -> int:
        return 0 if self.action_sequence_indexes is None else self.action_sequence_indexes.numel()


def text_position_ids(text_len: int, fps_modulation: bool) -> torch.Tensor:
    ids = torch.arange(text_len, dtype=torch.float32 if fps_modulation else torch.int64)
    return ids.unsqueeze(0).expand(3, -1).contiguous()


def segment_position_ids(num_frames: int, grid_h: int, grid_w: int, offset: int, *, fps: float | None,
                         base_fps: float, tcf: int, base_tcf: int, start: int, reset_spatial: bool) -> torch.Tensor:
    """[3, num_frames*grid_h*grid_w] mRoPE ids of one latent segment (t-major, then h, then w)."""
    hw = grid_h * grid_w
    modulated = fps is not None and num_frames > 1
    if modulated:
        frames = torch.arange(num_frames, dtype=torch.float32)
        t = (frames + start) / (fps / tcf) * (base_fps / base_tcf) + offset
    else:
        t = torch.arange(num_frames, dtype=torch.int64) + offset + start
    t = t.repeat_interleave(hw)
    h = torch.arange(grid_h, dtype=torch.int64).repeat_interleave(grid_w).repeat(num_frames)
    w = torch.arange(grid_w, dtype=torch.int64).repeat(num_frames * grid_h)
    if not reset_spatial:
        h, w = h + offset, w + offset
    if modulated:
        h, w = h.float(), w.float()
    return torch.stack([t, h, w])


def _noisy(n: int, clean: tuple[int, ...]) -> torch.Tensor:
    skip = set(clean)
    return torch.tensor([i for i in range(n) if i not in skip], dtype=torch.int64)


def pack_layout(cfg: Cosmos3Config, inputs: Cosmos3ForwardInputs) -> PackedLayout:
    """Build the packed layout of one sample (validates `inputs` against `cfg` first)."""
    inputs.validate(cfg)
    p = cfg.patch_size
    fps_mod = cfg.enable_fps_modulation
    L_text = inputs.text_ids.numel()
    off = L_text + cfg.temporal_modality_margin
    seg = dict(base_fps=float(cfg.base_fps), reset_spatial=cfg.reset_spatial_ids)

    _, _, T, H, W = inputs.vision_latents.shape
    h, w = math.ceil(H / p), math.ceil(W / p)
    n_vis = T * h * w
    vis_noisy = _noisy(T, inputs.vision_condition_frames)
    vis_seq = torch.arange(L_text, L_text + n_vis)
    vis_mse = (L_text + vis_noisy[:, None] * (h * w) + torch.arange(h * w)).reshape(-1)
    pos = [text_position_ids(L_text, fps_mod),
           segment_position_ids(T, h, w, off, fps=inputs.fps_vision if fps_mod else None,
                                tcf=cfg.vae_temporal_compression, base_tcf=cfg.vae_temporal_compression,
                                start=0, **seg)]
    cur = L_text + n_vis
    extra: dict[str, torch.Tensor] = {}

    if inputs.sound_latents is not None:
        T_s = inputs.sound_latents.shape[1]
        seq = torch.arange(cur, cur + T_s)
        extra.update(sound_noisy_frames=torch.arange(T_s), sound_sequence_indexes=seq, sound_mse_loss_indexes=seq)
        pos.append(segment_position_ids(T_s, 1, 1, off, fps=inputs.fps_sound if fps_mod else None,
                                        tcf=1, base_tcf=1, start=0, **seg))
        cur += T_s

    if inputs.action_latents is not None:
        T_a = inputs.action_latents.shape[0]
        noisy = _noisy(T_a, inputs.action_condition_rows)
        seq = torch.arange(cur, cur + T_a)
        extra.update(action_noisy_frames=noisy, action_sequence_indexes=seq, action_mse_loss_indexes=seq[noisy])
        pos.append(segment_position_ids(T_a, 1, 1, off, fps=inputs.fps_vision if fps_mod else None,
                                        tcf=1, base_tcf=cfg.vae_temporal_compression, start=1, **seg))
        cur += T_a

    position_ids = torch.cat([q.to(torch.float32 if fps_mod else torch.int64) for q in pos], dim=1)
    return PackedLayout(
        text_len=L_text, seq_len=cur, temporal_offset=off, position_ids=position_ids,
        vision_grid=(T, h, w), vision_latent_hw=(H, W), vision_noisy_frames=vis_noisy,
        vision_sequence_indexes=vis_seq, vision_mse_loss_indexes=vis_mse, **extra,
    )


def timestep_embedding_rows(layout: PackedLayout) -> torch.Tensor:
    """Joint-sequence positions whose token receives the timestep embedding: noisy vision frames, noisy
    sound frames, and noisy action rows (none when no action row is noisy). Never text, never a
    conditioned frame. (Module-level so a negative-control test can plant a fault here.)"""
    rows = [layout.vision_mse_loss_indexes]
    if layout.sound_mse_loss_indexes is not None:
        rows.append(layout.sound_mse_loss_indexes)
    if layout.action_mse_loss_indexes is not None and layout.action_mse_loss_indexes.numel() > 0:
        rows.append(layout.action_mse_loss_indexes)
    return torch.cat(rows)


# ------------------------------------------------------------------------------------------------
# Batch geometry: everything host-side about a batch's layout, built once per layout and kept on the device
# ------------------------------------------------------------------------------------------------

# Shape buckets of the gen stream (the padded batch the step body runs on): per-sample text keys padded to a
# multiple of 16, gen tokens to a multiple of 64 (a 960-token 720p-class sample is exactly one bucket).
COSMOS3_BUCKETS = ShapeBuckets(multiple={"text": 16, "gen": 64})
# AR decode steps: batch rows to a power of two up to 32, context blocks to 4 / 8 / 16 / 32, then multiples of 32
AR_DECODE_BUCKETS = ShapeBuckets(edges={"batch": (1, 2, 4, 8, 16, 32), "blocks": (4, 8, 16, 32)},
                                 multiple={"batch": 32, "blocks": 32})


def sample_signature(x: Cosmos3ForwardInputs) -> tuple:
    """Everything `pack_layout` reads from one sample (two samples with equal signatures pack identically)."""
    snd = None if x.sound_latents is None else tuple(x.sound_latents.shape)
    act = None if x.action_latents is None else tuple(x.action_latents.shape)
    return (x.text_ids.numel(), tuple(x.vision_latents.shape), tuple(x.vision_condition_frames), float(x.fps_vision),
            snd, None if snd is None else x.fps_sound, act, tuple(x.action_condition_rows))


@dataclass(frozen=True)
class BatchGeometry:
    """The padded gen-stream layout of one batch: sample s owns flat rows [s*N, s*N + gen_len[s]) of a [B*N, D]
    stream and keys [text (padded to T) | gen (padded to N)]. Every tensor is on the model's device."""

    layouts: tuple[PackedLayout, ...]
    batch: int
    text_pad: int                       # T
    gen_pad: int                        # N
    key_mask: torch.Tensor              # [B, 1, 1, T + N] bool: real keys
    cos: torch.Tensor                   # [B*N, head_dim] gen-token RoPE (pad rows: position 0)
    sin: torch.Tensor
    timestep_mask: torch.Tensor         # [B, N, 1]: 1 on rows that receive the timestep embedding
    vision_rows: torch.Tensor           # flat rows of every sample's vision tokens, in sample order
    sound_rows: torch.Tensor | None
    vision_out_rows: torch.Tensor       # flat rows of the predicted (noisy) vision tokens, in sample order
    sound_out_rows: torch.Tensor | None
    action_rows: tuple[torch.Tensor | None, ...]      # per sample: flat rows of its action tokens
    action_out_rows: tuple[torch.Tensor | None, ...]  # per sample: flat rows of its noisy action tokens
    noisy_frames: tuple[torch.Tensor, ...]            # per sample: vision noisy frame ids (device)
    sound_noisy: tuple[torch.Tensor | None, ...]
    action_noisy: tuple[torch.Tensor | None, ...]

    @property
    def bucket(self) -> str:
        return f"B={self.batch};text={self.text_pad};gen={self.gen_pad}"

    def rows(self, s: int) -> tuple[int, int]:
        """Flat rows of sample s's real gen tokens."""
        a = s * self.gen_pad
        return a, a + self.layouts[s].gen_len


def real_key_lengths(layouts: Sequence[PackedLayout], text_pad: int, gen_pad: int) -> list[tuple[int, int]]:
    """(text, gen) real key counts per sample: every key past them in the bucket is pad and masked out (a declared
    seam: the pad-not-masked negative control in parity/ patches it to return the padded sizes)."""
    return [(lay.text_len, lay.gen_len) for lay in layouts]


def build_geometry(layouts: list[PackedLayout], buckets: ShapeBuckets, rope: Callable, device: torch.device,
                   dtype: torch.dtype) -> BatchGeometry:
    """`rope(position_ids [3, n]) -> (cos, sin)`."""
    from optimized.attention import key_padding_mask

    B = len(layouts)
    T = buckets.pad("text", max(l.text_len for l in layouts))
    N = buckets.pad("gen", max(l.gen_len for l in layouts))
    pos = torch.zeros(3, B * N, dtype=layouts[0].position_ids.dtype)
    tmask = torch.zeros(B, N, 1)
    vis, snd, vis_out, snd_out, act, act_out = [], [], [], [], [], []
    for s, lay in enumerate(layouts):
        base, L = s * N, lay.text_len
        pos[:, base:base + lay.gen_len] = lay.position_ids[:, L:]
        tmask[s, timestep_embedding_rows(lay).cpu() - L] = 1.0
        nv, ns, na = lay.num_vision_tokens, lay.num_sound_tokens, lay.num_action_tokens
        vis.append(torch.arange(base, base + nv))
        vis_out.append(lay.vision_mse_loss_indexes - L + base)
        if ns:
            snd.append(torch.arange(base + nv, base + nv + ns))
            snd_out.append(lay.sound_mse_loss_indexes - L + base)
        act.append(torch.arange(base + nv + ns, base + nv + ns + na).to(device) if na else None)
        has_out = lay.action_mse_loss_indexes is not None and lay.action_mse_loss_indexes.numel() > 0
        act_out.append((lay.action_mse_loss_indexes - L + base).to(device) if has_out else None)
    lengths = real_key_lengths(layouts, T, N)
    cos, sin = rope(pos)
    dev = lambda t: t.to(device)  # noqa: E731
    return BatchGeometry(
        layouts=tuple(layouts), batch=B, text_pad=T, gen_pad=N, key_mask=key_padding_mask(lengths, T, N, device),
        cos=cos, sin=sin, timestep_mask=tmask.to(device, dtype), vision_rows=dev(torch.cat(vis)),
        sound_rows=dev(torch.cat(snd)) if snd else None, vision_out_rows=dev(torch.cat(vis_out)),
        sound_out_rows=dev(torch.cat(snd_out)) if snd_out else None, action_rows=tuple(act),
        action_out_rows=tuple(act_out), noisy_frames=tuple(dev(l.vision_noisy_frames) for l in layouts),
        sound_noisy=tuple(None if l.sound_noisy_frames is None else dev(l.sound_noisy_frames) for l in layouts),
        action_noisy=tuple(None if l.action_noisy_frames is None else dev(l.action_noisy_frames) for l in layouts))
