    def __call__(self, hidden_states, timestep=None, class_labels=None, trace=None) -> torch.Tensor:
        c, p, P = self.cfg, self.cfg.patch_size, self.p
        n, _, h, w = hidden_states.shape
        d, heads = P["pos_embed.proj.bias"].shape[0], c.num_attention_heads
        x = F.conv2d(hidden_states, P["pos_embed.proj.weight"], P["pos_embed.proj.bias"], stride=p)
        x = x.flatten(2).transpose(1, 2) + sincos_grid(d, h // p).to(x.dtype)
        if trace:
            trace("pos_embed", x)
        half = torch.arange(128, dtype=torch.float32)
        ang = timestep.float()[:, None] * torch.exp(half * (-math.log(10000.0) / 127))[None]
        tproj = torch.cat([torch.cos(ang), torch.sin(ang)], -1).to(x.dtype)
        first = None
        for i in range(c.num_layers):
            b = f"transformer_blocks.{i}."
            e = b + "norm1.emb."
            t = F.silu(F.linear(tproj, P[e + "timestep_embedder.linear_1.weight"], P[e + "timestep_embedder.linear_1.bias"]))
            t = F.linear(t, P[e + "timestep_embedder.linear_2.weight"], P[e + "timestep_embedder.linear_2.bias"])
            emb = t + F.embedding(class_labels, P[e + "class_embedder.embedding_table.weight"])
            first = emb if first is None else first
            mods = F.linear(F.silu(emb), P[b + "norm1.linear.weight"], P[b + "norm1.linear.bias"])[:, None]
            s1, c1, g1, s2, c2, g2 = mods.chunk(6, dim=-1)
            y = torch.addcmul(s1, F.layer_norm(x, (d,), eps=1e-6), 1 + c1)
            qkv = F.linear(y, *self.fused_qkv(b + "attn1."))
            q, k, v = qkv.view(n, -1, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, -1, d)
            x = torch.addcmul(x, g1, F.linear(a, P[b + "attn1.to_out.0.weight"], P[b + "attn1.to_out.0.bias"]))
            y = torch.addcmul(s2, F.layer_norm(x, (d,), eps=c.norm_eps), 1 + c2)
            y = F.gelu(F.linear(y, P[b + "ff.net.0.proj.weight"], P[b + "ff.net.0.proj.bias"]), approximate="tanh")
            x = torch.addcmul(x, g2, F.linear(y, P[b + "ff.net.2.weight"], P[b + "ff.net.2.bias"]))
            if trace:
                trace(f"transformer_blocks.{i}", x)
        shift, scale = F.linear(F.silu(first), P["proj_out_1.weight"], P["proj_out_1.bias"])[:, None].chunk(2, -1)
        x = F.linear(torch.addcmul(shift, F.layer_norm(x, (d,), eps=1e-6), 1 + scale),
                     P["proj_out_2.weight"], P["proj_out_2.bias"])
        oc = c.out_channels or c.in_channels
        x = x.view(n, h // p, w // p, p, p, oc).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(n, oc, h, w)

    def fused_qkv(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k, v projections as one matmul (concatenated once per layer, cached)."""
        cache = self.__dict__.setdefault("_qkv", {})
        if prefix not in cache:
            cache[prefix] = tuple(torch.cat([self.p[f"{prefix}to_{n}.{kind}"] for n in "qkv"])
                                  for kind in ("weight", "bias"))
        return cache[prefix]


def sincos_grid(dim: int, grid: int) -> torch.Tensor:
    """[1, grid*grid, dim] fixed 2D positions: sin/cos of the column index (first half), of the row (second)."""
    pos = torch.arange(grid, dtype=torch.float64)
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    ang = torch.outer(pos, omega)
    one = torch.cat([ang.sin(), ang.cos()], 1)                         # [grid, dim/2]
    rows = one[:, None].expand(grid, grid, dim // 2)                   # row index varies over dim 0
    cols = one[None].expand(grid, grid, dim // 2)
    return torch.cat([cols, rows], -1).reshape(1, grid * grid, dim).float()
