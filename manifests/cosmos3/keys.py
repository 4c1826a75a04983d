"""The canonical cosmos3 checkpoint layout: every key and its shape, as a function of the config.

Canonical names are the reference implementation's parameter names. Each decoder layer holds two
pathways with separate weights, `und` (causal text) and `gen` (generation), with identical shapes:

    layers.{i}.{und,gen}.attn_norm.weight            [D]
    layers.{i}.{und,gen}.{q,k,v,o}_proj.weight       q/o: [H*d, D]/[D, H*d]; k/v: [K*d, D]  (+ .bias if attention_bias)
    layers.{i}.{und,gen}.{q,k}_norm.weight           [d]   (und: only with qk_norm_for_text; gen: always)
    layers.{i}.und.k_norm_for_gen.weight             [d]   (only with use_und_k_norm_for_gen and not qk_norm_for_text)
    layers.{i}.{und,gen}.mlp_norm.weight             [D]
    layers.{i}.{und,gen}.mlp.{gate,up,down}_proj.weight   (gate only for silu)

DomainAwareLinear weights keep upstream's per-domain row layout: row n reshapes to [in, out].
"""

from __future__ import annotations

from manifests.cosmos3.config import Cosmos3Config

TIME_FREQ_DIM = 256  # sinusoidal timestep channels (diffusers Timesteps(256))


def canonical_key_shapes(cfg: Cosmos3Config) -> dict[str, tuple[int, ...]]:
    D, H, K, d, I, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (V, D),
        "lm_head.weight": (V, D),
        "und_norm.weight": (D,),
        "gen_norm.weight": (D,),
        "vision_in.weight": (D, cfg.patch_latent_dim),
        "vision_in.bias": (D,),
        "vision_out.weight": (cfg.patch_latent_dim, D),
        "vision_out.bias": (cfg.patch_latent_dim,),
        "time_embed.linear_1.weight": (D, TIME_FREQ_DIM),
        "time_embed.linear_1.bias": (D,),
        "time_embed.linear_2.weight": (D, D),
        "time_embed.linear_2.bias": (D,),
    }
    if cfg.has_sound:
        S = cfg.sound_dim
        shapes.update({
            "sound_in.weight": (D, S), "sound_in.bias": (D,),
            "sound_out.weight": (S, D), "sound_out.bias": (S,),
            "sound_modality_embed": (D,),
        })
    if cfg.has_action:
        A, N = cfg.action_dim, cfg.num_embodiment_domains
        shapes.update({
            "action_in.weight": (N, A * D), "action_in.bias": (N, D),
            "action_out.weight": (N, D * A), "action_out.bias": (N, A),
            "action_modality_embed": (D,),
        })
    for i in range(cfg.num_layers):
        for path in ("und", "gen"):
            p = f"layers.{i}.{path}."
            shapes[p + "attn_norm.weight"] = (D,)
            shapes[p + "q_proj.weight"] = (H * d, D)
            shapes[p + "k_proj.weight"] = (K * d, D)
            shapes[p + "v_proj.weight"] = (K * d, D)
            shapes[p + "o_proj.weight"] = (D, H * d)
            if cfg.attention_bias:
                shapes[p + "q_proj.bias"] = (H * d,)
                shapes[p + "k_proj.bias"] = (K * d,)
                shapes[p + "v_proj.bias"] = (K * d,)
                shapes[p + "o_proj.bias"] = (D,)
            if path == "gen" or cfg.qk_norm_for_text:
                shapes[p + "q_norm.weight"] = (d,)
                shapes[p + "k_norm.weight"] = (d,)
            if path == "und" and cfg.has_und_k_norm_for_gen:
                shapes[p + "k_norm_for_gen.weight"] = (d,)
            shapes[p + "mlp_norm.weight"] = (D,)
            if cfg.hidden_act == "silu":
                shapes[p + "mlp.gate_proj.weight"] = (I, D)
            shapes[p + "mlp.up_proj.weight"] = (I, D)
            shapes[p + "mlp.down_proj.weight"] = (D, I)
    return shapes


def fp32_keys(cfg: Cosmos3Config) -> list[str]:
    """Keys that stay fp32 whatever the run dtype (upstream `_keep_in_fp32_modules=["time_embedder"]`)."""
    return [k for k in canonical_key_shapes(cfg) if k.startswith("time_embed.")]
