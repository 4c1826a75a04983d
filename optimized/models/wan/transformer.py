"""WanDiTFast: the Wan 2.1 / 2.2 DiT (diffusers 0.42.1 `WanTransformer3DModel` numerics) for the batched runtime.

One `forward_batch` call runs B same-shape requests (different timesteps, prompts, image embeddings) as one
batch: one patchify convolution, fused attn1 q/k/v and attn2 k/v (and image k/v) projections declared in
`optimized/models/wan/spec.py`, SDPA over [B, H, N, d], 3D rope tables built once per latent grid and cached.
Precision follows upstream with a bf16 run dtype: the time embedder, every `scale_shift_table` and the cross-attn
LayerNorm stay fp32 (`_keep_in_fp32_modules`), norms / modulation / residual gates are computed in fp32 and cast
back, rope is applied in fp32 and rounded to the run dtype.

The output is in the run dtype (upstream returns the transformer dtype; the pipeline casts to fp32 as it needs).

Sequence parallel (`sp_mesh`, attached by the family's `parallelize` hook when the plan's ulysses x ring > 1): the
video tokens are sharded after the patch embedding (with their RoPE rows and per-token timesteps), self-attention
runs through `optimized.parallel.sp.sp_attention` (padded keys masked), cross-attention stays local (the text is
whole on every rank), the block stack (`sp_blocks_body`) runs through the same CompileCache as the single-device one
(compiled, it breaks its graph at each collective), and the tokens are all-gathered and trimmed before the output
head.
Tensor parallel (`tp`, given at load with this rank's shard of the weights, or attached by `parallelize` which
re-shards loaded weights; optimized/models/wan/parallelize.py holds the per-key plan): q / k / v, the image K/V and
the FFN up projection column-parallel (heads / tp per rank; the across-heads q / k RMS norm all-reduces its sum of
squares), the attention and FFN output projections row-parallel (one SUM all-reduce each); it composes with SP
(Ulysses then splits the rank's heads). Without a mesh (or at degree 1) the single-process path runs unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from manifests.wan.dit import WanDiTConfig

from optimized.attention import attend, check_backend
from optimized.parallel.group import AxisGroup
from optimized.parallel.sp import key_mask_shard, shard_sequence, sp_attention, sp_index
from optimized.parallel.tp import row_parallel, sharded_rms_norm
from optimized.models.wan.parallelize import shard_params, sharded_component
from optimized.models.wan.spec import DIT, dit_component
from optimized.runtime.cache import state_dict_hash
from optimized.runtime.compile import GRAPH_MODES, CompileCache, GraphKey
from optimized.runtime.spec import apply_load_transforms

ROPE_THETA = 10000.0
TEXT_CONTEXT_LEN = 512   # (upstream) WanAttnProcessor splits image context as [:, :L - 512]: text is exactly 512


class WanDiTInputError(ValueError):
    """Inputs whose shapes the DiT cannot run (named in the message)."""


@dataclass
class BlockWeights:
    """One transformer block after the load transforms (fused projections; fp32 where upstream keeps fp32)."""

    scale_shift_table: torch.Tensor        # [1, 6, D] fp32
    qkv_w: torch.Tensor                    # attn1 [3D, D] (q | k | v rows)
    qkv_b: torch.Tensor
    norm_q1: torch.Tensor
    norm_k1: torch.Tensor
    out1_w: torch.Tensor
    out1_b: torch.Tensor
    norm2_w: torch.Tensor | None           # cross-attn LayerNorm (fp32), None when cross_attn_norm is False
    norm2_b: torch.Tensor | None
    q2_w: torch.Tensor
    q2_b: torch.Tensor
    kv2_w: torch.Tensor                    # attn2 text [2D, D] (k | v rows)
    kv2_b: torch.Tensor
    norm_q2: torch.Tensor
    norm_k2: torch.Tensor
    add_kv_w: torch.Tensor | None          # attn2 image [2D, D] (k | v rows), image branch only
    add_kv_b: torch.Tensor | None
    norm_added_k: torch.Tensor | None
    out2_w: torch.Tensor
    out2_b: torch.Tensor
    ffn0_w: torch.Tensor
    ffn0_b: torch.Tensor
    ffn2_w: torch.Tensor
    ffn2_b: torch.Tensor
    prefix: str = ""                       # "blocks.{i}.": names the block's layers for per-row LoRA deltas


@dataclass
class EmbeddedBatch:
    """A batch after the embeddings: the block stack's input and everything its blocks and head read."""
    x: torch.Tensor                        # [B, N, D] run dtype
    ctx: torch.Tensor                      # [B, L, D] text context
    img: torch.Tensor | None               # [B, N_img, D] image context (2.1 I2V)
    timestep_proj: torch.Tensor            # [B, 6, D] or [B, N, 6, D]
    temb: torch.Tensor                     # [B, D] or [B, N, D] (the output head's modulation)
    rope: tuple[torch.Tensor, torch.Tensor]
    grid: tuple[int, int, int]

    def rows(self, rows: list[int]) -> "EmbeddedBatch":
        if rows == list(range(self.x.shape[0])):
            return self
        idx = torch.tensor(rows, device=self.x.device)
        return EmbeddedBatch(self.x[idx], self.ctx[idx], None if self.img is None else self.img[idx],
                             self.timestep_proj[idx], self.temb[idx], self.rope, self.grid)


