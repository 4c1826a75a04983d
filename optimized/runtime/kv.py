"""A block-based KV cache pool for autoregressive decoding (vLLM-style paging, no prefix sharing yet).

Each request holds a list of fixed-size blocks, reserved at admission for its whole budget (prompt + max
new tokens) and returned on completion or cancellation. Tensors: [layers, blocks + 1, block_size, kv_heads, d]: the
last block (`scratch_block`) is never handed out; the pad rows of a decode step padded to its shape bucket write and
read there, so a static-shape step never touches a real request's blocks.
"""

from __future__ import annotations

import math

import torch


class KVPoolExhausted(RuntimeError):
    pass


class KVBlockPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", extra_keys: bool = False):
        shape = (num_layers, num_blocks + 1, block_size, kv_heads, head_dim)   # + the scratch block
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # a second key tensor when the model keeps another view of its keys (cosmos3: keys as gen sees them)
        self.k_extra = torch.zeros(shape, dtype=dtype, device=device) if extra_keys else None
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.bytes_per_block = (3 if extra_keys else 2) * num_layers * block_size * kv_heads * head_dim * \
            torch.finfo(dtype).bits // 8

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise KVPoolExhausted(f"KV pool: {n} blocks requested, {len(self.free_blocks)} free")
        return [self.free_blocks.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free_blocks.extend(reversed(blocks))

    def _slots(self, blocks: list[int], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n)
        return torch.tensor(blocks)[pos // self.block_size], pos % self.block_size

    def write(self, layer: int, blocks: list[int], start: int, k: torch.Tensor, v: torch.Tensor,
              k_extra: torch.Tensor | None = None) -> None:
        """Store keys/values [n, K, d] for positions start..start+n-1."""
        b, o = self._slots(blocks, start, k.shape[0])
        self.k[layer, b, o] = k
        self.v[layer, b, o] = v
        if self.k_extra is not None and k_extra is not None:
            self.k_extra[layer, b, o] = k_extra

    def read(self, layer: int, blocks: list[int], length: int, extra: bool = False):
        """Keys/values [length, K, d] of positions 0..length-1 (keys-for-gen instead of keys if `extra`)."""
        keys = self.k_extra if extra else self.k
        n = self.blocks_for(length)
        k = keys[layer, blocks[:n]].flatten(0, 1)[:length]
        v = self.v[layer, blocks[:n]].flatten(0, 1)[:length]
        return k, v
