"""LoRA files -> canonical adapters, as strict as checkpoint conversion: the reader both sides
use (`fvconvert lora` in converters/lora.py writes the canonical file; the engine and fvgen load any of these).

Formats read (detected from the keys; a file mixing them is refused):
    diffusers   `transformer.blocks.0.attn1.to_q.lora_A.weight` / `lora_B.weight` (`save_lora_weights`); alpha from
                the safetensors metadata `lora_adapter_metadata` ("transformer.lora_alpha"), else alpha = r
    peft        `base_model.model.<module>.lora_A.weight` (a PEFT `adapter_model.safetensors`) or bare
                `<module>.lora_A.weight` (`get_peft_model_state_dict`); alpha from `adapter_config.json` beside it
    original    the Wan release / ComfyUI: `diffusion_model.blocks.0.self_attn.q.lora_down.weight` / `lora_up` (or
                lora_A / lora_B) and an optional `.alpha` per module (absent: alpha = r)
    kohya       `lora_unet_blocks_0_self_attn_q.lora_down.weight` / `lora_up` / `.alpha`
    canonical   what `save_adapter` writes: `<component>.<module>.lora_A.weight` / `lora_B.weight` / `.alpha` and
                the metadata `fvlora` (family, source format, version)

Refused, with one line naming the file and keys (ConversionError -> exit 2): a key no format explains, a module that
is no linear layer of the model, a half without its partner, shapes that do not fit the layer ([r, in] / [out, r]),
non-finite values, LoRA biases (`diff_b` / `lora_B.bias`: not supported), per-module PEFT rank / alpha patterns.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from manifests.errors import ManifestError
from manifests.lora import (KOHYA_PREFIX, LORA_COMPONENTS, ORIGINAL_PREFIXES, PEFT_PREFIX, LoraAdapter, LoraPair,
                            wan_original_to_canonical)

CANONICAL_META = "fvlora"
FORMATS = ("diffusers", "peft", "original", "kohya", "canonical")
_HALF = re.compile(r"^(?P<mod>.+)\.(?P<half>lora_A|lora_B|lora_down|lora_up)\.weight$")
_UP = {"lora_A": "down", "lora_down": "down", "lora_B": "up", "lora_up": "up"}


class LoraFormatError(ManifestError):
    """A LoRA file that cannot be read as an adapter of this model (CLIs exit 2)."""


def name_some(items, limit: int = 5) -> str:
    items = list(items)
    shown = ", ".join(repr(x) for x in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


# ------------------------------------------------------------------ model facts per family
def _wan_linears(cfg: Any) -> dict[str, dict[str, tuple[int, int]]]:
    from manifests.wan import dit_key_shapes

    out = {}
    for comp, dit in (("transformer", cfg.dit), ("transformer_2", cfg.dit_2 if cfg.two_experts else None)):
        if dit is not None:
            out[comp] = {k[: -len(".weight")]: tuple(s) for k, s in dit_key_shapes(dit).items()
                         if k.endswith(".weight") and len(s) == 2 and "norm" not in k}
    return out


def _wan_original_names(cfg: Any) -> dict[str, str]:
    return wan_original_to_canonical(cfg.dit.num_layers)


# family -> (linear layers {component: {module: (out, in)}}, original module names -> canonical)
FAMILY_FACTS: dict[str, tuple[Callable[[Any], dict], Callable[[Any], dict[str, str]]]] = {
    "wan": (_wan_linears, _wan_original_names),
}


def model_config(family: str, variant: str | None = None, model: str | Path | None = None) -> Any:
    """The model config a LoRA is checked against: a named variant or a converted model directory."""
    if family not in FAMILY_FACTS:
        raise LoraFormatError(f"LoRA conversion is not available for family {family!r} (known: "
                              f"{sorted(FAMILY_FACTS)})")
    if (variant is None) == (model is None):
        raise LoraFormatError("give the model the LoRA is for: --variant NAME or --model DIR (one of them)")
    if model is not None:
        from manifests.checkpoint import read_checkpoint
        ckpt = read_checkpoint(model, family=family)
        return ckpt.typed_config()
    from manifests.wan.model import list_model_variants, load_model_variant
    if variant not in list_model_variants():
        raise LoraFormatError(f"unknown {family} variant {variant!r}; variants: {', '.join(list_model_variants())}")
    return load_model_variant(variant)


# ------------------------------------------------------------------ reading files
def read_lora_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, dict | None, Path]:
    """(tensors, safetensors metadata, PEFT adapter_config or None, the tensor file). A directory holds one of
    adapter_model.safetensors (PEFT), pytorch_lora_weights.safetensors (diffusers) or a single *.safetensors."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if not p.exists():
        raise LoraFormatError(f"{p}: no such LoRA file or directory")
    if p.is_dir():
        names = [n for n in ("adapter_model.safetensors", "pytorch_lora_weights.safetensors") if (p / n).is_file()]
        found = names or sorted(x.name for x in p.glob("*.safetensors"))
        if len(found) != 1:
            raise LoraFormatError(f"{p}: expected one LoRA .safetensors file in the directory, found "
                                  f"{found or 'none'}")
        p = p / found[0]
    if p.suffix != ".safetensors":
        raise LoraFormatError(f"{p}: LoRA files are read from .safetensors only (pickles are not loaded)")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraFormatError(f"{p}: not a readable safetensors file ({' '.join(str(e).split())})") from None
    peft_config = None
    cfg_path = p.parent / "adapter_config.json"
    if cfg_path.is_file():
        try:
            peft_config = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise LoraFormatError(f"{cfg_path}: not valid JSON ({e})") from None
    return tensors, meta, peft_config, p


