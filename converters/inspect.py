"""`fvconvert inspect SRC`: what is this checkpoint? Format guess, key count, dtypes, shapes by group."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from converters.errors import ConversionError
from converters.families import family_formats, family_names, get_family
from converters.manifest import load_manifest
from converters.readers import TensorInfo, open_weights, torch_dtype, weight_kind_of
from converters.writer import INDEX_NAME, SINGLE_NAME

_LAYER = re.compile(r"^(.*?\b(?:layers|blocks|h)\.)(\d+)\.(.*)$")


def _candidates() -> list[tuple[str, str]]:
    seen, out = set(), []
    for fam in family_names():
        for fmt in family_formats(fam):
            for w in load_manifest(fam, fmt).weight_files:
                if w.path not in seen:
                    seen.add(w.path)
                    out.append((w.kind, w.path))
    for kind, name in (("safetensors_index", INDEX_NAME), ("safetensors", SINGLE_NAME)):
        if name not in seen:
            out.append((kind, name))
    return out


def _resolve(src: Path) -> tuple[str, Path, list[str]]:
    notes: list[str] = []
    if src.is_file():
        kind = weight_kind_of(src)
        if kind is None:
            raise ConversionError(f"{src}: unknown checkpoint file type; expected .safetensors, "
                                  f"*.safetensors.index.json, .pt, .pth or .bin (or a directory)")
        return kind, src, notes
    if not src.is_dir():
        raise ConversionError(f"{src}: source not found")
    present = [(k, src / n) for k, n in _candidates() if (src / n).is_file()]
    if not present:
        loose = sorted(p for p in src.iterdir() if p.is_file() and weight_kind_of(p))
        if len(loose) == 1:
            present = [(weight_kind_of(loose[0]), loose[0])]
        else:
            hint = (f"; this looks like a diffusers pipeline folder, inspect {src / 'transformer'}"
                    if (src / "model_index.json").is_file() else "")
            raise ConversionError(f"{src}: no checkpoint weights found"
                                  + (f" (several candidate files: {', '.join(p.name for p in loose[:5])}; pass one)" if loose else "")
                                  + hint)
    if len(present) > 1:
        notes.append("also present: " + ", ".join(p.name for _, p in present[1:]))
    return present[0][0], present[0][1], notes


def _nbytes(inf: TensorInfo) -> int:
    try:
        return torch_dtype(inf.dtype).itemsize * inf.numel
    except ConversionError:
        return 0


def _group(key: str) -> str:
    m = _LAYER.match(key)
    if m:
        rest = m.group(3).split(".")
        return f"{m.group(1)}*." + (rest[0] if len(rest) > 1 else m.group(3))
    parts = key.split(".")
    return parts[0] if len(parts) > 1 else key


def _config_path_for(m, src: Path, wpath: Path, config) -> Path | None:
    if config is not None:
        return Path(config)
    if src.is_dir():
        for w in m.weight_files:
            if w.config and (src / w.path).resolve() == wpath.resolve():
                return src / w.config
    if m.config_file and (wpath.parent / m.config_file).is_file():
        return wpath.parent / m.config_file
    return None


def _guess(fam, m, src: Path, wpath: Path, infos: dict[str, TensorInfo], config) -> dict[str, Any]:
    """How well manifest `m` explains the keys, and whether a strict conversion would pass (with the source's
    config, else with the first named variant that fits)."""
    from converters.engine import plan_conversion, read_source_config

    keys = list(infos)
    rules = [m.match(k)[0] for k in keys]
    g: dict[str, Any] = {"format": m.id, "matched": sum(r is not None for r in rules), "total": len(keys),
                         "strict": None, "variant": None, "fills": list(m.fills) if m.fills else None,
                         "dropped": sum(r is not None and r.op == "drop" for r in rules),
                         "sidecar": sum(r is not None and r.op == "sidecar" for r in rules),
                         "normalized": sum(m.normalize_key(k) != k for k in keys)}
    if not g["matched"]:
        return g
    cpath = _config_path_for(m, src, wpath, config)
    if cpath is not None and cpath.is_file():
        try:
            cfg, _ = read_source_config(fam, m, cpath)
            plan = plan_conversion(fam, m, cfg, infos, allow_truncate=False)
            g["strict"] = "ok"
            g["parts"] = plan.parts
            return g
        except Exception as e:  # noqa: BLE001 - a guess, reported as text
            g["strict"] = str(e)
            if m.config_file is not None:
                return g
    for v in fam.list_variants():
        try:
            plan = plan_conversion(fam, m, fam.load_variant(v), infos, allow_truncate=False)
        except Exception:  # noqa: BLE001
            continue
        g["strict"], g["variant"], g["parts"] = "ok", v, plan.parts
        return g
    if g["strict"] is None:
        g["strict"] = "no config to check against, and no named variant fits (pass --config)"
    return g


def _canonical_guess(fam, root: Path, raw_cfg, infos: dict[str, TensorInfo]) -> dict[str, Any]:
    keys = list(infos)
    g: dict[str, Any] = {"format": f"{fam.name}/canonical", "matched": 0, "total": len(keys), "strict": None}
    if not isinstance(raw_cfg, dict):
        return g
    try:
        from converters.canonical import canonical_parts

        cfg = fam.config_from_dict(raw_cfg)
        held = canonical_parts(root, fam, cfg)
        by_part = fam.part_keys(cfg)
        want = {k: s for k, s in fam.key_shapes(cfg).items()
                if any(k in by_part.get(p, []) for p in held["filled"])}
        g["matched"] = sum(k in want for k in keys)
        bad = [k for k in keys if k not in want or tuple(infos[k].shape) != tuple(want[k])]
        miss = [k for k in want if k not in infos]
        g["strict"] = "ok" if not bad and not miss else f"{len(bad)} unexpected/mis-shaped, {len(miss)} missing"
        g["parts"] = held
        g["fills"] = held["filled"]
    except Exception as e:  # noqa: BLE001
        g["strict"] = f"config.json is not a canonical {fam.name} config ({str(e)[:120]})"
    return g


def inspect_source(src: str | Path, config: str | Path | None = None, list_keys: bool = False) -> dict[str, Any]:
    src = Path(src)
    kind, wpath, notes = _resolve(src)
    cpath = Path(config) if config is not None else wpath.parent / "config.json"
    raw_cfg = None
    if cpath.is_file():
        try:
            raw_cfg = json.loads(cpath.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            notes.append(f"{cpath.name} unreadable ({e})")
    with open_weights(kind, wpath) as reader:
        infos = reader.infos()
        files = [str(p) for p in reader.files]
        desc = reader.description
    keys = list(infos)
    dtypes = Counter(i.dtype for i in infos.values())

    guesses = []
    for fam_name in family_names():
        fam = get_family(fam_name)
        for fmt in family_formats(fam_name):
            m = load_manifest(fam_name, fmt)
            guesses.append(_guess(get_family(fam_name, m.component), m, src, wpath, infos, config))
        guesses.append(_canonical_guess(fam, src if src.is_dir() else wpath.parent, raw_cfg, infos))
    guesses.sort(key=lambda g: (g["strict"] == "ok", g["matched"] / max(1, g["total"]),
                                len((g.get("parts") or {}).get("filled", ())), -g.get("dropped", 0)), reverse=True)
    best = guesses[0] if guesses and guesses[0]["matched"] else None

    groups: dict[str, dict] = defaultdict(lambda: {"keys": 0, "params": 0, "dtypes": Counter(), "shapes": Counter()})
    layer_ids = set()
    for k, inf in infos.items():
        g = groups[_group(k)]
        g["keys"] += 1
        g["params"] += inf.numel
        g["dtypes"][inf.dtype] += 1
        g["shapes"][tuple(inf.shape)] += 1
        m = _LAYER.match(k)
        if m:
            layer_ids.add(int(m.group(2)))
    return {
        "src": str(src), "kind": kind, "description": desc, "weights": str(wpath), "files": files,
        "config": str(cpath) if raw_cfg is not None else None,
        "config_class": raw_cfg.get("_class_name") if isinstance(raw_cfg, dict) else None,
        "num_keys": len(keys), "num_params": sum(i.numel for i in infos.values()),
        "bytes": sum(_nbytes(i) for i in infos.values()), "dtypes": dict(dtypes),
        "num_layers_seen": (max(layer_ids) + 1) if layer_ids else 0,
        "guesses": guesses, "best": best["format"] if best else None, "notes": notes,
        "groups": [{"group": name, "keys": g["keys"], "params": g["params"], "dtypes": dict(g["dtypes"]),
                    "shapes": [list(s) for s, _ in g["shapes"].most_common(3)]} for name, g in sorted(groups.items())],
        "keys": [{"key": k, "dtype": i.dtype, "shape": list(i.shape)} for k, i in infos.items()] if list_keys else None,
    }


def human_count(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}" if unit == "" else f"{n:.2f}{unit}"
        n /= 1000
    return str(n)  # pragma: no cover


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover

