"""The canonical Wan VAE checkpoint layout: every key and its shape, as a function of the config.

Canonical names are the reference implementation's parameter names, which are diffusers' `AutoencoderKLWan`
names and shapes unchanged (so the diffusers format maps 1:1, identity). The layout, per part:

    encoder.conv_in / conv_out, decoder.conv_in / conv_out       causal 3D convs, weight [out, in, 3, 3, 3] + bias
    {enc,dec}oder.norm_out.gamma                                 RMS-norm scale [C, 1, 1, 1]
    *.resnets.{r} / 2.1 encoder.down_blocks.{j}                  residual block: norm1.gamma, conv1, norm2.gamma,
                                                                 conv2 (+ conv_shortcut [out, in, 1, 1, 1] if in != out)
    *.mid_block.{resnets.0, attentions.0, resnets.1}             attention: norm.gamma [C,1,1], to_qkv [3C,C,1,1], proj
    *.resample.1.{weight,bias}                                   the 2D conv of a spatial resample [out, in, 3, 3]
    *.time_conv.{weight,bias}                                    temporal conv of a 3D resample [out, in, 3, 1, 1]
    quant_conv [2z, 2z, 1, 1, 1], post_quant_conv [z, z, 1, 1, 1]

2.1 (`is_residual` false): `encoder.down_blocks` is one flat list (res blocks, then a resample per stage but the
last); `decoder.up_blocks.{i}.resnets` + `upsamplers.0` (its conv halves the channels, so stage i > 0 starts at
half width). 2.2: `encoder.down_blocks.{i}.{resnets, downsampler}`, `decoder.up_blocks.{i}.{resnets, upsampler}`
(parameter-free AvgDown3D / DupUp3D shortcuts).
"""

from __future__ import annotations

from manifests.wan.config import WanVAEConfig

Shapes = dict[str, tuple[int, ...]]


def _conv3d(shapes: Shapes, name: str, cin: int, cout: int, k: tuple[int, int, int] = (3, 3, 3)) -> None:
    shapes[f"{name}.weight"] = (cout, cin, *k)
    shapes[f"{name}.bias"] = (cout,)


def _resblock(shapes: Shapes, p: str, cin: int, cout: int) -> None:
    shapes[f"{p}.norm1.gamma"] = (cin, 1, 1, 1)
    _conv3d(shapes, f"{p}.conv1", cin, cout)
    shapes[f"{p}.norm2.gamma"] = (cout, 1, 1, 1)
    _conv3d(shapes, f"{p}.conv2", cout, cout)
    if cin != cout:
        _conv3d(shapes, f"{p}.conv_shortcut", cin, cout, (1, 1, 1))


def _mid(shapes: Shapes, p: str, d: int) -> None:
    _resblock(shapes, f"{p}.resnets.0", d, d)
    shapes[f"{p}.attentions.0.norm.gamma"] = (d, 1, 1)
    shapes[f"{p}.attentions.0.to_qkv.weight"] = (3 * d, d, 1, 1)
    shapes[f"{p}.attentions.0.to_qkv.bias"] = (3 * d,)
    shapes[f"{p}.attentions.0.proj.weight"] = (d, d, 1, 1)
    shapes[f"{p}.attentions.0.proj.bias"] = (d,)
    _resblock(shapes, f"{p}.resnets.1", d, d)


def _resample(shapes: Shapes, p: str, d: int, out: int, temporal: bool, up: bool) -> None:
    shapes[f"{p}.resample.1.weight"] = (out, d, 3, 3)
    shapes[f"{p}.resample.1.bias"] = (out,)
    if temporal:
        _conv3d(shapes, f"{p}.time_conv", d, 2 * d if up else d, (3, 1, 1))


def encoder_key_shapes(cfg: WanVAEConfig) -> Shapes:
    s: Shapes = {}
    dims = cfg.encoder_dims()
    last = len(cfg.dim_mult) - 1
    _conv3d(s, "encoder.conv_in", cfg.in_channels, dims[0])
    j = 0
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        down, temporal = i != last, i != last and cfg.temporal_downsample[i]
        if cfg.is_residual:
            for r in range(cfg.num_res_blocks):
                _resblock(s, f"encoder.down_blocks.{i}.resnets.{r}", cin if r == 0 else cout, cout)
            if down:
                _resample(s, f"encoder.down_blocks.{i}.downsampler", cout, cout, temporal, up=False)
        else:
            for r in range(cfg.num_res_blocks):
                _resblock(s, f"encoder.down_blocks.{j}", cin if r == 0 else cout, cout)
                j += 1
            if down:
                _resample(s, f"encoder.down_blocks.{j}", cout, cout, temporal, up=False)
                j += 1
    _mid(s, "encoder.mid_block", dims[-1])
    s["encoder.norm_out.gamma"] = (dims[-1], 1, 1, 1)
    _conv3d(s, "encoder.conv_out", dims[-1], 2 * cfg.z_dim)
    _conv3d(s, "quant_conv", 2 * cfg.z_dim, 2 * cfg.z_dim, (1, 1, 1))
    return s


def decoder_key_shapes(cfg: WanVAEConfig) -> Shapes:
    s: Shapes = {}
    dims = cfg.decoder_dims()
    last = len(cfg.dim_mult) - 1
    _conv3d(s, "post_quant_conv", cfg.z_dim, cfg.z_dim, (1, 1, 1))
    _conv3d(s, "decoder.conv_in", cfg.z_dim, dims[0])
    _mid(s, "decoder.mid_block", dims[0])
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        up, temporal = i != last, i != last and cfg.temporal_upsample[i]
        if i > 0 and not cfg.is_residual:
            cin //= 2  # 2.1: the previous stage's upsample conv halved the channels
        p = f"decoder.up_blocks.{i}"
        for r in range(cfg.num_res_blocks + 1):
            _resblock(s, f"{p}.resnets.{r}", cin if r == 0 else cout, cout)
        if up:
            if cfg.is_residual:
                _resample(s, f"{p}.upsampler", cout, cout, temporal, up=True)
            else:
                _resample(s, f"{p}.upsamplers.0", cout, cout // 2, temporal, up=True)
    s["decoder.norm_out.gamma"] = (dims[-1], 1, 1, 1)
    _conv3d(s, "decoder.conv_out", dims[-1], cfg.out_channels)
    return s


def canonical_key_shapes(cfg: WanVAEConfig) -> Shapes:
    return {**encoder_key_shapes(cfg), **decoder_key_shapes(cfg)}
