"""The one reader of canonical checkpoints (what `fvconvert` writes), shared by reference/, optimized/, parity/.

Stdlib + torch only: safetensors files are parsed by hand (8-byte little-endian header length, JSON header,
raw little-endian bytes), so loading needs neither the safetensors package nor converters/.

Two directory shapes:

    single component (today's fvconvert output)       model directory (a whole pipeline, `fvconvert wan
        config.json        the component config        --from diffusers <pipeline root>`)
        manifest.json      family, component, format,     model_index.json  {"family", "format_version": 1,
                           parts, weights_version                            "config": whole-model config,
        model.safetensors  (or model-0000i-of-0000n                          "components": {name: subdir},
                           .safetensors + model.safetensors                  "assets": {name: subdir},
                           .index.json)                                      "weights_version"}
        conversion_report.json                            <subdir>/         one single-component dir each
                                                          tokenizer/, scheduler/   copied verbatim (assets)

    ckpt = read_checkpoint("out/wan-t2v")              # headers and JSON only; strict
    state = load_state(ckpt, component="transformer", dtype=torch.bfloat16)

`weights_version` is read from what fvconvert wrote (manifest.json / model_index.json); tensors are never hashed
on load. A directory without a manifest.json is a (legacy) cosmos3 transformer.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from manifests.errors import CheckpointError, ManifestError
from manifests.serialise import read_json_object

FORMAT_VERSION = 1
MODEL_INDEX = "model_index.json"
CONFIG_NAME = "config.json"
MANIFEST_NAME = "manifest.json"
REPORT_NAME = "conversion_report.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
LEGACY_FAMILY = "cosmos3"          # a canonical dir without manifest.json (written before manifests were recorded)
MAX_HEADER_BYTES = 100 * 2**20




# ---------------------------------------------------------------------------------------------
# canonical layouts: each family declares its own in manifests/<family>/layout.py (manifests/layouts.py discovers
# them); this reader names no family

from manifests.layouts import (ComponentLayout, FamilyLayout, ModelLayout, Part, family_layouts,  # noqa: E402
                               part_names, part_of, split_by_part)


def family_names() -> list[str]:
    return sorted(family_layouts())


def _family_layout(family: str) -> FamilyLayout:
    layouts = family_layouts()
    if family not in layouts:
        raise CheckpointError(f"unknown model family {family!r}; known families: {', '.join(family_names())}")
    return layouts[family]


def default_component(family: str) -> str:
    """The component a family's single-component dir holds when its manifest.json names none (the family's first
    declared component: dirs written before components were recorded held it)."""
    return _family_layout(family).default_component


def component_kinds(family: str) -> list[str]:
    return sorted(c.component for c in _family_layout(family).components)


def get_layout(family: str, component: str | None = None) -> ComponentLayout:
    fam = _family_layout(family)
    layout = fam.component(component or fam.default_component)
    if layout is None:
        raise CheckpointError(f"{family} has no component {component!r}; components: "
                              f"{', '.join(component_kinds(family))}")
    return layout


def model_families() -> list[str]:
    """The families with a whole-model directory format (a declared ModelLayout)."""
    return sorted(n for n, f in family_layouts().items() if f.model is not None)


def model_config_parser(family: str) -> tuple[Callable[[dict], Any], Callable[[Any], dict[str, tuple[str, Any]]]]:
    model = family_layouts()[family].model if family in family_layouts() else None
    if model is None:
        raise CheckpointError(f"family {family!r} has no whole-model directory format; known: "
                              f"{', '.join(model_families())}")
    return model.config_from_dict, model.components


def weights_version_of(entries: Iterable[tuple[str, str]]) -> str:
    """'sha256:<hex>' over (name, sha256) pairs, order-independent: what fvconvert records as weights_version."""
    h = hashlib.sha256()
    for name, digest in sorted(entries):
        h.update(f"{name}\0{digest}\n".encode())
    return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------------------------------------
# what a directory holds (JSON and headers only)


@dataclass(frozen=True)
class ComponentCheckpoint:
    name: str                          # its name in the model ("transformer_2"); the kind for a single dir
    kind: str                          # layout component kind (transformer | text_encoder | vae)
    family: str
    path: Path
    config: dict                       # config.json as written
    files: tuple[Path, ...]            # weight files (shards), then the index if sharded
    parts_filled: tuple[str, ...]
    parts_unfilled: tuple[str, ...]
    format: str | None = None          # the upstream format it was converted from (None: not recorded)
    weights_version: str | None = None

    @property
    def partial(self) -> bool:
        return bool(self.parts_unfilled)

    @property
    def layout(self) -> ComponentLayout:
        return get_layout(self.family, self.kind)

    def typed_config(self) -> Any:
        try:
            return self.layout.read_config(self.config)
        except ManifestError as e:
            raise CheckpointError(f"{self.path / CONFIG_NAME}: {e}") from None


@dataclass(frozen=True)
class CanonicalCheckpoint:
    path: Path
    family: str
    config: dict                       # model dir: the whole-model config; single dir: the component config
    components: dict[str, ComponentCheckpoint]
    weights_version: str | None
    partial: bool
    is_model: bool = False             # a model directory (model_index.json)
    assets: dict[str, Path] = field(default_factory=dict)

    def component(self, name: str | None = None) -> ComponentCheckpoint:
        if name is None:
            if len(self.components) == 1:
                return next(iter(self.components.values()))
            raise CheckpointError(f"{self.path}: a model directory with components {', '.join(self.components)}; "
                                  f"name one (component=...)")
        if name not in self.components:
            raise CheckpointError(f"{self.path}: no component {name!r}; it holds {', '.join(self.components)}")
        return self.components[name]

    def typed_config(self) -> Any:
        """The whole-model config (model dir) or the component config (single dir), validated."""
        if not self.is_model:
            return self.component().typed_config()
        parse, _ = model_config_parser(self.family)
        try:
            return parse(self.config)
        except ManifestError as e:
            raise CheckpointError(f"{self.path / MODEL_INDEX}: {e}") from None


def _json_object(path: Path, what: str) -> dict:
    return read_json_object(path, what, CheckpointError)


def _weight_files(root: Path) -> tuple[Path, ...]:
    single, index = root / SINGLE_NAME, root / INDEX_NAME
    if single.is_file() and index.is_file():
        raise CheckpointError(f"{root}: both {SINGLE_NAME} and {INDEX_NAME} are present; ambiguous")
    if single.is_file():
        return (single,)
    if not index.is_file():
        raise CheckpointError(f"{root}: no {SINGLE_NAME} or {INDEX_NAME}")
    wm = _json_object(index, "safetensors index").get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map keys to shard file names")
    shards = []
    for name in dict.fromkeys(wm.values()):
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointError(f"{index}: shard {name!r} must be a file beside the index")
        if not (root / name).is_file():
            raise CheckpointError(f"{root / name}: shard named by {INDEX_NAME} is missing")
        shards.append(root / name)
    return (*shards, index)


def _read_component(root: Path, name: str | None = None, family: str | None = None) -> ComponentCheckpoint:
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a canonical checkpoint directory")
    mpath = root / MANIFEST_NAME
    rec = _json_object(mpath, "manifest") if mpath.is_file() else {}
    fam = rec.get("family", family or LEGACY_FAMILY)
    if family is not None and fam != family:
        raise CheckpointError(f"{mpath}: a {fam} checkpoint, not {family}")
    if fam not in family_layouts():
        raise CheckpointError(f"{mpath}: unknown family {fam!r}; known families: {', '.join(family_names())}")
    kind = rec.get("component") or default_component(fam)
    layout = get_layout(fam, kind)
    config = _json_object(root / CONFIG_NAME, "config file")
    parts = rec.get("parts")
    try:
        cfg = layout.read_config(config)
    except ManifestError as e:
        raise CheckpointError(f"{root / CONFIG_NAME}: {e}") from None
    if parts is None:
        filled, unfilled = list(layout.part_keys(cfg)), []
    else:
        if not isinstance(parts, dict) or not isinstance(parts.get("filled"), list) \
                or not isinstance(parts.get("unfilled"), list):
            raise CheckpointError(f"{mpath}: 'parts' must hold 'filled' and 'unfilled' lists")
        filled, unfilled = list(parts["filled"]), list(parts["unfilled"])
        unknown = [p for p in filled + unfilled if p not in layout.part_names]
        if unknown:
            raise CheckpointError(f"{mpath}: unknown {fam} part(s) {unknown}; parts: {', '.join(layout.part_names)}")
    version = rec.get("weights_version")
    if version is None and (root / REPORT_NAME).is_file():
        version = _json_object(root / REPORT_NAME, "conversion report").get("weights_version")
    if version is not None and not (isinstance(version, str) and version.startswith("sha256:")):
        raise CheckpointError(f"{mpath}: weights_version must be 'sha256:<hex>', got {version!r}")
    return ComponentCheckpoint(name=name or kind, kind=kind, family=fam, path=root, config=config,
                               files=_weight_files(root), parts_filled=tuple(filled), parts_unfilled=tuple(unfilled),
                               format=rec.get("format"), weights_version=version)


def _subdir(root: Path, index: Path, what: str, name: str, sub: Any) -> Path:
    if not isinstance(sub, str) or not sub or sub.startswith("/") or "\\" in sub \
            or any(p in ("", ".", "..") for p in sub.split("/")):
        raise CheckpointError(f"{index}: {what} {name!r} must name a sub-directory, got {sub!r}")
    return root / sub


def read_checkpoint(path: str | Path, family: str | None = None) -> CanonicalCheckpoint:
    """What a canonical checkpoint directory holds (configs, files, parts, weights_version), strictly checked:
    unknown family, missing files, a model config that disagrees with a component's config are errors.
    `family`, when given, must be the recorded family."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a canonical checkpoint directory")
    index = root / MODEL_INDEX
    if not index.is_file():
        comp = _read_component(root, family=family)
        return CanonicalCheckpoint(path=root, family=comp.family, config=comp.config, components={comp.name: comp},
                                   weights_version=comp.weights_version, partial=comp.partial)
    data = _json_object(index, "model index")
    fam = data.get("family")
    if fam not in model_families():
        raise CheckpointError(f"{index}: unknown family {fam!r} for a model directory; known: {', '.join(model_families())}")
    if family is not None and fam != family:
        raise CheckpointError(f"{index}: a {fam} model, not {family}")
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{index}: format_version {data.get('format_version')!r}; this reader knows {FORMAT_VERSION}")
    config, comps, assets = data.get("config"), data.get("components"), data.get("assets", {})
    if not isinstance(config, dict) or not isinstance(comps, dict) or not comps or not isinstance(assets, dict):
        raise CheckpointError(f"{index}: needs 'config' (object) and 'components' (non-empty object name -> subdir)")
    parse, expected = model_config_parser(fam)
    try:
        model_cfg = parse(config)
    except ManifestError as e:
        raise CheckpointError(f"{index}: {e}") from None
    want = expected(model_cfg)
    extra = [n for n in comps if n not in want]
    if extra:
        raise CheckpointError(f"{index}: component(s) {extra} are not part of this {fam} model "
                              f"(it has {', '.join(want)})")
    lacking = [n for n in want if n not in comps]
    if lacking:
        raise CheckpointError(f"{index}: the {fam} model config needs component(s) {', '.join(lacking)}, "
                              f"which 'components' does not list")
    components: dict[str, ComponentCheckpoint] = {}
    for name, sub in comps.items():
        d = _subdir(root, index, "component", name, sub)
        if not d.is_dir():
            raise CheckpointError(f"{d}: component {name!r} listed in {MODEL_INDEX} is missing")
        kind, cfg = want[name]
        of_family, _, kind = kind.rpartition(":")      # "wan:vae": a component stored with another family's layout
        c = _read_component(d, name=name, family=of_family or fam)
        if c.kind != kind:
            raise CheckpointError(f"{d / MANIFEST_NAME}: component {name!r} must be a {kind}, the directory holds a {c.kind}")
        if c.typed_config() != cfg:
            raise CheckpointError(f"{d / CONFIG_NAME}: the {name} config differs from the one in {index}")
        components[name] = c
    asset_dirs = {}
    for name, sub in assets.items():
        d = _subdir(root, index, "asset", name, sub)
        if not d.is_dir():
            raise CheckpointError(f"{d}: asset {name!r} listed in {MODEL_INDEX} is missing")
        asset_dirs[name] = d
    version = data.get("weights_version")
    if version is not None and not (isinstance(version, str) and version.startswith("sha256:")):
        raise CheckpointError(f"{index}: weights_version must be 'sha256:<hex>', got {version!r}")
    return CanonicalCheckpoint(path=root, family=fam, config=config, components=components, weights_version=version,
                               partial=any(c.partial for c in components.values()), is_model=True, assets=asset_dirs)


