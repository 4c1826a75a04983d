"""Build the packed sequence of one cosmos3 sample: [text | vision | sound | action].

Reproduces `Cosmos3OmniPipeline._prepare_{text,vision,sound,action}_segment` (diffusers 0.42.1):
which token sits where, which tokens are noisy, and the 3-axis mRoPE position ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.io import Cosmos3ForwardInputs


@dataclass
class PackedSample:
    text_len: int                                  # und_len: the causal text prefix
    seq_len: int
    position_ids: torch.Tensor                     # [3, seq_len]; float32 with fps modulation, else int64
    vision_grid: tuple[int, int, int]              # (T, h, w) on the patch grid
    vision_noisy_frames: list[int]
    vision_sequence_indexes: torch.Tensor
    vision_mse_loss_indexes: torch.Tensor          # tokens whose prediction is read out (noisy frames)
    sound_len: int = 0
    sound_sequence_indexes: torch.Tensor | None = None
    sound_mse_loss_indexes: torch.Tensor | None = None
    action_len: int = 0
    action_noisy_rows: list[int] | None = None
    action_sequence_indexes: torch.Tensor | None = None
    action_mse_loss_indexes: torch.Tensor | None = None


def text_position_ids(cfg: Cosmos3Config, n: int) -> torch.Tensor:
    # text positions are float whenever fps modulation is on (upstream quirk: even though they are integers)
    ids = torch.arange(n, dtype=torch.float32 if cfg.enable_fps_modulation else torch.long)
    return ids.unsqueeze(0).expand(3, n).contiguous()


def grid_position_ids(cfg: Cosmos3Config, t: int, h: int, w: int, offset: float, fps: float | None,
                      tcf: int, base_tcf: int, start_frame: int) -> torch.Tensor:
    """mRoPE ids [3, t*h*w] for a (t, h, w) token grid starting at temporal `offset`.

    With fps modulation (and t > 1) frame i sits at (i + start) / (fps / tcf) * (base_fps / base_tcf) + offset,
    so one second of content spans the same positions at any fps. Single images are never modulated.
    """
    modulated = cfg.enable_fps_modulation and fps is not None and t > 1
    frames = torch.arange(t, dtype=torch.float32 if modulated else torch.long)
    if modulated:
        t_ids = (frames + start_frame) / (fps / tcf) * (cfg.base_fps / base_tcf) + offset
    else:
        t_ids = frames + int(offset) + start_frame  # upstream truncates a float offset here
    t_ids = t_ids.view(t, 1, 1).expand(t, h, w).flatten()
    h_ids = torch.arange(h).view(1, h, 1).expand(t, h, w).flatten()
    w_ids = torch.arange(w).view(1, 1, w).expand(t, h, w).flatten()
    if not cfg.reset_spatial_ids:
        h_ids, w_ids = h_ids + int(offset), w_ids + int(offset)
    if modulated:
        h_ids, w_ids = h_ids.float(), w_ids.float()
    return torch.stack([t_ids, h_ids, w_ids])


def pack_sample(cfg: Cosmos3Config, inp: Cosmos3ForwardInputs) -> PackedSample:
    text_len = inp.text_ids.numel()
    # vision, sound and action are temporal siblings: all three start at the same offset
    offset = text_len + cfg.temporal_modality_margin
    position_parts = [text_position_ids(cfg, text_len)]
    cursor = text_len

    # vision: grid on patches (H, W padded up to the patch size)
    _, _, T, H, W = inp.vision_latents.shape
    h, w = math.ceil(H / cfg.patch_size), math.ceil(W / cfg.patch_size)
    noisy = [f for f in range(T) if f not in set(inp.vision_condition_frames)]
    vision_idx = torch.arange(cursor, cursor + T * h * w)
    vision_mse = torch.tensor([cursor + f * h * w + j for f in noisy for j in range(h * w)], dtype=torch.long)
    position_parts.append(grid_position_ids(cfg, T, h, w, offset, inp.fps_vision,
                                            tcf=cfg.vae_temporal_compression,
                                            base_tcf=cfg.vae_temporal_compression, start_frame=0))
    cursor += T * h * w
    packed = PackedSample(text_len=text_len, seq_len=0, position_ids=torch.empty(0), vision_grid=(T, h, w),
                          vision_noisy_frames=noisy, vision_sequence_indexes=vision_idx,
                          vision_mse_loss_indexes=vision_mse)

    if inp.sound_latents is not None:  # every sound frame is noisy; 1 frame = 1 token
        n = inp.sound_latents.shape[1]
        packed.sound_len = n
        packed.sound_sequence_indexes = torch.arange(cursor, cursor + n)
        packed.sound_mse_loss_indexes = packed.sound_sequence_indexes.clone()
        position_parts.append(grid_position_ids(cfg, n, 1, 1, offset, inp.fps_sound, tcf=1, base_tcf=1,
                                                start_frame=0))
        cursor += n

    if inp.action_latents is not None:
        n = inp.action_latents.shape[0]
        rows = [r for r in range(n) if r not in set(inp.action_condition_rows)]
        packed.action_len = n
        packed.action_noisy_rows = rows
        packed.action_sequence_indexes = torch.arange(cursor, cursor + n)
        packed.action_mse_loss_indexes = packed.action_sequence_indexes[torch.tensor(rows, dtype=torch.long)]
        # actions use the vision fps with base tcf 4 and start at frame 1: the first action sits 6/fps after `offset`
        position_parts.append(grid_position_ids(cfg, n, 1, 1, offset, inp.fps_vision, tcf=1,
                                                base_tcf=cfg.vae_temporal_compression, start_frame=1))
        cursor += n

    packed.seq_len = cursor
    dtypes = {p.dtype for p in position_parts}
    # a mix of float (modulated) and int (unmodulated, e.g. an image) segments promotes to float32 as in torch.cat
    packed.position_ids = torch.cat([p.float() if torch.float32 in dtypes else p for p in position_parts], dim=1)
    return packed
