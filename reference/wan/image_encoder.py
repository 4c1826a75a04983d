"""Wan 2.1 I2V's image encoder, reproducing transformers `CLIPVisionModel` + `CLIPImageProcessor` (PIL backend) as
WanImageToVideoPipeline uses them: `hidden_states[-2]`, the output of the penultimate encoder layer.

    pixels = normalise(crop(resize(RGB image)))               the processor (below): [1, 3, S, S] float32
    h = [class | patches(pixels)] + position embedding        patches: a stride-p convolution, no bias
    h = LayerNorm(h)                                          `pre_layrnorm` (upstream's spelling)
    per layer:
        h += out(Attn(q(n), k(n), v(n)))                      n = LayerNorm1(h); scores scaled by 1/sqrt(head_dim)
        h += fc2(act(fc1(LayerNorm2(h))))                     act: exact GELU (Wan) or quick GELU
    image_embeds = h after layer L-2 (0-based)                the last layer's output and `post_layernorm` unused

Parameter names ARE the canonical layout (`manifests.wan.clip.clip_vision_key_shapes`, = transformers' 5.x names).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from manifests.wan.clip import CLIPImageProcessorConfig, CLIPVisionConfig, clip_vision_key_shapes


class CLIPEmbeddings(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        D = cfg.hidden_size
        self.class_embedding = nn.Parameter(torch.zeros(D))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, D, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.position_embedding = nn.Embedding(cfg.num_tokens, D)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))   # [B, D, S/p, S/p]
        patches = patches.flatten(2).transpose(1, 2)                                     # [B, N, D], row-major
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        D = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)                 # scale 1/sqrt(head_dim), no mask
        return self.out_proj(out.transpose(1, 2).reshape(B, N, D))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.quick = cfg.hidden_act == "quick_gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h * torch.sigmoid(1.702 * h) if self.quick else F.gelu(h)   # transformers QuickGELU / exact GELU
        return self.fc2(h)


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h))
        return h + self.mlp(self.layer_norm2(h))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(cfg.num_layers))


class CLIPVisionEncoder(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.embeddings = CLIPEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = CLIPEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)   # pooled output only

    def hidden_states(self, pixels: torch.Tensor, trace=None) -> list[torch.Tensor]:
        """transformers' `hidden_states`: [after pre_layrnorm, after layer 0, ..., after layer L-1]."""
        h = self.pre_layrnorm(self.embeddings(pixels))
        out = [h]
        for i, layer in enumerate(self.encoder.layers):
            h = layer(h)
            out.append(h)
            if trace is not None:
                trace(f"encoder.layers.{i}", h)
        return out

    def forward(self, pixels: torch.Tensor, trace=None) -> torch.Tensor:
        """pixels [B, 3, S, S] -> image_embeds [B, 1 + (S/p)^2, D]: hidden_states[-2] (WanImageToVideoPipeline)."""
        c = self.cfg
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (c.num_channels, c.image_size, c.image_size):
            raise ValueError(f"CLIP vision: pixels must be [B, {c.num_channels}, {c.image_size}, {c.image_size}], "
                             f"got {list(pixels.shape)}")
        return self.hidden_states(pixels, trace)[-2]   # (upstream) the penultimate layer, no post_layernorm


def load_clip_vision(cfg: CLIPVisionConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                     dtype: torch.dtype = torch.float32) -> CLIPVisionEncoder:
    want = clip_vision_key_shapes(cfg)
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise KeyError(f"CLIP vision state dict: missing {missing[:6]}, unexpected {unexpected[:6]}")
    model = CLIPVisionEncoder(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def preprocess_image(image, cfg: CLIPImageProcessorConfig) -> torch.Tensor:
    """A PIL image (or uint8 array [H, W, 3]) -> pixel_values [1, 3, crop_h, crop_w] float32, as transformers'
    CLIPImageProcessor (PIL backend) computes them."""
    from PIL import Image

    img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, dtype=np.uint8))
    img = img.convert("RGB")
    w, h = img.size
    if w <= h:   # (upstream) the long edge truncated: int(size * long / short)
        new_w, new_h = cfg.shortest_edge, int(cfg.shortest_edge * h / w)
    else:
        new_w, new_h = int(cfg.shortest_edge * w / h), cfg.shortest_edge
    x = np.array(img.resize((new_w, new_h), resample=cfg.resample))          # uint8 [H, W, 3], PIL bicubic
    ch, cw = cfg.crop_height, cfg.crop_width
    if new_h < ch or new_w < cw:   # (upstream) a crop larger than the image zero-pads it, centred (ceil)
        ph, pw = max(ch, new_h), max(cw, new_w)
        padded = np.zeros((ph, pw, 3), dtype=x.dtype)
        top, left = -(-(ph - new_h) // 2), -(-(pw - new_w) // 2)
        padded[top:top + new_h, left:left + new_w] = x
        x, new_h, new_w = padded, ph, pw
    top, left = (new_h - ch) // 2, (new_w - cw) // 2
    x = x[top:top + ch, left:left + cw]
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)                 # (upstream) rescale in float64
    x = (x - np.array(cfg.image_mean, dtype=np.float32)) / np.array(cfg.image_std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))[None]