def detect_format(keys: list[str], meta: dict) -> str:
    if CANONICAL_META in meta:
        return "canonical"
    kinds = set()
    for k in keys:
        if k.startswith(ORIGINAL_PREFIXES):
            kinds.add("original")
        elif k.startswith(KOHYA_PREFIX):
            kinds.add("kohya")
        elif k.startswith(PEFT_PREFIX):
            kinds.add("peft")
        elif k.split(".", 1)[0] in LORA_COMPONENTS:
            kinds.add("diffusers")
        else:
            kinds.add("peft")   # bare module names: get_peft_model_state_dict(transformer)
    if len(kinds) != 1:
        raise LoraFormatError(f"LoRA keys mix formats {sorted(kinds)} (first keys: {name_some(sorted(keys), 3)})")
    return kinds.pop()


def _peft_alpha(fmt: str, meta: dict, peft_config: dict | None, where: str) -> dict[str, float | None]:
    """{component: alpha or None (= r)} from diffusers metadata or a PEFT adapter_config."""
    alphas: dict[str, float | None] = {c: None for c in LORA_COMPONENTS}
    if fmt == "diffusers" and "lora_adapter_metadata" in meta:
        try:
            packed = json.loads(meta["lora_adapter_metadata"])
        except json.JSONDecodeError as e:
            raise LoraFormatError(f"{where}: metadata lora_adapter_metadata is not JSON ({e})") from None
        for comp in LORA_COMPONENTS:
            sub = {k[len(comp) + 1:]: v for k, v in packed.items() if k.startswith(comp + ".")}
            if sub:
                _no_patterns(sub, where)
                alphas[comp] = float(sub["lora_alpha"]) if "lora_alpha" in sub else None
    if fmt == "peft" and peft_config is not None:
        _no_patterns(peft_config, where)
        if "lora_alpha" in peft_config:
            alphas["transformer"] = float(peft_config["lora_alpha"])
    return alphas


def _no_patterns(config: dict, where: str) -> None:
    for k in ("rank_pattern", "alpha_pattern"):
        if config.get(k):
            raise LoraFormatError(f"{where}: per-module PEFT {k} is not supported ({name_some(config[k], 3)})")
    if config.get("use_dora"):
        raise LoraFormatError(f"{where}: DoRA adapters (use_dora) are not LoRA; not supported")


def _split(fmt: str, key: str, original: dict[str, str], kohya: dict[str, str]) -> tuple[str, str, str] | None:
    """(component, canonical module, "down" | "up" | "alpha") or None when the key is no LoRA key of `fmt`."""
    comp = "transformer"
    if fmt == "diffusers":
        comp, _, key = key.partition(".")
    elif fmt == "peft" and key.startswith(PEFT_PREFIX):
        key = key[len(PEFT_PREFIX):]
    elif fmt in ("original", "kohya"):
        if fmt == "original":
            key = key[len(next(p for p in ORIGINAL_PREFIXES if key.startswith(p))):]
        if key.endswith(".alpha"):
            mod = key[: -len(".alpha")]
            mod = original.get(mod) if fmt == "original" else kohya.get(mod.removeprefix(KOHYA_PREFIX))
            return None if mod is None else (comp, mod, "alpha")
    m = _HALF.match(key)
    if m is None:
        return None
    mod = m["mod"]
    if fmt == "original":
        mod = original.get(mod)
    elif fmt == "kohya":
        mod = kohya.get(mod[len(KOHYA_PREFIX):]) if mod.startswith(KOHYA_PREFIX) else None
    elif m["half"] in ("lora_down", "lora_up"):
        return None   # (upstream) diffusers / PEFT keys are lora_A / lora_B only
    return None if mod is None else (comp, mod, _UP[m["half"]])


