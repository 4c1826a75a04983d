"""Wan 2.1 I2V's CLIP image encoder on the v2 runtime: pixels -> the penultimate layer's hidden states (what
WanImageToVideoPipeline feeds the DiT's image branch), batched, with an embedding cache keyed by image content.

Load transforms (`clip_component`): per layer q / k / v fused row-wise into `self_attn.qkv` (one projection), every
other key cast to the run dtype. The last encoder layer and `post_layernorm` never reach the pipeline's output, so
they are declared `drop` (checked, not loaded). The processor (`CLIPPixels`) resizes with PIL's
bicubic filter (the library upstream uses) and crops / rescales / normalises in torch.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

from manifests.wan.clip import CLIPImageProcessorConfig, CLIPVisionConfig, clip_vision_key_shapes
from optimized.attention import attend
from optimized.runtime.spec import ComponentSpec, LoadTransform, apply_load_transforms

IMAGE_ENCODER = "image_encoder"


def used_layers(cfg: CLIPVisionConfig) -> int:
    """Layers the pipeline's output depends on: all but the last (it reads hidden_states[-2])."""
    return cfg.num_layers - 1


def clip_component(cfg: CLIPVisionConfig) -> ComponentSpec:
    shapes = clip_vision_key_shapes(cfg)
    unused = ("post_layernorm.", f"encoder.layers.{cfg.num_layers - 1}.")   # after the layer the pipeline reads
    transforms, fused = [], set()
    for i in range(used_layers(cfg)):
        p = f"encoder.layers.{i}.self_attn"
        for part in ("weight", "bias"):
            src = tuple(f"{p}.{n}_proj.{part}" for n in "qkv")
            transforms.append(LoadTransform(f"fuse.{p}.qkv.{part}", src, f"{p}.qkv.{part}", "fuse_rows"))
            fused.update(src)
    for k in shapes:
        if k in fused:
            continue
        transforms.append(LoadTransform(f"drop.{k}", (k,), f"<dropped>:{k}", "drop") if k.startswith(unused) else
                          LoadTransform(f"cast.{k}", (k,), k, "cast"))
    return ComponentSpec(IMAGE_ENCODER, "clip_vision", tuple(shapes.items()), tuple(transforms)).validate()


class CLIPVisionFast:
    def __init__(self, cfg: CLIPVisionConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                 dtype: torch.dtype = torch.float32, cache_size: int = 64):
        self.cfg, self.device, self.dtype = cfg.validate(), torch.device(device), dtype
        self.component = clip_component(cfg)
        self.params = apply_load_transforms(self.component, state, dtype=dtype, device=self.device)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_size, self.forward_calls = cache_size, 0

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        P = self.params
        return F.layer_norm(x, x.shape[-1:], P[f"{name}.weight"], P[f"{name}.bias"], self.cfg.layer_norm_eps)

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, trace=None) -> torch.Tensor:
        """pixels [B, 3, S, S] -> [B, 1 + (S/p)^2, D], the output of layer L-2 (the pipeline's hidden_states[-2])."""
        c, P = self.cfg, self.params
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (c.num_channels, c.image_size, c.image_size):
            raise ValueError(f"CLIP vision: pixels must be [B, {c.num_channels}, {c.image_size}, {c.image_size}], "
                             f"got {list(pixels.shape)}")
        x = pixels.to(self.device, self.dtype)
        B, H, d = x.shape[0], c.num_heads, c.head_dim
        patches = F.conv2d(x, P["embeddings.patch_embedding.weight"], stride=c.patch_size).flatten(2).transpose(1, 2)
        cls = P["embeddings.class_embedding"].view(1, 1, -1).expand(B, 1, -1)
        h = self._ln(torch.cat([cls, patches], 1) + P["embeddings.position_embedding.weight"], "pre_layrnorm")
        N = h.shape[1]
        for i in range(used_layers(c)):
            p = f"encoder.layers.{i}"
            qkv = F.linear(self._ln(h, f"{p}.layer_norm1"), P[f"{p}.self_attn.qkv.weight"], P[f"{p}.self_attn.qkv.bias"])
            q, k, v = qkv.view(B, N, 3, H, d).permute(2, 0, 3, 1, 4)
            a = attend(q, k, v).transpose(1, 2).reshape(B, N, H * d)
            h = h + F.linear(a, P[f"{p}.self_attn.out_proj.weight"], P[f"{p}.self_attn.out_proj.bias"])
            m = F.linear(self._ln(h, f"{p}.layer_norm2"), P[f"{p}.mlp.fc1.weight"], P[f"{p}.mlp.fc1.bias"])
            m = m * torch.sigmoid(1.702 * m) if c.hidden_act == "quick_gelu" else F.gelu(m)
            h = h + F.linear(m, P[f"{p}.mlp.fc2.weight"], P[f"{p}.mlp.fc2.bias"])
            if trace is not None:
                trace(p, h)
        self.forward_calls += 1
        return h

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Like `forward`, one image embedding per row, served from the content-keyed cache where seen before."""
        rows = [pixels[i:i + 1] for i in range(pixels.shape[0])]
        keys = [hashlib.sha256(r.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()).hexdigest()
                for r in rows]
        todo = [i for i, k in enumerate(keys) if k not in self._cache]
        if todo:
            out = self.forward(torch.cat([rows[i] for i in todo]))
            for j, i in enumerate(todo):
                self._cache[keys[i]] = out[j:j + 1]
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        for k in keys:
            self._cache.move_to_end(k)
        return torch.cat([self._cache[k] for k in keys])


class CLIPPixels:
    """transformers CLIPImageProcessor (PIL backend), batched over a list of images -> [B, 3, crop_h, crop_w]."""

    def __init__(self, cfg: CLIPImageProcessorConfig):
        self.cfg = cfg.validate()
        self.mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(cfg.image_std, dtype=torch.float32).view(3, 1, 1)

    def resize(self, image):
        from PIL import Image

        img = (image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, np.uint8))).convert("RGB")
        w, h = img.size
        s = self.cfg.shortest_edge
        size = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)   # (upstream) long edge truncated
        return torch.from_numpy(np.array(img.resize(size, resample=self.cfg.resample))).permute(2, 0, 1)

    def __call__(self, images) -> torch.Tensor:
        images = images if isinstance(images, (list, tuple)) else [images]
        return torch.stack([self._one(self.resize(im)) for im in images])

    def _one(self, x: torch.Tensor) -> torch.Tensor:
        ch, cw = self.cfg.crop_height, self.cfg.crop_width
        _, h, w = x.shape
        if h < ch or w < cw:   # (upstream) zero-pad a too-small image, centred with the extra row / column first
            ph, pw = max(ch, h), max(cw, w)
            top, left = (ph - h + 1) // 2, (pw - w + 1) // 2
            x = F.pad(x, (left, pw - w - left, top, ph - h - top))
            h, w = ph, pw
        top, left = (h - ch) // 2, (w - cw) // 2
        x = x[:, top:top + ch, left:left + cw]
        x = (x.to(torch.float64) * (1 / 255)).to(torch.float32)          # (upstream) rescale in float64
        return (x - self.mean) / self.std


def load_fast_clip(cfg: CLIPVisionConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> CLIPVisionFast:
    want = clip_vision_key_shapes(cfg)
    missing = sorted(set(want) - set(state))
    if missing:
        raise KeyError(f"CLIP vision state dict: missing {missing[:6]}")
    return CLIPVisionFast(cfg, state, device, dtype)
