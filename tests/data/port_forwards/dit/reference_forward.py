    def forward(self, hidden_states, timestep=None, class_labels=None, trace=None) -> torch.Tensor:
        c, p = self.cfg, self.cfg.patch_size
        record = trace or (lambda name, t: None)
        n, _, h, w = hidden_states.shape
        x = F.conv2d(hidden_states, self.pos_embed.proj.weight, self.pos_embed.proj.bias, stride=p)
        x = x.flatten(2).transpose(1, 2)
        x = x + pos_embed_2d(x.shape[-1], h // p).to(x.dtype)
        record("pos_embed", x)
        cond = None
        for i, blk in enumerate(self.transformer_blocks):
            emb = label_time_embedding(blk.norm1.emb, timestep, class_labels, x.dtype)
            cond = emb if cond is None else cond
            mod = F.linear(F.silu(emb), blk.norm1.linear.weight, blk.norm1.linear.bias)
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=1)
            y = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale_msa[:, None]) + shift_msa[:, None]
            x = x + gate_msa[:, None] * self_attention(blk.attn1, y, c.num_attention_heads)
            y = F.layer_norm(x, x.shape[-1:], eps=c.norm_eps) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
            y = F.gelu(F.linear(y, blk.ff.net[0].proj.weight, blk.ff.net[0].proj.bias), approximate="tanh")
            x = x + gate_mlp[:, None] * F.linear(y, blk.ff.net[2].weight, blk.ff.net[2].bias)
            record(f"transformer_blocks.{i}", x)
        # the output head reuses block 0's conditioning embedder (upstream)
        shift, scale = F.linear(F.silu(cond), self.proj_out_1.weight, self.proj_out_1.bias).chunk(2, dim=1)
        x = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        x = F.linear(x, self.proj_out_2.weight, self.proj_out_2.bias)
        out_ch = c.out_channels or c.in_channels
        x = x.reshape(n, h // p, w // p, p, p, out_ch)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(n, out_ch, h, w)


def pos_embed_2d(dim: int, grid: int) -> torch.Tensor:
    """Fixed 2D sin-cos positions (float64, then float32: upstream); first half the column index, second the row."""
    def axis(d, pos):
        omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) / (d / 2.0))
        out = torch.outer(pos.reshape(-1), omega)
        return torch.cat([out.sin(), out.cos()], dim=1)
    gw, gh = torch.meshgrid(torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32),
                            indexing="xy")  # w first (upstream)
    return torch.cat([axis(dim // 2, gw), axis(dim // 2, gh)], dim=1).float()[None]


def label_time_embedding(emb: nn.Module, timestep, class_labels, dtype) -> torch.Tensor:
    """Sinusoidal timestep (256 channels, cos first, freq shift 1) through a 2-layer MLP, plus the class embedding."""
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / (half - 1))
    angles = timestep[:, None].float() * freqs[None]
    t = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
    te = emb.timestep_embedder
    t = F.linear(F.silu(F.linear(t, te.linear_1.weight, te.linear_1.bias)), te.linear_2.weight, te.linear_2.bias)
    return t + emb.class_embedder.embedding_table.weight[class_labels]


def self_attention(attn: nn.Module, x: torch.Tensor, heads: int) -> torch.Tensor:
    n, s, d = x.shape
    q, k, v = (F.linear(x, getattr(attn, f"to_{n_}").weight, getattr(attn, f"to_{n_}").bias)
               .view(n, s, heads, d // heads).transpose(1, 2) for n_ in "qkv")
    o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, s, d)
    return F.linear(o, attn.to_out[0].weight, attn.to_out[0].bias)
