"""Weight readers: single safetensors, sharded safetensors (index json), torch pickles (weights_only).

Readers list keys/shapes/dtypes from headers without loading tensors (safetensors), and hand out one
tensor at a time, so a conversion holds at most one source tensor in memory. A torch pickle in the zip
format (torch.save since 1.6) is memory-mapped; after each tensor is used the engine calls
`release(key)`, which returns its pages to the OS (madvise MADV_DONTNEED), so resident memory stays near
one tensor. A legacy (non-zip) pickle cannot be mapped and is loaded whole.

An index json may name shards in sub-folders (`transformer/diffusion_pytorch_model-00001-of-00004.safetensors`,
as the unified Cosmos3 release's root index does); paths must stay inside the index's folder.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import pickle
import sys
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from converters.errors import ConversionError, name_some

# safetensors header dtype tags <-> torch dtypes (names as `str(dtype)` without "torch.")
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _tag, _name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _name):
        ST_TO_TORCH[_tag] = getattr(torch, _name)
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}
ST_TO_TORCH_BY_NAME = {str(v).removeprefix("torch."): v for v in ST_TO_TORCH.values()}

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def dtype_name(d: torch.dtype | str) -> str:
    if isinstance(d, str):  # a safetensors tag; unknown tags are kept raw (and refused later by dtype policy)
        d = ST_TO_TORCH.get(d, d)
        if isinstance(d, str):
            return d
    return str(d).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ConversionError(f"unknown dtype {name!r}")
    return d


@dataclass(frozen=True)
class TensorInfo:
    key: str
    file: Path
    dtype: str                  # "float32", "bfloat16", ... (or the raw safetensors tag if torch lacks it)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class WeightReader:
    """Keys, shapes and dtypes of a checkpoint's tensors; `get(key)` loads one tensor."""

    kind: str = ""
    files: list[Path]         # every file read (for hashing), weights and index
    description: str = ""

    def infos(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def get(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def release(self, key: str) -> None:
        """The engine is done with `key`'s data: drop any cached/mapped memory it holds (may be re-read)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> "WeightReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _safe_open(path: Path):
    from safetensors import safe_open

    if not path.is_file():
        raise ConversionError(f"{path}: safetensors file not found")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: header corrupt, file truncated, not safetensors
        raise ConversionError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _data_offsets(path: Path) -> dict[tuple[Path, str], tuple[int, int]]:
    """{(path, key): (start, end)} absolute byte offsets, from the header (8-byte LE length + JSON)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        return {(path, k): (8 + n + int(v["data_offsets"][0]), 8 + n + int(v["data_offsets"][1]))
                for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ConversionError(f"{path}: not a readable safetensors file (header: {e})") from None


class SafetensorsReader(WeightReader):
    """One safetensors file, or the shards named by a `*.safetensors.index.json`. Headers are validated by the
    safetensors library; tensor data is read with plain file reads into fresh buffers (not memory-mapped), so
    resident memory holds only the tensors in use, whatever the checkpoint size."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offsets: dict[tuple[Path, str], tuple[int, int]] = {}   # absolute byte range of each tensor
        self._files: dict[Path, object] = {}
        self._infos: dict[str, TensorInfo] = {}
        if self.path.name.endswith(".index.json"):
            self.kind = "safetensors_index"
            shards = self._read_index(self.path)
            self.files = [self.path] + shards
            self.description = f"sharded safetensors ({len(shards)} shards, index {self.path.name})"
        else:
            self.kind = "safetensors"
            shards = [self.path]
            self.files = [self.path]
            self.description = "single safetensors file"
        self._scan(shards)

    def _read_index(self, index: Path) -> list[Path]:
        def no_dupes(pairs):
            seen: dict = {}
            for k, v in pairs:
                if k in seen:
                    raise ConversionError(f"{index}: key {k!r} is listed twice in the index "
                                          f"(-> {seen[k]!r} and {v!r})")
                seen[k] = v
            return seen

        try:
            data = json.loads(index.read_text(), object_pairs_hook=no_dupes)
        except FileNotFoundError:
            raise ConversionError(f"{index}: index file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{index}: invalid JSON ({e})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise ConversionError(f"{index}: expected an object with a non-empty 'weight_map'")
        self._index_map: dict[str, Path] = {}
        shards: list[Path] = []
        checked: dict[str, Path] = {}
        try:
            root = index.parent.resolve()
        except (RuntimeError, OSError) as e:
            raise ConversionError(f"{index}: its folder cannot be resolved ({e})") from None
        for k, f in wm.items():
            if not isinstance(f, str):  # e.g. a list of shards: not hashable, not a file name
                raise ConversionError(f"{index}: key {k!r} maps to {f!r}, not to one shard file name (a string)")
            if f not in checked:
                ok = bool(f) and "\\" not in f and not f.startswith("/") and all(
                    part not in ("", ".", "..") for part in f.split("/"))
                if ok:
                    try:
                        (index.parent / f).resolve().relative_to(root)
                    except ValueError:
                        ok = False  # a symlinked folder pointing outside
                    except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before Python 3.13)
                        raise ConversionError(f"{index}: key {k!r} maps to {f!r}, which cannot be resolved "
                                              f"({' '.join(str(e).split()) or type(e).__name__}: a symlink loop?)") from None
                if not ok:
                    raise ConversionError(f"{index}: key {k!r} maps to {f!r}, which is not a plain shard file name "
                                          f"(a relative path inside {index.parent})")
                checked[f] = index.parent / f
            p = checked[f]
            self._index_map[k] = p
            if p not in shards:
                shards.append(p)
        absent = [str(p.relative_to(index.parent)) for p in shards if not p.is_file()]
        if absent:
            raise ConversionError(f"{index}: shard file(s) named in the index are missing: {name_some(absent)}")
        return shards

    def _scan(self, shards: list[Path]) -> None:
        for shard in shards:
            h = _safe_open(shard)          # the library validates the header (offsets, dtypes, file length)
            self._offsets.update(_data_offsets(shard))
            try:
                keys = list(h.keys())
            except Exception as e:
                raise ConversionError(f"{shard}: cannot list tensors ({e})") from None
            for k in keys:
                if k in self._infos:
                    raise ConversionError(f"{shard}: duplicate key {k!r}: also present in shard "
                                          f"{self._infos[k].file} (one key, two shards)")
                try:
                    sl = h.get_slice(k)
                    tag, shape = sl.get_dtype(), tuple(int(s) for s in sl.get_shape())
                except Exception as e:
                    raise ConversionError(f"{shard}: key {k!r}: unreadable header entry ({e})") from None
                self._infos[k] = TensorInfo(k, shard, dtype_name(tag), shape)
        if self.kind == "safetensors_index":
            idx = self._index_map
            wrong = [k for k, inf in self._infos.items() if k in idx and idx[k] != inf.file]
            if wrong:
                k = wrong[0]
                raise ConversionError(f"{self.path}: key {k!r} is indexed in {idx[k].name} but stored in "
                                      f"{self._infos[k].file.name}")
            not_stored = [k for k in idx if k not in self._infos]
            if not_stored:
                k = not_stored[0]
                raise ConversionError(f"{self.path}: key {k!r} is indexed in {idx[k].name}, which does not hold it"
                                      + (f" ({len(not_stored)} such keys)" if len(not_stored) > 1 else ""))
            not_indexed = [k for k in self._infos if k not in idx]
            if not_indexed:
                k = not_indexed[0]
                raise ConversionError(f"{self._infos[k].file}: key {k!r} is stored in the shard but not listed in "
                                      f"{self.path.name}" + (f" ({len(not_indexed)} such keys)" if len(not_indexed) > 1 else ""))

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def get(self, key: str) -> torch.Tensor:
        inf = self._infos.get(key)
        if inf is None:
            raise ConversionError(f"{self.path}: no tensor {key!r}")
        dt = ST_TO_TORCH_BY_NAME.get(inf.dtype)
        if dt is None:
            raise ConversionError(f"{inf.file}: key {key!r} has dtype {inf.dtype}, which this torch cannot hold")
        start, end = self._offsets[(inf.file, key)]
        x = torch.empty(inf.shape, dtype=dt)
        want = x.numel() * x.element_size()
        if want != end - start:
            raise ConversionError(f"{inf.file}: key {key!r}: header gives {end - start} bytes for {inf.dtype} "
                                  f"{list(inf.shape)}, which needs {want}")
        if want == 0:
            return x
        try:
            f = self._files.get(inf.file)
            if f is None:
                f = self._files[inf.file] = open(inf.file, "rb")
            f.seek(start)
            n = f.readinto(memoryview(x.view(-1).view(torch.uint8).numpy()))
        except OSError as e:
            raise ConversionError(f"{inf.file}: key {key!r}: cannot read tensor data ({e.strerror or e})") from None
        if n != want:
            raise ConversionError(f"{inf.file}: key {key!r}: file ends after {n} of {want} bytes (truncated)")
        return x

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class TorchReader(WeightReader):
    """A `.pt/.pth/.bin` pickle holding a flat {str: Tensor} dict, loaded with `weights_only=True`."""

    kind = "torch"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = [self.path]
        self.description = "torch pickle (weights_only)"
        self.mapped = False
        if not self.path.is_file():
            raise ConversionError(f"{self.path}: file not found")
        self.mapped = False
        obj = self._load()
        if not self.mapped:
            self.description = "torch pickle (weights_only; legacy non-zip format, loaded whole)"
        if not isinstance(obj, dict):
            raise ConversionError(f"{self.path}: expected a flat dict of tensors (a state dict), "
                                  f"got {type(obj).__name__}")
        self._sd: dict[str, torch.Tensor] = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ConversionError(f"{self.path}: state dict key {k!r} is not a string")
            if isinstance(v, dict):
                raise ConversionError(f"{self.path}: key {k!r} holds a nested dict, not a tensor; expected a flat "
                                      f"state dict (extract it first, e.g. torch.save(ckpt[{k!r}], ...))")
            if not isinstance(v, torch.Tensor):
                raise ConversionError(f"{self.path}: key {k!r} holds a {type(v).__name__}, not a tensor; "
                                      f"expected a flat state dict")
            if v.layout != torch.strided or v.is_quantized or getattr(v, "is_nested", False):
                kind = "quantized" if v.is_quantized else "nested" if getattr(v, "is_nested", False) else str(v.layout)
                raise ConversionError(f"{self.path}: key {k!r} holds a {kind} tensor; only dense (strided) tensors "
                                      f"can be converted (save it with .to_dense())")
            self._sd[k] = v

    def _load(self):
        kw = dict(map_location="cpu", weights_only=True)
        try:
            with warnings.catch_warnings():  # torch warns about pickle protocols; our errors say enough
                warnings.simplefilter("ignore")
                zipped = zipfile.is_zipfile(self.path)
                try:
                    obj = torch.load(str(self.path), mmap=zipped, **kw)
                    self.mapped = zipped
                    return obj
                except RuntimeError as e:
                    if "mmap" not in str(e):
                        raise
                    return torch.load(str(self.path), **kw)
        except pickle.UnpicklingError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = next((ln for ln in lines if ln.startswith("Unsupported")), None)
            if why is None:
                tail = [ln.split("WeightsUnpickler error:", 1)[1].strip() for ln in lines if "WeightsUnpickler error:" in ln]
                why = tail[0] if tail and tail[0] else "it holds Python objects other than tensors"
            raise ConversionError(f"{self.path}: not a plain tensor state dict: torch.load(weights_only=True) "
                                  f"refused it ({why}); re-save it as torch.save(model.state_dict(), ...) or as "
                                  f"safetensors") from None
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConversionError(f"{self.path}: cannot load as a torch checkpoint ({type(e).__name__}: {first})") from None

    def infos(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(k, self.path, dtype_name(v.dtype), tuple(v.shape)) for k, v in self._sd.items()}

    def get(self, key: str) -> torch.Tensor:
        if key not in self._sd:
            raise ConversionError(f"{self.path}: no tensor {key!r}")
        return self._sd[key]

    def release(self, key: str) -> None:
        if self.mapped and key in self._sd:
            st = self._sd[key].untyped_storage()
            _dontneed(st.data_ptr(), st.nbytes())

    def close(self) -> None:
        self._sd = {}


_MADV_DONTNEED = 4
_LIBC = None


def _dontneed(ptr: int, nbytes: int) -> None:
    """Tell the kernel we no longer need the (file-backed, unmodified) pages in [ptr, ptr + nbytes): they leave
    this process's resident set and are re-read from the file if touched again. Linux only; else a no-op."""
    global _LIBC
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return
    page = mmap.PAGESIZE
    start = (ptr + page - 1) // page * page
    end = (ptr + nbytes) // page * page
    if end <= start:
        return
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
            _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
    except (OSError, AttributeError):  # pragma: no cover - no libc: memory is merely not returned early
        pass


def weight_kind_of(path: Path) -> str | None:
    n = path.name
    if n.endswith(".safetensors.index.json") or n.endswith(".index.json"):
        return "safetensors_index"
    if n.endswith(".safetensors"):
        return "safetensors"
    if n.endswith(TORCH_SUFFIXES):
        return "torch"
    return None


def open_weights(kind: str, path: Path) -> WeightReader:
    if kind in ("safetensors", "safetensors_index"):
        return SafetensorsReader(path)
    if kind == "torch":
        return TorchReader(path)
    raise ConversionError(f"{path}: unknown weight file kind {kind!r}")


def hash_files(paths: Iterable[Path], chunk: int = 1 << 22, stop=None) -> list[dict]:
    """[{"path", "bytes", "sha256"}] per file. `stop` (a threading.Event) aborts early (returns [])."""
    import hashlib

    out = []
    for p in paths:
        h = hashlib.sha256()
        n = 0
        try:
            with open(p, "rb") as f:
                while True:
                    if stop is not None and stop.is_set():
                        return []
                    b = f.read(chunk)
                    if not b:
                        break
                    h.update(b)
                    n += len(b)
        except OSError as e:
            raise ConversionError(f"{p}: cannot read ({e.strerror or e})") from None
        out.append({"path": str(p), "bytes": n, "sha256": h.hexdigest()})
    return out