def convert_lora(tensors: dict[str, torch.Tensor], meta: dict, family: str, cfg: Any,
                 peft_config: dict | None = None, where: str = "LoRA") -> LoraAdapter:
    """Strictly map an upstream LoRA state dict onto the model's linear layers (LoraFormatError on anything off)."""
    linears_of, original_of = FAMILY_FACTS[family]
    linears = linears_of(cfg)
    if not tensors:
        raise LoraFormatError(f"{where}: holds no tensors")
    fmt = detect_format(sorted(tensors), meta)
    if fmt == "canonical":
        return _from_canonical(tensors, meta, family, linears, where)
    original = original_of(cfg)
    kohya = {o.replace(".", "_"): c for o, c in original.items()}
    alphas = _peft_alpha(fmt, meta, peft_config, where)
    halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    unknown, biases = [], []
    for key in sorted(tensors):
        parsed = _split(fmt, key, original, kohya)
        if parsed is None:
            (biases if key.endswith((".diff_b", ".lora_B.bias", ".diff")) else unknown).append(key)
            continue
        comp, mod, half = parsed
        if half in halves.setdefault((comp, mod), {}):
            raise LoraFormatError(f"{where}: {comp}.{mod} {half} given twice (key {key!r})")
        halves[(comp, mod)][half] = tensors[key]
    if biases:
        raise LoraFormatError(f"{where}: LoRA biases / full diffs are not supported: {name_some(biases)}")
    if unknown:
        raise LoraFormatError(f"{where}: {len(unknown)} key(s) are not {fmt} LoRA keys of a {family} linear layer: "
                              f"{name_some(unknown)}")
    targets = _pairs(halves, alphas, linears, where)
    return LoraAdapter(family, targets, fmt).validate()


def _pairs(halves: dict, alphas: dict, linears: dict, where: str) -> dict[str, dict[str, LoraPair]]:
    targets: dict[str, dict[str, LoraPair]] = {}
    for (comp, mod), h in sorted(halves.items()):
        name = f"{comp}.{mod}"
        if comp not in linears:
            raise LoraFormatError(f"{where}: component {comp!r} is not in this model (has {sorted(linears)})")
        if mod not in linears[comp]:
            raise LoraFormatError(f"{where}: {name} is not a linear layer of the model")
        for half in ("down", "up"):
            if half not in h:
                raise LoraFormatError(f"{where}: {name} has lora_{'B' if half == 'up' else 'A'} (the "
                                      f"{'up' if half == 'up' else 'down'} half) missing: a half without its partner")
        down, up = h["down"], h["up"]
        out_f, in_f = linears[comp][mod]
        if down.ndim != 2 or up.ndim != 2 or down.shape[1] != in_f or up.shape[0] != out_f or \
                up.shape[1] != down.shape[0]:
            raise LoraFormatError(f"{where}: {name}: lora_A {list(down.shape)} / lora_B {list(up.shape)} do not "
                                  f"fit the layer [{out_f}, {in_f}] (expected [r, {in_f}] / [{out_f}, r])")
        for half, t in (("lora_A", down), ("lora_B", up)):
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise LoraFormatError(f"{where}: {name}.{half} is not a finite floating-point tensor")
        alpha = h.get("alpha")
        if alpha is not None:
            if alpha.numel() != 1:
                raise LoraFormatError(f"{where}: {name}.alpha must hold one number, got shape {list(alpha.shape)}")
            alpha = float(alpha.reshape(()).item())
        else:
            alpha = alphas.get(comp)
        pair = LoraPair(down.to(torch.float32), up.to(torch.float32),
                        float(down.shape[0]) if alpha is None else float(alpha))
        targets.setdefault(comp, {})[mod] = pair
    return targets


def _from_canonical(tensors: dict, meta: dict, family: str, linears: dict, where: str) -> LoraAdapter:
    try:
        info = json.loads(meta[CANONICAL_META])
    except json.JSONDecodeError as e:
        raise LoraFormatError(f"{where}: metadata {CANONICAL_META} is not JSON ({e})") from None
    if info.get("family") != family:
        raise LoraFormatError(f"{where}: a {info.get('family')!r} adapter, not a {family} one")
    halves: dict = {}
    unknown = []
    for key, t in tensors.items():
        comp, _, rest = key.partition(".")
        for suffix, half in ((".lora_A.weight", "down"), (".lora_B.weight", "up"), (".alpha", "alpha")):
            if rest.endswith(suffix) and comp in LORA_COMPONENTS:
                halves.setdefault((comp, rest[: -len(suffix)]), {})[half] = t
                break
        else:
            unknown.append(key)
    if unknown:
        raise LoraFormatError(f"{where}: keys that are not canonical LoRA keys: {name_some(unknown)}")
    missing_alpha = [f"{c}.{m}" for (c, m), h in halves.items() if "alpha" not in h]
    if missing_alpha:
        raise LoraFormatError(f"{where}: canonical adapter without alpha for {name_some(missing_alpha)}")
    adapter = LoraAdapter(family, _pairs(halves, {}, linears, where), info.get("source_format", "canonical"))
    if info.get("version") and info["version"] != adapter.version:
        raise LoraFormatError(f"{where}: tensors do not match the recorded version {info['version']} "
                              f"(computed {adapter.version}): the file was altered")
    return adapter.validate()


def load_adapter(path: str | Path, family: str, cfg: Any, name: str | None = None) -> LoraAdapter:
    """Any supported LoRA file or directory -> a validated canonical adapter for the model `cfg` (named `name`,
    else the file's stem)."""
    tensors, meta, peft_config, file = read_lora_file(path)
    adapter = convert_lora(tensors, meta, family, cfg, peft_config, where=str(file))
    stem = Path(path).name if Path(path).is_dir() else file.stem
    default = re.sub(r"[^A-Za-z0-9._-]", "-", stem)[:64].lstrip("._-") or "lora"
    return adapter.with_name(name or default)