def _rope_axis_table(dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [max_len, dim/2] of one axis: angles in float64, rounded to fp32 (upstream get_1d_rotary_pos_embed
    with freqs_dtype float64; upstream's repeat-interleaved columns are kept once here)."""
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation of x [B, N, H, d] by cos / sin [N, 1, d/2] fp32; rounded to x's dtype (upstream)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


class WanDiTFast:
    """Built from (config, canonical state dict, device, dtype). See the module docstring."""

    def __init__(self, cfg: WanDiTConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, weights_version: str | None = None,
                 component_id: str = DIT, tp: AxisGroup | None = None) -> None:
        """`tp`: `state` is this rank's tensor-parallel shard (parallelize.read_sharded_state), not the whole DiT."""
        self.cfg = cfg.validate()
        self.device = torch.device(device)
        self.dtype = dtype
        self.component = dit_component(cfg, component_id)
        self.tp: AxisGroup | None = None       # a tp axis of degree > 1: this rank holds heads / tp and ffn / tp
        if tp is not None and tp.world_size > 1:
            self.component, self.tp = sharded_component(self.component, cfg, tp), tp
        self.params = apply_load_transforms(self.component, state, dtype=dtype, device=self.device)
        self.weights_version = weights_version or state_dict_hash(state)
        self.blocks = [self._block(i) for i in range(cfg.num_layers)]
        t_dim, h_dim, w_dim = cfg.rope_dims()
        self._rope_axes = [_rope_axis_table(d, cfg.rope_max_seq_len) for d in (t_dim, h_dim, w_dim)]
        self._rope_cache: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        half = cfg.freq_dim // 2
        # (upstream) diffusers get_timestep_embedding(flip_sin_to_cos=True, downscale_freq_shift=0): exp(-ln(1e4) k / half)
        exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=self.device)
        self._time_freqs = torch.exp(exponent / half)
        # the block stack's graph (configure_graph): a Wan batch is already one static shape (same grid, text 512)
        self.graph_mode, self.attention, self.cfg_policy_name = "eager", "auto", "any"
        self.component_id = component_id
        self.graph_cache = CompileCache()
        self.last_step_info: dict[str, str] = {}
        self.sp_mesh = None                    # a ParallelMesh with ulysses x ring > 1: sequence-parallel forward
        self.row_lora = None                   # during one forward: per-row LoRA deltas (optimized/adapters/rows.py)
        self.lora_bank = None                  # the engine's loaded adapters (optimized/adapters), attached on use

    def shard_tp(self, tp: AxisGroup) -> "WanDiTFast":
        """Keep only this tp rank's shard of the loaded weights (parallelize.shard_params); the rest is freed."""
        if tp.world_size == 1 or self.tp is not None:
            return self
        self.params = shard_params(self.component, self.params, tp)
        self.component, self.tp = sharded_component(self.component, self.cfg, tp), tp
        self.blocks = [self._block(i) for i in range(self.cfg.num_layers)]
        self.graph_cache = CompileCache()
        return self

    def _block(self, i: int) -> BlockWeights:
        p, g = f"blocks.{i}.", self.params.get
        return BlockWeights(
            scale_shift_table=g(p + "scale_shift_table"),
            qkv_w=g(p + "attn1.qkv.weight"), qkv_b=g(p + "attn1.qkv.bias"),
            norm_q1=g(p + "attn1.norm_q.weight"), norm_k1=g(p + "attn1.norm_k.weight"),
            out1_w=g(p + "attn1.to_out.0.weight"), out1_b=g(p + "attn1.to_out.0.bias"),
            norm2_w=g(p + "norm2.weight"), norm2_b=g(p + "norm2.bias"),
            q2_w=g(p + "attn2.to_q.weight"), q2_b=g(p + "attn2.to_q.bias"),
            kv2_w=g(p + "attn2.kv.weight"), kv2_b=g(p + "attn2.kv.bias"),
            norm_q2=g(p + "attn2.norm_q.weight"), norm_k2=g(p + "attn2.norm_k.weight"),
            add_kv_w=g(p + "attn2.add_kv.weight"), add_kv_b=g(p + "attn2.add_kv.bias"),
            norm_added_k=g(p + "attn2.norm_added_k.weight"),
            out2_w=g(p + "attn2.to_out.0.weight"), out2_b=g(p + "attn2.to_out.0.bias"),
            ffn0_w=g(p + "ffn.net.0.proj.weight"), ffn0_b=g(p + "ffn.net.0.proj.bias"),
            ffn2_w=g(p + "ffn.net.2.weight"), ffn2_b=g(p + "ffn.net.2.bias"), prefix=p,
        )

    # ------------------------------------------------------------------ cached tables
    def rope_tables(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [f*h*w, 1, head_dim/2] fp32 for a post-patch grid (f, h, w); built once per grid."""
        hit = self._rope_cache.get(grid)
        if hit is not None:
            return hit
        f, h, w = grid
        if max(grid) > self.cfg.rope_max_seq_len:
            raise WanDiTInputError(f"latent grid {grid} exceeds rope_max_seq_len {self.cfg.rope_max_seq_len}")
        parts_cos, parts_sin = [], []
        for (cos, sin), n, shape in zip(self._rope_axes, grid, ((f, 1, 1), (1, h, 1), (1, 1, w))):
            parts_cos.append(cos[:n].view(*shape, -1).expand(f, h, w, -1))
            parts_sin.append(sin[:n].view(*shape, -1).expand(f, h, w, -1))
        cos = torch.cat(parts_cos, -1).reshape(f * h * w, 1, -1).to(self.device)
        sin = torch.cat(parts_sin, -1).reshape(f * h * w, 1, -1).to(self.device)
        self._rope_cache[grid] = (cos, sin)
        return self._rope_cache[grid]

    # ------------------------------------------------------------------ embeddings
    def _patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """Conv3d(kernel = stride = patch) over the whole batch: [B, C, T, H, W] -> [B, f*h*w, D] contiguous.
        (Kept a convolution, not a reshaped GEMM: same kernel as upstream, so fp32 results agree bitwise.)"""
        x = F.conv3d(latents, self.params["patch_embedding.weight"], self.params["patch_embedding.bias"],
                     stride=self.cfg.patch_size)
        return x.flatten(2).transpose(1, 2).contiguous()

    def _time_embedding(self, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timesteps [B] or [B, N] -> temb [B(, N), D] (run dtype) and timestep_proj [B(, N), 6D] (run dtype)."""
        P = self.params
        t = timesteps.to(self.device).reshape(-1)
        args = t[:, None].float() * self._time_freqs[None, :]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)       # (upstream) flip_sin_to_cos: cos first
        if self.cfg.freq_dim % 2:
            emb = F.pad(emb, (0, 1))
        emb = emb.to(P["condition_embedder.time_embedder.linear_1.weight"].dtype)   # fp32 time embedder (upstream)
        h = F.silu(F.linear(emb, P["condition_embedder.time_embedder.linear_1.weight"],
                            P["condition_embedder.time_embedder.linear_1.bias"]))
        temb = F.linear(h, P["condition_embedder.time_embedder.linear_2.weight"],
                        P["condition_embedder.time_embedder.linear_2.bias"]).to(self.dtype)
        proj = F.linear(F.silu(temb), P["condition_embedder.time_proj.weight"], P["condition_embedder.time_proj.bias"])
        shape = tuple(timesteps.shape)
        return temb.reshape(*shape, -1), proj.reshape(*shape, -1)

    def _text_embedding(self, text: torch.Tensor) -> torch.Tensor:
        P, pre = self.params, "condition_embedder.text_embedder."
        h = F.gelu(F.linear(text, P[pre + "linear_1.weight"], P[pre + "linear_1.bias"]), approximate="tanh")
        return F.linear(h, P[pre + "linear_2.weight"], P[pre + "linear_2.bias"])

    def _image_embedding(self, image: torch.Tensor) -> torch.Tensor:
        P, pre = self.params, "condition_embedder.image_embedder."
        E = image.shape[-1]
        pos = P.get(pre + "pos_embed")
        if pos is not None:   # (upstream) FLF2V: pairs of image-token sets are folded into one sequence, [B/2, 2N, E]
            image = image.reshape(-1, 2 * image.shape[1], E) + pos
        dt = image.dtype
        # (upstream) FP32LayerNorm with nn.LayerNorm's default eps 1e-5, output back in the input dtype
        h = F.layer_norm(image.float(), (E,), P[pre + "norm1.weight"].float(), P[pre + "norm1.bias"].float(),
                         1e-5).to(dt)
        h = F.gelu(F.linear(h, P[pre + "ff.net.0.proj.weight"], P[pre + "ff.net.0.proj.bias"]))   # exact GELU
        h = F.linear(h, P[pre + "ff.net.2.weight"], P[pre + "ff.net.2.bias"])
        D = h.shape[-1]
        return F.layer_norm(h.float(), (D,), P[pre + "norm2.weight"].float(), P[pre + "norm2.bias"].float(),
                            1e-5).to(h.dtype)

    # ------------------------------------------------------------------ block
    def configure_graph(self, mode: str = "eager", *, attention: str | None = None,
                        cfg_policy: str | None = None) -> "WanDiTFast":
        """How the block stack runs: "eager", "compile" (torch.compile per shape) or "cuda" (captured graph per
        shape), and the attention backend (optimized/attention.py); both are in the GraphKey."""
        if mode not in GRAPH_MODES:
            raise ValueError(f"graph mode must be one of {GRAPH_MODES}, got {mode!r}")
        self.graph_mode = mode
        self.attention = check_backend(attention or self.attention)
        self.cfg_policy_name = cfg_policy or self.cfg_policy_name
        return self

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[B, N, H, d] layouts in and out (upstream native backend: permute, SDPA, permute back)."""
        return attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend=self.attention).transpose(1, 2)

    def blocks_body(self, x: torch.Tensor, ctx: torch.Tensor, img: torch.Tensor | None, timestep_proj: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
        """The step body: every block on static shapes, no host sync (what `CompileCache` compiles or captures)."""
        for block in self.blocks:
            x = self._block_forward(block, x, ctx, img, timestep_proj, (cos, sin))
        return (x,)

    def _run_blocks(self, x, ctx, img, timestep_proj, rope) -> torch.Tensor:
        shape = f"B={x.shape[0]};N={x.shape[1]};L={ctx.shape[1]};img={0 if img is None else img.shape[1]};" \
                f"t={'token' if timestep_proj.ndim == 4 else 'sample'}"
        key = GraphKey(family="wan", variant=self.component_id, weights_version=self.weights_version,
                       dtype=str(self.dtype).removeprefix("torch."), device=str(self.device), bucket=shape,
                       batch_size=x.shape[0], cfg_policy=self.cfg_policy_name, attention=self.attention,
                       mode=self.graph_mode)
        stack = self.blocks_body if self._sp_degree() == 1 else self.sp_blocks_body
        if img is None:  # a captured graph takes tensors only
            body = lambda x, ctx, tp, cos, sin: stack(x, ctx, None, tp, cos, sin)  # noqa: E731
            args = (x, ctx, timestep_proj, *rope)
        else:
            body, args = stack, (x, ctx, img, timestep_proj, *rope)
        runner, info = self.graph_cache.step(key, body, args)
        self.last_step_info = info.as_dict()
        return runner(*args)[0]

    def _block_forward(self, w: BlockWeights, x: torch.Tensor, ctx: torch.Tensor, img: torch.Tensor | None,
                       timestep_proj: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       self_attention=None) -> torch.Tensor:
        """x [B, N, D] run dtype; timestep_proj [B, 6, D] or [B, N, 6, D] (run dtype). `self_attention`: the
        sequence-parallel attention of this rank's tokens (None: local SDPA)."""
        cfg, dt = self.cfg, x.dtype
        B, N, D = x.shape
        H, eps = cfg.num_heads // self._tp_degree(), cfg.eps      # this rank's heads
        if timestep_proj.ndim == 4:   # per-token modulation (Wan2.2 TI2V)
            mod = (w.scale_shift_table.unsqueeze(0) + timestep_proj.float()).unbind(2)
        else:
            mod = (w.scale_shift_table + timestep_proj.float()).chunk(6, dim=1)
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = mod

        # 1. self-attention (fp32 LayerNorm + modulation, cast back)
        n = (F.layer_norm(x.float(), (D,), eps=eps) * (1 + scale_msa) + shift_msa).to(dt)
        q, k, v = self._linear(n, w.qkv_w, w.qkv_b, w.prefix + "attn1.qkv").chunk(3, dim=-1)
        q = self._qk_norm(q, w.norm_q1).unflatten(2, (H, -1))
        k = self._qk_norm(k, w.norm_k1).unflatten(2, (H, -1))
        v = v.unflatten(2, (H, -1))
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        a = (self_attention or self._sdpa)(q, k, v).flatten(2, 3).to(dt)
        x = (x.float() + self._row_linear(a, w.out1_w, w.out1_b, w.prefix + "attn1.to_out.0") * gate_msa).to(dt)

        # 2. cross-attention (text; + image tokens through their own K/V, summed before to_out)
        n = F.layer_norm(x.float(), (D,), w.norm2_w, w.norm2_b, eps).to(dt) if w.norm2_w is not None else x
        q = self._qk_norm(self._linear(n, w.q2_w, w.q2_b, w.prefix + "attn2.to_q"), w.norm_q2).unflatten(2, (H, -1))
        k, v = self._linear(ctx, w.kv2_w, w.kv2_b, w.prefix + "attn2.kv").chunk(2, dim=-1)
        k = self._qk_norm(k, w.norm_k2).unflatten(2, (H, -1))
        a = self._sdpa(q, k, v.unflatten(2, (H, -1))).flatten(2, 3).to(dt)
        if img is not None:
            ki, vi = self._linear(img, w.add_kv_w, w.add_kv_b, w.prefix + "attn2.add_kv").chunk(2, dim=-1)
            ki = self._qk_norm(ki, w.norm_added_k).unflatten(2, (H, -1))
            a_img = self._sdpa(q, ki, vi.unflatten(2, (H, -1))).flatten(2, 3).to(dt)
            a = a + a_img
        x = x + self._row_linear(a, w.out2_w, w.out2_b, w.prefix + "attn2.to_out.0")

        # 3. feed-forward (tanh GELU), fp32 gated residual
        n = (F.layer_norm(x.float(), (D,), eps=eps) * (1 + c_scale) + c_shift).to(dt)
        f = self._row_linear(F.gelu(self._linear(n, w.ffn0_w, w.ffn0_b, w.prefix + "ffn.net.0.proj"),
                                    approximate="tanh"), w.ffn2_w, w.ffn2_b, w.prefix + "ffn.net.2")
        return (x.float() + f.float() * c_gate).to(dt)

    # ------------------------------------------------------------------ tensor parallel
    def _tp_degree(self) -> int:
        return 1 if self.tp is None else self.tp.world_size

    def _qk_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The q / k RMS norm across all heads (hidden_size channels); under TP over this rank's heads' channels
        with the sum of squares all-reduced."""
        D, eps = self.cfg.hidden_size, self.cfg.eps
        return F.rms_norm(x, (D,), weight, eps) if self.tp is None else sharded_rms_norm(x, weight, D, eps, self.tp)

    def _row_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, where: str = "") -> torch.Tensor:
        """An output projection: row-parallel under TP (partial products all-reduced, the bias added once)."""
        if self.tp is None:
            return self._linear(x, w, b, where)
        return row_parallel(x, w, b, self.tp)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, where: str) -> torch.Tensor:
        """A projection named `where` (the fused layout's name): plus each row's LoRA delta while `row_lora` is set."""
        y = F.linear(x, w, b)
        return y if self.row_lora is None else self.row_lora.add_to(y, x, where)

    def lora_layers(self) -> set[str]:
        """The layers per-row LoRA reaches (names in the fused layout): every block projection and proj_out."""
        parts = ["attn1.qkv", "attn1.to_out.0", "attn2.to_q", "attn2.kv", "attn2.to_out.0", "ffn.net.0.proj",
                 "ffn.net.2"] + (["attn2.add_kv"] if self.cfg.has_image_branch else [])
        return {f"blocks.{i}.{p}" for i in range(self.cfg.num_layers) for p in parts} | {"proj_out"}

    # ------------------------------------------------------------------ forward
    def _check(self, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
               image_embeds: torch.Tensor | None) -> tuple[int, int, int]:
        cfg = self.cfg
        if latents.ndim != 5 or latents.shape[1] != cfg.in_channels:
            raise WanDiTInputError(f"latents must be [B, {cfg.in_channels}, T, H, W], got {list(latents.shape)}")
        B, _, T, H, W = latents.shape
        pt, ph, pw = cfg.patch_size
        if T % pt or H % ph or W % pw:
            raise WanDiTInputError(f"latent T, H, W {(T, H, W)} must be multiples of the patch size {cfg.patch_size}")
        grid = (T // pt, H // ph, W // pw)
        if text.ndim != 3 or text.shape[0] != B or text.shape[2] != cfg.text_dim:
            raise WanDiTInputError(f"text must be [{B}, L, {cfg.text_dim}], got {list(text.shape)}")
        if timesteps.shape not in (torch.Size([B]), torch.Size([B, math.prod(grid)])):
            raise WanDiTInputError(f"timesteps must be [{B}] or [{B}, {math.prod(grid)}], got {list(timesteps.shape)}")
        if cfg.has_image_branch:
            if image_embeds is None:
                raise WanDiTInputError("this DiT has an image branch: image_embeds [B, N, image_dim] are required")
            if image_embeds.ndim != 3 or image_embeds.shape[-1] != cfg.image_dim:
                raise WanDiTInputError(f"image_embeds must be [B, N, {cfg.image_dim}], got {list(image_embeds.shape)}")
            if text.shape[1] != TEXT_CONTEXT_LEN:
                raise WanDiTInputError(f"with the image branch the text length must be {TEXT_CONTEXT_LEN} "
                                       f"(upstream splits the context at L - 512), got {text.shape[1]}")
        elif image_embeds is not None:
            raise WanDiTInputError("image_embeds given but this DiT has no image branch")
        return grid

    @torch.no_grad()
    def forward_batch(self, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                      image_embeds: torch.Tensor | None = None, trace: dict | None = None,
                      lora=None) -> torch.Tensor:
        """latents [B, C_in, T, H, W], timesteps [B] (int or float) or [B, f*h*w] (per token), text [B, L, text_dim],
        image_embeds [B, N, image_dim] | None -> velocity [B, C_out, T, H, W] in the run dtype.

        `trace`: when a dict, receives upstream-shaped intermediates: "patch_embedding" [B, D, f, h, w],
        "condition_embedder" (timestep_proj [B, 6D] or [B, N, 6D]) plus ".temb" / ".text" / ".image",
        "blocks.{i}" [B, N, D] and "proj_out" [B, N, C_out * prod(patch)].

        `lora`: a RowLora (optimized/adapters/rows.py): each row's adapters, applied unmerged; such a forward runs
        the block stack eagerly (a captured or compiled stack holds no per-row adapters)."""
        if lora is not None and self.tp is not None:
            raise WanDiTInputError("per-request LoRA is not available under tensor parallelism (merge the adapter)")
        self.row_lora = lora
        try:
            return self._forward_batch(latents, timesteps, text, image_embeds, trace)
        finally:
            self.row_lora = None

    def _forward_batch(self, latents, timesteps, text, image_embeds, trace) -> torch.Tensor:
        e = self._embed(latents, timesteps, text, image_embeds, trace)
        x, ctx, img, timestep_proj, rope = e.x, e.ctx, e.img, e.timestep_proj, e.rope

        if trace is None and self.row_lora is None:   # through the CompileCache (a plan's compiled stack breaks at collectives)
            x = self._run_blocks(x, ctx, img, timestep_proj, rope)
        elif self._sp_degree() > 1:
            x = self._sp_blocks(x, ctx, img, timestep_proj, rope, trace)
        else:   # traced: eager, block by block
            for i, block in enumerate(self.blocks):
                x = self._block_forward(block, x, ctx, img, timestep_proj, rope)
                if trace is not None:
                    trace[f"blocks.{i}"] = x
        return self._head(x, e.temb, e.grid, trace)

    def _embed(self, latents, timesteps, text, image_embeds, trace) -> "EmbeddedBatch":
        """Patch, time, text and image embeddings of a batch: the block stack's inputs."""
        grid = self._check(latents, timesteps, text, image_embeds)
        dt, dev = self.dtype, self.device
        B = latents.shape[0]
        f, h, w = grid
        rope = self.rope_tables(grid)

        x = self._patchify(latents.to(dev, dt))
        temb, timestep_proj = self._time_embedding(timesteps)
        ctx = self._text_embedding(text.to(dev, dt))
        img = self._image_embedding(image_embeds.to(dev, dt)) if image_embeds is not None else None
        if trace is not None:
            trace["patch_embedding"] = x.transpose(1, 2).reshape(B, -1, f, h, w)
            trace["condition_embedder"] = timestep_proj
            trace["condition_embedder.temb"] = temb
            trace["condition_embedder.text"] = ctx
            if img is not None:
                trace["condition_embedder.image"] = img
        timestep_proj = timestep_proj.unflatten(-1, (6, -1))   # [B, 6, D] or [B, N, 6, D]
        if img is not None:
            # (upstream) image and text context are concatenated, then sliced apart again in each attn2: the strided
            # slices take a different GEMM path than contiguous ones (bf16 rounding), so keep the same layout
            full = torch.cat([img, ctx], dim=1)
            img, ctx = full[:, :img.shape[1]], full[:, img.shape[1]:]
        return EmbeddedBatch(x, ctx, img, timestep_proj, temb, rope, grid)

    def _head(self, x: torch.Tensor, temb: torch.Tensor, grid: tuple[int, int, int], trace) -> torch.Tensor:
        """Output norm + modulation, proj_out, unpatchify: [B, N, D] -> [B, C_out, T, H, W]."""
        cfg, dt = self.cfg, self.dtype
        B = x.shape[0]
        f, h, w = grid
        sst = self.params["scale_shift_table"]                  # [1, 2, D] fp32
        if temb.ndim == 3:
            shift, scale = (sst.unsqueeze(0) + temb.unsqueeze(2)).unbind(2)
        else:
            shift, scale = (sst + temb.unsqueeze(1)).chunk(2, dim=1)
        D = cfg.hidden_size
        x = (F.layer_norm(x.float(), (D,), eps=cfg.eps) * (1 + scale) + shift).to(dt)
        x = self._linear(x, self.params["proj_out.weight"], self.params["proj_out.bias"], "proj_out")
        if trace is not None:
            trace["proj_out"] = x
        pt, ph, pw = cfg.patch_size
        x = x.reshape(B, f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(B, x.shape[1], f * pt, h * ph, w * pw)

    # ------------------------------------------------------------------ sequence parallel
    def _sp_degree(self) -> int:
        return 1 if self.sp_mesh is None else self.sp_mesh.plan.sp_ulysses * self.sp_mesh.plan.sp_ring

    def _sp_gather(self, x: torch.Tensor, tokens: int) -> torch.Tensor:
        """This rank's [B, N_local, D] -> the whole [B, tokens, D] (chunk index = ring rank x ulysses + ulysses rank)."""
        u, r = self.sp_mesh.axis("sp_ulysses"), self.sp_mesh.axis("sp_ring")
        x = torch.cat(u.all_gather(x.contiguous()), 1)
        x = torch.cat(r.all_gather(x.contiguous()), 1)
        return x[:, :tokens]

    def sp_blocks_body(self, x: torch.Tensor, ctx: torch.Tensor, img: torch.Tensor | None,
                       timestep_proj: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
        """The step body under sequence parallelism: same inputs and output as `blocks_body`."""
        return (self._sp_blocks(x, ctx, img, timestep_proj, (cos, sin), None),)

    def _sp_blocks(self, x, ctx, img, timestep_proj, rope, trace: dict | None) -> torch.Tensor:
        """The block stack on this rank's token chunk; the whole sequence back, trimmed of its padding."""
        mesh, (B, N, _) = self.sp_mesh, x.shape
        index, n = sp_index(mesh)
        x = shard_sequence(x, n, index, 1)
        cos, sin = (shard_sequence(t, n, index, 0) for t in rope)
        if timestep_proj.ndim == 4:   # per-token modulation (Wan2.2 TI2V): this rank's tokens only
            timestep_proj = shard_sequence(timestep_proj, n, index, 1)
        key_mask = None if N % n == 0 else key_mask_shard(B, N, n, index, x.device)   # padded keys masked

        def attention(q, k, v):
            return sp_attention(q, k, v, key_mask, mesh)

        for i, block in enumerate(self.blocks):
            x = self._block_forward(block, x, ctx, img, timestep_proj, (cos, sin), self_attention=attention)
            if trace is not None:
                trace[f"blocks.{i}"] = self._sp_gather(x, N)
        return self._sp_gather(x, N)

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_batch(latents, timesteps, text, image_embeds)

    __call__ = forward


class WanCachedStack:
    """WanDiTFast as an `optimized.accel.stack.CachedStack`: the embeddings of a list of rows (objects with latents,
    timestep, text, image_embeds; batch dim 1 each) in one call, any block range on any subset of them, the head.
    Single-device (the accelerated step is refused under sequence / tensor parallelism and LoRA). Each block segment
    runs in the DiT's graph mode (`configure_graph`: compiled / captured per segment and rows, through its
    CompileCache, as the exact stack) unless a sparse self-attention is routed in (that one runs eagerly).

    `self_attention(q, k, v, grid, step=, block=) -> (out, keys_skipped)`: a sparse self-attention ([B, N, H, d] in
    and out, the post-patch grid, this call's denoising step and block). It runs once per group of rows at the same
    step, so `keys_skipped[row]` (the (query, key) pairs its mask removed, summed over heads and blocks) is exact."""

    def __init__(self, dit: WanDiTFast, self_attention=None) -> None:
        if dit._sp_degree() > 1 or dit.tp is not None:
            raise WanDiTInputError("accelerations run on a single-device DiT (no sequence / tensor parallel plan)")
        self.dit, self.num_layers, self.dtype = dit, dit.cfg.num_layers, dit.dtype
        self.self_attention = self_attention
        self.steps: list[int] = []
        self.keys_skipped: list[int] = []

    def embed(self, inputs, steps: list[int]) -> EmbeddedBatch:
        ts = [r.timestep for r in inputs]
        if len({t.dtype for t in ts}) > 1:  # int and float timesteps in one batch: the DiT embeds them as fp32 anyway
            ts = [t.to(torch.float32) for t in ts]
        images = None if inputs[0].image_embeds is None else torch.cat([r.image_embeds for r in inputs])
        self.steps, self.keys_skipped = list(steps), [0] * len(steps)
        with torch.no_grad():
            return self.dit._embed(torch.cat([r.latents for r in inputs]), torch.cat(ts),
                                   torch.cat([r.text for r in inputs]), images, None)

    def _attention(self, grid, rows: list[int], block: int):
        if self.self_attention is None:
            return None

        def attend(q, k, v):
            out = torch.empty_like(q)
            for step in sorted({self.steps[r] for r in rows}):
                group = [i for i, r in enumerate(rows) if self.steps[r] == step]
                idx = torch.tensor(group, device=q.device)
                o, skipped = self.self_attention(q[idx], k[idx], v[idx], grid, step=step, block=block)
                out[idx] = o
                for i in group:
                    self.keys_skipped[rows[i]] += int(skipped) // len(group)
            return out
        return attend

    @torch.no_grad()
    def run_blocks(self, batch: EmbeddedBatch, x: torch.Tensor, rows: list[int], start: int, end: int) -> torch.Tensor:
        b = batch.rows(rows)
        if self.self_attention is None and self.dit.graph_mode != "eager":
            return self._graph_blocks(b, x, start, end)
        for i in range(start, end):
            x = self.dit._block_forward(self.dit.blocks[i], x, b.ctx, b.img, b.timestep_proj, b.rope,
                                        self_attention=self._attention(batch.grid, rows, i))
        return x

    def _graph_blocks(self, b: EmbeddedBatch, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Blocks [start, end) through the DiT's CompileCache in its graph mode (compiled / captured as the exact
        stack is), one runner per (segment, rows, shape): the key names the block range, so a segment's graph never
        serves another."""
        dit, ctx, img, tp = self.dit, b.ctx, b.img, b.timestep_proj
        shape = f"B={x.shape[0]};N={x.shape[1]};L={ctx.shape[1]};img={0 if img is None else img.shape[1]};" \
                f"t={'token' if tp.ndim == 4 else 'sample'};blocks={start}-{end}"
        key = GraphKey(family="wan", variant=dit.component_id, weights_version=dit.weights_version,
                       dtype=str(dit.dtype).removeprefix("torch."), device=str(dit.device), bucket=shape,
                       batch_size=x.shape[0], cfg_policy="accel", attention=dit.attention, mode=dit.graph_mode)

        def segment(x, ctx, img, tp, cos, sin):
            for i in range(start, end):
                x = dit._block_forward(dit.blocks[i], x, ctx, img, tp, (cos, sin))
            return (x,)

        if img is None:  # a captured graph takes tensors only
            body = lambda x, ctx, tp, cos, sin: segment(x, ctx, None, tp, cos, sin)  # noqa: E731
            args = (x, ctx, tp, *b.rope)
        else:
            body, args = segment, (x, ctx, img, tp, *b.rope)
        runner, info = dit.graph_cache.step(key, body, args)
        dit.last_step_info = info.as_dict()
        return runner(*args)[0]

    @torch.no_grad()
    def head(self, batch: EmbeddedBatch, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return self.dit._head(x, batch.rows(rows).temb, batch.grid, None)
