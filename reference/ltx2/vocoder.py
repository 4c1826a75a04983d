"""ltx2 reference vocoder: diffusers 0.42.1 `LTX2Vocoder` (pipelines/ltx2/vocoder.py), LTX-2.0's HiFi-GAN
(leaky ReLU, no anti-aliasing), read top to bottom: `vocode(mel [B, C, T, F]) -> waveform [B, out, T * r]`."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from manifests.ltx2.vocoder import Ltx2VocoderConfig, vocoder_key_shapes
from reference.ltx2.model import _tree

OUT_SLOPE = 0.01   # upstream's act_out is nn.LeakyReLU() with torch's default slope, not the config's 0.1


def resblock(block: nn.Module, x: torch.Tensor, dilations, slope: float) -> torch.Tensor:
    """HiFi-GAN ResBlock1: per dilation d, x += conv_1(lrelu(conv_d(lrelu(x)))); convs pad 'same'."""
    for m, d in enumerate(dilations):
        c1, c2 = block.convs1[m], block.convs2[m]
        h = F.conv1d(F.leaky_relu(x, slope), c1.weight, c1.bias, dilation=d, padding="same")
        h = F.conv1d(F.leaky_relu(h, slope), c2.weight, c2.bias, padding="same")
        x = x + h
    return x


class Ltx2Vocoder(nn.Module):
    def __init__(self, cfg: Ltx2VocoderConfig):
        super().__init__()
        self.cfg = cfg.validate()
        _tree(self, vocoder_key_shapes(cfg))

    def vocode(self, mel: torch.Tensor, time_last: bool = False, trace=None) -> torch.Tensor:
        c = self.cfg
        record = trace or (lambda name, t: None)
        if not time_last:
            mel = mel.transpose(2, 3)                       # [B, C, F, T]
        x = mel.flatten(1, 2)                               # [B, C * F, T], channel-major
        x = F.conv1d(x, self.conv_in.weight, self.conv_in.bias, padding=3)
        record("conv_in", x)
        n_res = len(c.resnet_kernel_sizes)
        for i, (k, stride) in enumerate(zip(c.upsample_kernel_sizes, c.upsample_factors)):
            up = self.upsamplers[i]
            x = F.conv_transpose1d(F.leaky_relu(x, c.leaky_relu_negative_slope), up.weight, up.bias, stride=stride,
                                   padding=(k - stride) // 2)
            record(f"upsamplers.{i}", x)
            outs = [resblock(self.resnets[i * n_res + j], x, c.resnet_dilations[j], c.leaky_relu_negative_slope)
                    for j in range(n_res)]
            x = torch.stack(outs).mean(0)
            record(f"resnets.{i * n_res + n_res - 1}", x)   # the stage's output, after the mean
        x = F.conv1d(F.leaky_relu(x, OUT_SLOPE), self.conv_out.weight,
                     self.conv_out.bias if c.final_bias else None, padding=3)
        record("conv_out", x)
        if c.final_act_fn == "tanh":
            return torch.tanh(x)
        if c.final_act_fn == "clamp":
            return x.clamp(-1, 1)
        return x

    def forward(self, mel: torch.Tensor, trace=None) -> torch.Tensor:
        return self.vocode(mel, trace=trace)


def load_vocoder(cfg: Ltx2VocoderConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> Ltx2Vocoder:
    model = Ltx2Vocoder(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device, dtype).eval()
