"""Canonical seedvr2 checkpoint layouts (the reference implementation's parameter names) and their shapes.

NaDiT canonical names are the official names with one exception: the per-block RoPE frequency buffer,
stored upstream as `blocks.<i>.attn.rope.rope.freqs`, is canonical `blocks.<i>.attn.rope.freqs`.
VAE canonical names are the official names unchanged.
"""

from __future__ import annotations

from manifests.seedvr2.config import TIME_FREQ_DIM, NaDiTConfig, VAEConfig

UPSTREAM_ROPE_SUFFIX = ".attn.rope.rope.freqs"
CANONICAL_ROPE_SUFFIX = ".attn.rope.freqs"
ADA_PARAMS = tuple(f"{layer}_{g}" for layer in ("attn", "mlp") for g in ("shift", "scale", "gate"))


def nadit_key_shapes(cfg: NaDiTConfig) -> dict[str, tuple[int, ...]]:
    D, d, F = cfg.dim, cfg.head_dim, cfg.mlp_hidden
    s: dict[str, tuple[int, ...]] = {
        "vid_in.proj.weight": (D, cfg.patch_features), "vid_in.proj.bias": (D,),
        "txt_in.weight": (D, cfg.txt_in_dim), "txt_in.bias": (D,),
        "emb_in.proj_in.weight": (D, TIME_FREQ_DIM), "emb_in.proj_in.bias": (D,),
        "emb_in.proj_hid.weight": (D, D), "emb_in.proj_hid.bias": (D,),
        "emb_in.proj_out.weight": (cfg.emb_dim, D), "emb_in.proj_out.bias": (cfg.emb_dim,),
    }
    for i in range(cfg.num_layers):
        p = f"blocks.{i}."
        for b in sorted(set(cfg.branch(i))):
            s[f"{p}attn.proj_qkv.{b}.weight"] = (3 * D, D)
            s[f"{p}attn.proj_out.{b}.weight"] = (D, D)
            s[f"{p}attn.proj_out.{b}.bias"] = (D,)
            s[f"{p}attn.norm_q.{b}.weight"] = (d,)
            s[f"{p}attn.norm_k.{b}.weight"] = (d,)
            if cfg.is_3b:
                for m in ("proj_in_gate", "proj_in"):
                    s[f"{p}mlp.{b}.{m}.weight"] = (F, D)
                s[f"{p}mlp.{b}.proj_out.weight"] = (D, F)
            else:
                s[f"{p}mlp.{b}.proj_in.weight"] = (F, D)
                s[f"{p}mlp.{b}.proj_in.bias"] = (F,)
                s[f"{p}mlp.{b}.proj_out.weight"] = (D, F)
                s[f"{p}mlp.{b}.proj_out.bias"] = (D,)
            for a in ADA_PARAMS:
                s[f"{p}ada.{b}.{a}"] = (D,)
        s[f"blocks.{i}{CANONICAL_ROPE_SUFFIX}"] = (cfg.rope_num_freqs,)
    if cfg.is_3b:
        s["vid_out_norm.weight"] = (D,)
        s["vid_out_ada.out_shift"] = (D,)
        s["vid_out_ada.out_scale"] = (D,)
    s["vid_out.proj.weight"] = (cfg.out_features, D)
    s["vid_out.proj.bias"] = (cfg.out_features,)
    return s


def nadit_buffer_keys(cfg: NaDiTConfig) -> list[str]:
    """Deterministic buffers stored in the checkpoint (not learned): the rope frequencies."""
    return [f"blocks.{i}{CANONICAL_ROPE_SUFFIX}" for i in range(cfg.num_layers)]


def _resnet(s: dict, p: str, cin: int, cout: int) -> None:
    s[f"{p}norm1.weight"] = s[f"{p}norm1.bias"] = (cin,)
    s[f"{p}conv1.weight"] = (cout, cin, 3, 3, 3)
    s[f"{p}conv1.bias"] = (cout,)
    s[f"{p}norm2.weight"] = s[f"{p}norm2.bias"] = (cout,)
    s[f"{p}conv2.weight"] = (cout, cout, 3, 3, 3)
    s[f"{p}conv2.bias"] = (cout,)
    if cin != cout:
        s[f"{p}conv_shortcut.weight"] = (cout, cin, 1, 1, 1)
        s[f"{p}conv_shortcut.bias"] = (cout,)


