"""Streaming tensor fetch: each canonical tensor read (and fused / split / cast) from the source one at a time, with
finiteness checks that bound their scratch memory. Part of the conversion engine (converters/engine.py)."""

from __future__ import annotations

import torch

from converters.errors import ConversionError
from converters.plan import PlanEntry, SidecarEntry, SourceRef
from converters.readers import torch_dtype, WeightReader


FINITE_CHUNK = 1 << 24           # elements per isfinite() pass: bounds the check's scratch memory


_EXP_MASK = {  # float dtype -> (same-width int view, exponent mask): all exponent bits set = Inf or NaN
    torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000),
    torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
}


def has_nonfinite(x: torch.Tensor) -> bool:
    """Any NaN/Inf? A bit test on the exponent field, in chunks (fast, little scratch memory)."""
    if not x.is_floating_point() or x.numel() == 0:
        return False
    spec = _EXP_MASK.get(x.dtype)
    if spec is None:
        return not bool(torch.isfinite(x).all())
    if not x.is_contiguous():
        x = x.contiguous()
    a = x.view(-1).view(spec[0]).numpy()
    m = a.dtype.type(spec[1])
    for i in range(0, a.size, FINITE_CHUNK):
        c = a[i:i + FINITE_CHUNK]
        if ((c & m) == m).any():
            return True
    return False


def count_nonfinite(x: torch.Tensor) -> int:
    """NaN/Inf count (exact; only on the rare path where has_nonfinite says there are some)."""
    if not has_nonfinite(x):
        return 0
    flat = x.contiguous().view(-1)
    return sum(int((~torch.isfinite(flat[i:i + FINITE_CHUNK])).sum()) for i in range(0, flat.numel(), FINITE_CHUNK))


class _SourceCache:
    """Reads each source once per use; a split's source stays cached across its targets. Tells the reader
    when a source is done so memory-mapped pages can be returned."""

    def __init__(self, reader: WeightReader):
        self.reader = reader
        self.key: str | None = None
        self.tensor: torch.Tensor | None = None

    def get(self, s: SourceRef, keep: bool) -> torch.Tensor:
        if self.key == s.key:
            return self.tensor
        self.drop()
        x = self.reader.get(s.key)
        if tuple(x.shape) != s.shape:
            raise ConversionError(f"{s.file}: key {s.key!r}: tensor data has shape {list(x.shape)}, "
                                  f"header said {list(s.shape)}")
        if keep:
            self.key, self.tensor = s.key, x
        return x

    def done(self, s: SourceRef) -> None:
        if self.key != s.key:
            self.reader.release(s.key)

    def drop(self) -> None:
        if self.key is not None:
            self.reader.release(self.key)
        self.key, self.tensor = None, None


def _fetch(cache: _SourceCache, e: PlanEntry, allow_nonfinite: bool, nonfinite: list[dict]) -> torch.Tensor:
    out_dtype = torch_dtype(e.out_dtype)
    pieces = []
    for s in e.sources:
        x = cache.get(s, keep=e.op == "split")
        if e.op == "split":
            x = x.narrow(e.dim, e.offset, e.shape[e.dim])
        bad = has_nonfinite(x)
        if bad:
            what = f"holds {int(torch.isnan(x).sum())} NaN and {int(torch.isinf(x).sum())} Inf values"
            if not allow_nonfinite:
                raise ConversionError(f"{s.file}: key {s.key!r} (-> {e.target!r}) {what}; "
                                      f"refusing (pass --allow-nonfinite / allow_nonfinite=True to keep them)")
            nonfinite.append({"key": e.target, "source_key": s.key, "detail": what})
        y = x.to(out_dtype)
        if y is not x and not bad and has_nonfinite(y):
            over = count_nonfinite(y)
            if over:
                what = f"finite {s.dtype} values overflow {e.out_dtype} ({over} become Inf)"
                if not allow_nonfinite:
                    raise ConversionError(f"{s.file}: key {s.key!r} (-> {e.target!r}) {what}; "
                                          f"refusing (pass --allow-nonfinite / allow_nonfinite=True to keep them)")
                nonfinite.append({"key": e.target, "source_key": s.key, "detail": what})
        pieces.append(y)
    if e.op == "fuse":
        y = torch.cat(pieces, dim=e.dim)
    else:
        y = pieces[0]
        if e.op == "transpose":
            y = y.permute(*e.dims)
        elif e.op == "reshape":
            y = y.reshape(e.shape)
    return y


def _fetch_sidecar(cache: _SourceCache, sc: SidecarEntry) -> torch.Tensor:
    return cache.get(sc.source, keep=False)
