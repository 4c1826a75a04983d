"""Streaming safetensors writer: the header is planned from shapes/dtypes up front, then tensors are
written one at a time, so memory stays bounded by the largest tensor. Output is standard safetensors
(8-byte little-endian header length, JSON header padded to 8 bytes, contiguous little-endian data)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from converters.errors import ConversionError
from converters.readers import TORCH_TO_ST, torch_dtype

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class OutTensor:
    key: str
    dtype: str                 # torch dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch_dtype(self.dtype).itemsize
        for s in self.shape:
            n *= s
        return n


def plan_shards(tensors: list[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _header(tensors: list[OutTensor], metadata: dict[str, str]) -> bytes:
    h: dict = {"__metadata__": metadata} if metadata else {}
    off = 0
    for t in tensors:
        h[t.key] = {"dtype": TORCH_TO_ST[torch_dtype(t.dtype)], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    b = json.dumps(h, separators=(",", ":")).encode()
    b += b" " * (-len(b) % 8)
    return len(b).to_bytes(8, "little") + b


def write_safetensors(path: Path, tensors: list[OutTensor], fetch: Callable[[OutTensor], torch.Tensor],
                      metadata: dict[str, str] | None = None, on_tensor: Callable[[OutTensor], None] | None = None) -> dict:
    """Write `tensors` (in this order) to `path`, calling `fetch(t)` for each one's data. Returns
    {"path", "bytes", "sha256"} (hashed while writing)."""
    if sys.byteorder != "little":  # pragma: no cover
        raise ConversionError("writing safetensors needs a little-endian host")
    sha = hashlib.sha256()
    n = 0
    with open(path, "wb") as f:
        def put(b) -> None:
            nonlocal n
            f.write(b)
            sha.update(b)
            n += len(b)

        put(_header(tensors, metadata or {}))
        for t in tensors:
            x = fetch(t)
            if tuple(x.shape) != t.shape or dtype_str(x) != t.dtype:
                raise ConversionError(f"{path}: key {t.key!r}: internal plan mismatch "
                                      f"({dtype_str(x)} {list(x.shape)} vs {t.dtype} {list(t.shape)})")
            buf = x.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            if buf.nbytes != t.nbytes:
                raise ConversionError(f"{path}: key {t.key!r}: wrote {buf.nbytes} bytes, planned {t.nbytes}")
            put(memoryview(buf))
            del x, buf      # drop this tensor before fetching the next: peak memory is one tensor, not two
            if on_tensor is not None:
                on_tensor(t)
        f.flush()
        os.fsync(f.fileno())
    return {"path": path.name, "bytes": n, "sha256": sha.hexdigest()}


def dtype_str(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def write_bytes(path: Path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"path": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