def _mid(s: dict, p: str, c: int) -> None:
    _resnet(s, f"{p}resnets.0.", c, c)
    a = f"{p}attentions.0."
    s[f"{a}group_norm.weight"] = s[f"{a}group_norm.bias"] = (c,)
    for m in ("to_q", "to_k", "to_v", "to_out.0"):
        s[f"{a}{m}.weight"] = (c, c)
        s[f"{a}{m}.bias"] = (c,)
    _resnet(s, f"{p}resnets.1.", c, c)


def vae_temporal_down(cfg: VAEConfig, block: int) -> bool:
    """Encoder blocks 1..temporal_scale_num also halve time (block 0 is spatial only, the last has no downsampler)."""
    return 1 <= block <= cfg.temporal_scale_num


def vae_temporal_up(cfg: VAEConfig, block: int) -> bool:
    """Decoder blocks 0..temporal_scale_num-1 also double time."""
    return block < cfg.temporal_scale_num


def vae_key_shapes(cfg: VAEConfig) -> dict[str, tuple[int, ...]]:
    ch = cfg.block_out_channels
    n = len(ch)
    s: dict[str, tuple[int, ...]] = {"encoder.conv_in.weight": (ch[0], cfg.in_channels, 3, 3, 3),
                                     "encoder.conv_in.bias": (ch[0],)}
    cin = ch[0]
    for b, cout in enumerate(ch):
        for r in range(cfg.layers_per_block):
            _resnet(s, f"encoder.down_blocks.{b}.resnets.{r}.", cin if r == 0 else cout, cout)
        if b < n - 1:
            kt = 3 if vae_temporal_down(cfg, b) else 1
            s[f"encoder.down_blocks.{b}.downsamplers.0.conv.weight"] = (cout, cout, kt, 3, 3)
            s[f"encoder.down_blocks.{b}.downsamplers.0.conv.bias"] = (cout,)
        cin = cout
    _mid(s, "encoder.mid_block.", ch[-1])
    s["encoder.conv_norm_out.weight"] = s["encoder.conv_norm_out.bias"] = (ch[-1],)
    s["encoder.conv_out.weight"] = (2 * cfg.latent_channels, ch[-1], 3, 3, 3)
    s["encoder.conv_out.bias"] = (2 * cfg.latent_channels,)

    rev = ch[::-1]
    s["decoder.conv_in.weight"] = (rev[0], cfg.latent_channels, 3, 3, 3)
    s["decoder.conv_in.bias"] = (rev[0],)
    cin = rev[0]
    for b, cout in enumerate(rev):
        for r in range(cfg.layers_per_block + 1):
            _resnet(s, f"decoder.up_blocks.{b}.resnets.{r}.", cin if r == 0 else cout, cout)
        if b < n - 1:
            factor = 8 if vae_temporal_up(cfg, b) else 4
            u = f"decoder.up_blocks.{b}.upsamplers.0."
            s[f"{u}upscale_conv.weight"] = (cout * factor, cout, 1, 1, 1)
            s[f"{u}upscale_conv.bias"] = (cout * factor,)
            s[f"{u}conv.weight"] = (cout, cout, 3, 3, 3)
            s[f"{u}conv.bias"] = (cout,)
        cin = cout
    _mid(s, "decoder.mid_block.", rev[0])
    s["decoder.conv_norm_out.weight"] = s["decoder.conv_norm_out.bias"] = (rev[-1],)
    s["decoder.conv_out.weight"] = (cfg.in_channels, rev[-1], 3, 3, 3)
    s["decoder.conv_out.bias"] = (cfg.in_channels,)
    return s


def nadit_fp32_keys(cfg: NaDiTConfig) -> list[str]:
    """Kept float32 whatever the run dtype: rope frequencies and the time embedding (multiplied by t = 1000)."""
    return [k for k in nadit_key_shapes(cfg) if k.endswith(CANONICAL_ROPE_SUFFIX) or k.startswith("emb_in.")]