# ---------------------------------------------------------------------------------------------
# tensors: safetensors parsed by hand

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int                         # absolute byte offset in the file
    nbytes: int


def _read_header(path: Path) -> dict[str, _Entry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: header length {n} exceeds the file; not a safetensors file or truncated")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    base, out = 8 + n, {}
    for key, e in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = _ST_DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: key {key!r} has a malformed header entry "
                                  f"(dtype {e.get('dtype') if isinstance(e, dict) else e!r})") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b and b - a == nbytes and base + b <= size):
            raise CheckpointError(f"{path}: key {key!r}: data offsets {[a, b]} do not fit {nbytes} bytes in the file "
                                  f"(truncated?)")
        out[key] = _Entry(path, dtype, shape, base + a, nbytes)
    return out


def _headers(comp: ComponentCheckpoint) -> dict[str, _Entry]:
    shards = [f for f in comp.files if f.name != INDEX_NAME]
    entries: dict[str, _Entry] = {}
    wm = None
    if len(comp.files) > len(shards):
        wm = _json_object(comp.path / INDEX_NAME, "safetensors index")["weight_map"]
    for f in shards:
        for k, e in _read_header(f).items():
            if k in entries:
                raise CheckpointError(f"{f}: key {k!r} is also in {entries[k].file.name}")
            if wm is not None and wm.get(k) != f.name:
                raise CheckpointError(f"{f}: key {k!r} is not mapped to this shard by {INDEX_NAME}")
            entries[k] = e
    if wm is not None:
        absent = [k for k in wm if k not in entries]
        if absent:
            raise CheckpointError(f"{comp.path / INDEX_NAME}: key {absent[0]!r} is in the weight_map but in no shard")
    return entries


TensorEntry = _Entry   # public name of one tensor's header entry: file, dtype, shape, absolute byte offset, nbytes


def tensor_index(comp: ComponentCheckpoint) -> dict[str, TensorEntry]:
    """Every tensor of a component as {key: TensorEntry}, read from the safetensors headers only (no tensor data),
    validated as load_state validates them: offsets fit each file, no key in two shards, the shard index (if any)
    maps every key to its file. For readers that take byte ranges themselves (e.g. a tensor-parallel rank reading
    only its slices: optimized/models/wan/parallelize.py); keys and shapes are NOT checked against a config."""
    return _headers(comp)


def _read_tensor(f, e: _Entry) -> torch.Tensor:
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=e.dtype)
    f.seek(e.start)
    buf = bytearray(e.nbytes)
    if f.readinto(buf) != e.nbytes:
        raise CheckpointError(f"{e.file}: short read (file truncated?)")
    return torch.frombuffer(buf, dtype=e.dtype).reshape(e.shape)


def _fmt(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(x) for x in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def load_state(path_or_ckpt: str | Path | CanonicalCheckpoint, component: str | None = None,
               parts: Iterable[str] | None = None, dtype: torch.dtype | None = None,
               check_finite: bool = False) -> dict[str, torch.Tensor]:
    """{canonical key: tensor} of one component, in canonical key order. Strict: the key set must equal the
    layout's key set for the component's config (or, with `parts`, those parts' keys; a partial checkpoint
    loads only with `parts` it holds), shapes must match, tensors must be floating point. `dtype` casts every
    tensor except the layout's fp32 keys. A model directory needs `component` (e.g. "transformer")."""
    if sys.byteorder != "little":  # pragma: no cover
        raise CheckpointError("reading safetensors needs a little-endian host")
    ckpt = path_or_ckpt if isinstance(path_or_ckpt, CanonicalCheckpoint) else read_checkpoint(path_or_ckpt)
    comp = ckpt.component(component)
    layout, cfg, root = comp.layout, comp.typed_config(), comp.path
    by_part = layout.part_keys(cfg)
    filled = list(comp.parts_filled)
    if parts is None:
        if comp.partial:
            fmt = comp.format or "?"
            raise CheckpointError(
                f"{root}: partial canonical checkpoint: it holds part(s) {', '.join(filled)} only (converted from "
                f"{comp.family}/{fmt}) and lacks {', '.join(comp.parts_unfilled)}, which the full model (e.g. the "
                f"generator) needs; load what it holds with load_state(path, parts={filled!r}) "
                f"(or load_canonical(path, parts={filled!r}))")
        want_parts = list(by_part)
    else:
        want_parts = list(dict.fromkeys(parts))
        bad = [p for p in want_parts if p not in layout.part_names]
        if bad:
            raise CheckpointError(f"unknown {comp.family} part(s) {bad}; parts: {', '.join(layout.part_names)}")
        lacking = [p for p in want_parts if p in by_part and p not in filled]
        if lacking:
            raise CheckpointError(f"{root}: does not hold part(s) {', '.join(lacking)} (it holds {', '.join(filled)})")
    allowed = {k for p in filled for k in by_part.get(p, [])}
    want_keys = {k for p in want_parts for k in by_part.get(p, [])}
    shapes = layout.key_shapes(cfg)
    fp32 = set(layout.fp32_keys(cfg))
    entries = _headers(comp)
    extra = [k for k in entries if k not in allowed]
    if extra:
        what = "this" if not comp.partial else f"the parts ({', '.join(filled)}) of this partial"
        raise CheckpointError(f"{entries[extra[0]].file}: unexpected key {extra[0]!r} for {what} {comp.family} "
                              f"{comp.kind} config ({len(extra)} unexpected: {_fmt(extra)})")
    missing = [k for k in shapes if k in allowed and k not in entries]
    if missing:
        raise CheckpointError(f"{comp.files[-1]}: missing canonical key {missing[0]!r} "
                              f"({len(missing)} missing: {_fmt(missing)})")
    for k in want_keys:
        e = entries[k]
        if e.shape != tuple(shapes[k]):
            raise CheckpointError(f"{e.file}: key {k!r} has shape {list(e.shape)}, the config needs {list(shapes[k])}")
        if not e.dtype.is_floating_point:
            raise CheckpointError(f"{e.file}: key {k!r} has non-floating dtype {e.dtype}")
    out: dict[str, torch.Tensor] = {}
    handles: dict[Path, Any] = {}
    try:
        for k in shapes:
            if k not in want_keys:
                continue
            e = entries[k]
            if e.file not in handles:
                handles[e.file] = open(e.file, "rb")
            x = _read_tensor(handles[e.file], e)
            if check_finite and not bool(torch.isfinite(x).all()):
                raise CheckpointError(f"{e.file}: key {k!r} holds NaN/Inf values")
            if dtype is not None and k not in fp32:
                x = x.to(dtype)
            out[k] = x
    finally:
        for h in handles.values():
            h.close()
    return out


__all__ = ["CanonicalCheckpoint", "CheckpointError", "ComponentCheckpoint", "ComponentLayout", "FamilyLayout",
           "ModelLayout", "Part", "default_component", "FORMAT_VERSION", "model_families", "part_names", "part_of",
           "split_by_part", "MODEL_INDEX", "component_kinds", "family_names", "get_layout",
           "load_state", "model_config_parser", "read_checkpoint", "TensorEntry", "tensor_index",
           "weights_version_of"]
