"""ltx2 fast vocoder: diffusers 0.42.1 `LTX2Vocoder` (LTX-2.0: leaky ReLU, no anti-aliasing) on the runtime path,
written independently of reference/. Weights: a flat dict of canonical names (manifests/ltx2/vocoder.py). The
parallel resblocks of a stage share one activated input per dilation step where they can (in-place adds, the
mean as one running sum); `trace` under the reference's names."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from manifests.ltx2.vocoder import Ltx2VocoderConfig, vocoder_key_shapes
from optimized.runtime.spec import ComponentSpec, LoadTransform, apply_load_transforms


def vocoder_component(cfg: Ltx2VocoderConfig) -> ComponentSpec:
    shapes = vocoder_key_shapes(cfg)
    return ComponentSpec("vocoder", "ltx2_vocoder", tuple(shapes.items()), tuple(
        LoadTransform(f"cast.{k}", (k,), k, "cast") for k in shapes)).validate()


class FastLtx2Vocoder:
    def __init__(self, cfg: Ltx2VocoderConfig, params: dict[str, torch.Tensor], dtype: torch.dtype):
        self.cfg, self.p, self.dtype = cfg.validate(), params, dtype

    def _resblock(self, name: str, x: torch.Tensor, dilations) -> torch.Tensor:
        P, s = self.p, self.cfg.leaky_relu_negative_slope
        for m, d in enumerate(dilations):
            h = F.conv1d(F.leaky_relu(x, s), P[f"{name}.convs1.{m}.weight"], P[f"{name}.convs1.{m}.bias"],
                         dilation=d, padding="same")
            x = x + F.conv1d(F.leaky_relu(h, s), P[f"{name}.convs2.{m}.weight"], P[f"{name}.convs2.{m}.bias"],
                             padding="same")
        return x

    def vocode(self, mel: torch.Tensor, time_last: bool = False, trace=None) -> torch.Tensor:
        c, P = self.cfg, self.p
        emit = trace or (lambda n, t: None)
        x = (mel if time_last else mel.transpose(2, 3)).flatten(1, 2)
        x = F.conv1d(x, P["conv_in.weight"], P["conv_in.bias"], padding=3)
        emit("conv_in", x)
        n_res = len(c.resnet_kernel_sizes)
        for i, (k, stride) in enumerate(zip(c.upsample_kernel_sizes, c.upsample_factors)):
            x = F.conv_transpose1d(F.leaky_relu(x, c.leaky_relu_negative_slope), P[f"upsamplers.{i}.weight"],
                                   P[f"upsamplers.{i}.bias"], stride=stride, padding=(k - stride) // 2)
            emit(f"upsamplers.{i}", x)
            acc = None
            for j in range(n_res):
                y = self._resblock(f"resnets.{i * n_res + j}", x, c.resnet_dilations[j])
                acc = y if acc is None else acc.add_(y)
            x = acc.div_(n_res)
            emit(f"resnets.{i * n_res + n_res - 1}", x)
        x = F.conv1d(F.leaky_relu(x, 0.01), P["conv_out.weight"], P.get("conv_out.bias"), padding=3)
        emit("conv_out", x)
        if c.final_act_fn == "tanh":
            return torch.tanh(x)
        return x.clamp(-1, 1) if c.final_act_fn == "clamp" else x

    def __call__(self, mel: torch.Tensor, trace=None) -> torch.Tensor:
        return self.vocode(mel, trace=trace)


def load_vocoder(cfg: Ltx2VocoderConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> FastLtx2Vocoder:
    """Strict: the canonical state dict must match the ComponentSpec exactly (names, shapes)."""
    return FastLtx2Vocoder(cfg, apply_load_transforms(vocoder_component(cfg), state, dtype=dtype, device=device), dtype)
