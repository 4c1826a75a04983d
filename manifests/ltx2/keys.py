"""ltx2 canonical checkpoint keys: the diffusers:LTX2VideoTransformer3DModel state-dict names unchanged (so its format converts by
identity), each shape a config expression. Fitted by `fvparity port new` (one config field doubled at a time) and
checked on the upstream default config (every key matches)."""

from __future__ import annotations

from manifests.errors import ManifestError
from manifests.ltx2.config import Ltx2Config

FP32_MODULES: tuple[str, ...] = ()  # upstream _keep_in_fp32_modules
GAINS: tuple[str, ...] = ('norm_k.weight', 'norm_q.weight')  # norm scales: the random-weight rule draws them near 1


# key-changing switches _switched() does not write (found by `fvparity port new`'s switch probe); refused by name
FITTED_SWITCHES: dict[str, bool] = {"norm_elementwise_affine": False, "attention_bias": True,
                                    "attention_out_bias": True}


def key_shapes(c: Ltx2Config) -> dict[str, tuple[int, ...]]:
    flipped = [f"{k}={getattr(c, k)}" for k, v in FITTED_SWITCHES.items() if getattr(c, k) != v]
    if flipped:
        raise ManifestError(f"ltx2 keys: {', '.join(flipped)} changes upstream's checkpoint keys and is not ported")
    inner = c.audio_num_attention_heads * c.audio_attention_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    shapes.update({
        "scale_shift_table": (2, c.num_attention_heads * c.attention_head_dim),
        "audio_scale_shift_table": (2, inner),
        "proj_in.weight": (c.num_attention_heads * c.attention_head_dim, c.in_channels),
        "proj_in.bias": (c.num_attention_heads * c.attention_head_dim,),
        "audio_proj_in.weight": (inner, c.audio_in_channels),
        "audio_proj_in.bias": (inner,),
        "caption_projection.linear_1.weight": (c.num_attention_heads * c.attention_head_dim, c.caption_channels),
        "caption_projection.linear_1.bias": (c.num_attention_heads * c.attention_head_dim,),
        "caption_projection.linear_2.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
        "caption_projection.linear_2.bias": (c.num_attention_heads * c.attention_head_dim,),
        "audio_caption_projection.linear_1.weight": (inner, c.caption_channels),
        "audio_caption_projection.linear_1.bias": (inner,),
        "audio_caption_projection.linear_2.weight": (inner, inner),
        "audio_caption_projection.linear_2.bias": (inner,),
        "time_embed.emb.timestep_embedder.linear_1.weight": (c.num_attention_heads * c.attention_head_dim, 256),
        "time_embed.emb.timestep_embedder.linear_1.bias": (c.num_attention_heads * c.attention_head_dim,),
        "time_embed.emb.timestep_embedder.linear_2.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
        "time_embed.emb.timestep_embedder.linear_2.bias": (c.num_attention_heads * c.attention_head_dim,),
        "time_embed.linear.weight": (6 * c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
        "time_embed.linear.bias": (6 * c.num_attention_heads * c.attention_head_dim,),
        "audio_time_embed.emb.timestep_embedder.linear_1.weight": (inner, 256),
        "audio_time_embed.emb.timestep_embedder.linear_1.bias": (inner,),
        "audio_time_embed.emb.timestep_embedder.linear_2.weight": (inner, inner),
        "audio_time_embed.emb.timestep_embedder.linear_2.bias": (inner,),
        "audio_time_embed.linear.weight": (6 * inner, inner),
        "audio_time_embed.linear.bias": (6 * inner,),
        "av_cross_attn_video_scale_shift.emb.timestep_embedder.linear_1.weight": (c.num_attention_heads * c.attention_head_dim, 256),
        "av_cross_attn_video_scale_shift.emb.timestep_embedder.linear_1.bias": (c.num_attention_heads * c.attention_head_dim,),
        "av_cross_attn_video_scale_shift.emb.timestep_embedder.linear_2.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
        "av_cross_attn_video_scale_shift.emb.timestep_embedder.linear_2.bias": (c.num_attention_heads * c.attention_head_dim,),
        "av_cross_attn_video_scale_shift.linear.weight": (4 * c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
        "av_cross_attn_video_scale_shift.linear.bias": (4 * c.num_attention_heads * c.attention_head_dim,),
        "av_cross_attn_audio_scale_shift.emb.timestep_embedder.linear_1.weight": (inner, 256),
        "av_cross_attn_audio_scale_shift.emb.timestep_embedder.linear_1.bias": (inner,),
        "av_cross_attn_audio_scale_shift.emb.timestep_embedder.linear_2.weight": (inner, inner),
        "av_cross_attn_audio_scale_shift.emb.timestep_embedder.linear_2.bias": (inner,),
        "av_cross_attn_audio_scale_shift.linear.weight": (4 * inner, inner),
        "av_cross_attn_audio_scale_shift.linear.bias": (4 * inner,),
        "av_cross_attn_video_a2v_gate.emb.timestep_embedder.linear_1.weight": (c.num_attention_heads * c.attention_head_dim, 256),
        "av_cross_attn_video_a2v_gate.emb.timestep_embedder.linear_1.bias": (c.num_attention_heads * c.attention_head_dim,),
        "av_cross_attn_video_a2v_gate.emb.timestep_embedder.linear_2.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
        "av_cross_attn_video_a2v_gate.emb.timestep_embedder.linear_2.bias": (c.num_attention_heads * c.attention_head_dim,),
        "av_cross_attn_video_a2v_gate.linear.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
        "av_cross_attn_video_a2v_gate.linear.bias": (c.num_attention_heads * c.attention_head_dim,),
        "av_cross_attn_audio_v2a_gate.emb.timestep_embedder.linear_1.weight": (inner, 256),
        "av_cross_attn_audio_v2a_gate.emb.timestep_embedder.linear_1.bias": (inner,),
        "av_cross_attn_audio_v2a_gate.emb.timestep_embedder.linear_2.weight": (inner, inner),
        "av_cross_attn_audio_v2a_gate.emb.timestep_embedder.linear_2.bias": (inner,),
        "av_cross_attn_audio_v2a_gate.linear.weight": (inner, inner),
        "av_cross_attn_audio_v2a_gate.linear.bias": (inner,),
    })
    for i in range(c.num_layers):
        shapes.update({
            f"transformer_blocks.{i}.scale_shift_table": (6, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.audio_scale_shift_table": (6, inner),
            f"transformer_blocks.{i}.video_a2v_cross_attn_scale_shift_table": (5, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.audio_a2v_cross_attn_scale_shift_table": (5, inner),
            f"transformer_blocks.{i}.attn1.norm_q.weight": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn1.norm_k.weight": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn1.to_q.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.attn1.to_q.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn1.to_k.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.attn1.to_k.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn1.to_v.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.attn1.to_v.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn1.to_out.0.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.attn1.to_out.0.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.audio_attn1.norm_q.weight": (inner,),
            f"transformer_blocks.{i}.audio_attn1.norm_k.weight": (inner,),
            f"transformer_blocks.{i}.audio_attn1.to_q.weight": (inner, inner),
            f"transformer_blocks.{i}.audio_attn1.to_q.bias": (inner,),
            f"transformer_blocks.{i}.audio_attn1.to_k.weight": (inner, inner),
            f"transformer_blocks.{i}.audio_attn1.to_k.bias": (inner,),
            f"transformer_blocks.{i}.audio_attn1.to_v.weight": (inner, inner),
            f"transformer_blocks.{i}.audio_attn1.to_v.bias": (inner,),
            f"transformer_blocks.{i}.audio_attn1.to_out.0.weight": (inner, inner),
            f"transformer_blocks.{i}.audio_attn1.to_out.0.bias": (inner,),
            f"transformer_blocks.{i}.attn2.norm_q.weight": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn2.norm_k.weight": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn2.to_q.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.attn2.to_q.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn2.to_k.weight": (c.num_attention_heads * c.attention_head_dim, c.cross_attention_dim),
            f"transformer_blocks.{i}.attn2.to_k.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn2.to_v.weight": (c.num_attention_heads * c.attention_head_dim, c.cross_attention_dim),
            f"transformer_blocks.{i}.attn2.to_v.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.attn2.to_out.0.weight": (c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.attn2.to_out.0.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.audio_attn2.norm_q.weight": (inner,),
            f"transformer_blocks.{i}.audio_attn2.norm_k.weight": (inner,),
            f"transformer_blocks.{i}.audio_attn2.to_q.weight": (inner, inner),
            f"transformer_blocks.{i}.audio_attn2.to_q.bias": (inner,),
            f"transformer_blocks.{i}.audio_attn2.to_k.weight": (inner, c.audio_cross_attention_dim),
            f"transformer_blocks.{i}.audio_attn2.to_k.bias": (inner,),
            f"transformer_blocks.{i}.audio_attn2.to_v.weight": (inner, c.audio_cross_attention_dim),
            f"transformer_blocks.{i}.audio_attn2.to_v.bias": (inner,),
            f"transformer_blocks.{i}.audio_attn2.to_out.0.weight": (inner, inner),
            f"transformer_blocks.{i}.audio_attn2.to_out.0.bias": (inner,),
            f"transformer_blocks.{i}.audio_to_video_attn.norm_q.weight": (inner,),
            f"transformer_blocks.{i}.audio_to_video_attn.norm_k.weight": (inner,),
            f"transformer_blocks.{i}.audio_to_video_attn.to_q.weight": (inner, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.audio_to_video_attn.to_q.bias": (inner,),
            f"transformer_blocks.{i}.audio_to_video_attn.to_k.weight": (inner, inner),
            f"transformer_blocks.{i}.audio_to_video_attn.to_k.bias": (inner,),
            f"transformer_blocks.{i}.audio_to_video_attn.to_v.weight": (inner, inner),
            f"transformer_blocks.{i}.audio_to_video_attn.to_v.bias": (inner,),
            f"transformer_blocks.{i}.audio_to_video_attn.to_out.0.weight": (c.num_attention_heads * c.attention_head_dim, inner),
            f"transformer_blocks.{i}.audio_to_video_attn.to_out.0.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.video_to_audio_attn.norm_q.weight": (inner,),
            f"transformer_blocks.{i}.video_to_audio_attn.norm_k.weight": (inner,),
            f"transformer_blocks.{i}.video_to_audio_attn.to_q.weight": (inner, inner),
            f"transformer_blocks.{i}.video_to_audio_attn.to_q.bias": (inner,),
            f"transformer_blocks.{i}.video_to_audio_attn.to_k.weight": (inner, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.video_to_audio_attn.to_k.bias": (inner,),
            f"transformer_blocks.{i}.video_to_audio_attn.to_v.weight": (inner, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.video_to_audio_attn.to_v.bias": (inner,),
            f"transformer_blocks.{i}.video_to_audio_attn.to_out.0.weight": (inner, inner),
            f"transformer_blocks.{i}.video_to_audio_attn.to_out.0.bias": (inner,),
            f"transformer_blocks.{i}.ff.net.0.proj.weight": (4 * c.num_attention_heads * c.attention_head_dim, c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.ff.net.0.proj.bias": (4 * c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.ff.net.2.weight": (c.num_attention_heads * c.attention_head_dim, 4 * c.num_attention_heads * c.attention_head_dim),
            f"transformer_blocks.{i}.ff.net.2.bias": (c.num_attention_heads * c.attention_head_dim,),
            f"transformer_blocks.{i}.audio_ff.net.0.proj.weight": (4 * inner, inner),
            f"transformer_blocks.{i}.audio_ff.net.0.proj.bias": (4 * inner,),
            f"transformer_blocks.{i}.audio_ff.net.2.weight": (inner, 4 * inner),
            f"transformer_blocks.{i}.audio_ff.net.2.bias": (inner,),
        })
    shapes.update({
        "proj_out.weight": (c.out_channels, c.num_attention_heads * c.attention_head_dim),
        "proj_out.bias": (c.out_channels,),
        "audio_proj_out.weight": (c.audio_out_channels, inner),
        "audio_proj_out.bias": (c.audio_out_channels,),
    })
    return _switched(c, shapes)


def _switched(c: Ltx2Config, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The keys LTX-2.3 / 2.5's boolean switches add, resize or drop (written by hand: the scaffold fits shapes
    on int fields only). Checked against upstream for each switch in tests/test_ltx2_port.py."""
    dims = {"": c.num_attention_heads * c.attention_head_dim, "audio_": c.audio_num_attention_heads * c.audio_attention_head_dim}
    gated = {"": c.gated_attn, "audio_": c.audio_gated_attn}
    attn_stream = {"attn1": "", "attn2": "", "audio_to_video_attn": "", "audio_attn1": "audio_",
                   "audio_attn2": "audio_", "video_to_audio_attn": "audio_"}   # whose gate switch, whose query width
    heads = {"": c.num_attention_heads, "audio_": c.audio_num_attention_heads}
    kv_heads = {"attn1": "", "attn2": "", "audio_to_video_attn": "audio_", "audio_attn1": "audio_",
                "audio_attn2": "audio_", "video_to_audio_attn": "audio_"}
    prompt_mod = c.cross_attn_mod or c.audio_cross_attn_mod
    if c.use_keyframes_abs_pos_embedding:
        shapes["keyframes_abs_pos_embedding"] = (1, dims[""])
    for m, mod in (("", c.cross_attn_mod), ("audio_", c.audio_cross_attn_mod)):
        if mod:  # 9 modulation rows: 3 more for the text cross-attention's query
            shapes[f"{m}time_embed.linear.weight"] = (9 * dims[m], dims[m])
            shapes[f"{m}time_embed.linear.bias"] = (9 * dims[m],)
        if prompt_mod and c.use_prompt_adaln_single:
            n = f"{m}prompt_adaln."
            shapes.update({n + "emb.timestep_embedder.linear_1.weight": (dims[m], 256),
                           n + "emb.timestep_embedder.linear_1.bias": (dims[m],),
                           n + "emb.timestep_embedder.linear_2.weight": (dims[m], dims[m]),
                           n + "emb.timestep_embedder.linear_2.bias": (dims[m],),
                           n + "linear.weight": (2 * dims[m], dims[m]), n + "linear.bias": (2 * dims[m],)})
        if not c.use_prompt_embeddings:
            for k in [k for k in shapes if k.startswith(f"{m}caption_projection.")]:
                del shapes[k]
    for i in range(c.num_layers):
        b = f"transformer_blocks.{i}."
        for m, mod in (("", c.cross_attn_mod), ("audio_", c.audio_cross_attn_mod)):
            if mod:
                shapes[f"{b}{m}scale_shift_table"] = (9, dims[m])
            if prompt_mod:
                shapes[f"{b}{m}prompt_scale_shift_table"] = (2, dims[m])
        for attn, m in attn_stream.items():
            if gated[m]:
                shapes[f"{b}{attn}.to_gate_logits.weight"] = (heads[kv_heads[attn]], dims[m])
                shapes[f"{b}{attn}.to_gate_logits.bias"] = (heads[kv_heads[attn]],)
        for m, bias in (("", c.ff_bias), ("audio_", c.audio_ff_bias)):
            if not bias:
                del shapes[f"{b}{m}ff.net.0.proj.bias"], shapes[f"{b}{m}ff.net.2.bias"]
    return shapes


def fp32_keys(c: Ltx2Config) -> list[str]:
    """Keys upstream keeps float32 whatever the dtype (diffusers' rule: a module name among the key's parts)."""
    return [k for k in key_shapes(c) if any(m in k.split(".") for m in FP32_MODULES)]
