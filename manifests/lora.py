"""LoRA adapters as data, shared by both sides: the canonical adapter, per-request references, and the upstream
naming facts the converter reads (diffusers / PEFT and the original Wan release / ComfyUI / kohya).

A canonical adapter holds, per model component ("transformer", "transformer_2") and per target module (a
canonical linear layer name, e.g. `blocks.0.attn1.to_q`), the pair lora_A [r, in] / lora_B [out, r] and its alpha.
Its effect on the layer (PEFT / diffusers semantics):

    W' = W + scale * (alpha / r) * B @ A          (merged)
    y  = x W^T + b + scale * (alpha / r) * (x A^T) B^T      (unmerged, per row)

`scale` is the per-request (or per-merge) adapter weight, diffusers' `set_adapters(..., adapter_weights=scale)`.
The version of an adapter is a hash over its tensors and alphas: a CacheKey's `adapter_versions` names it.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from manifests.errors import ManifestError, RequestFieldError

LORA_COMPONENTS = ("transformer", "transformer_2")   # the components an adapter may target (diffusers' names)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_ADAPTERS_PER_REQUEST = 4
SCALE_BOUND = 100.0

# ---- upstream naming facts (the original Wan release, as read by diffusers 0.42.1
#      `_convert_non_diffusers_wan_lora_to_diffusers`): original module -> canonical module, per block
WAN_ORIGINAL_BLOCK_MODULES = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj",
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}
WAN_ORIGINAL_TOP_MODULES = {
    "head.head": "proj_out", "time_projection.1": "condition_embedder.time_proj",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
}
ORIGINAL_PREFIXES = ("diffusion_model.", "model.diffusion_model.")   # the release / ComfyUI prefixes
KOHYA_PREFIX = "lora_unet_"                                          # kohya: dots of the original name as "_"
PEFT_PREFIX = "base_model.model."


def wan_original_to_canonical(num_layers: int) -> dict[str, str]:
    """Every original-release module name of a Wan DiT with `num_layers` blocks -> its canonical name."""
    out = dict(WAN_ORIGINAL_TOP_MODULES)
    for i in range(num_layers):
        for o, c in WAN_ORIGINAL_BLOCK_MODULES.items():
            out[f"blocks.{i}.{o}"] = f"blocks.{i}.{c}"
    return out


@dataclass(frozen=True)
class LoraPair:
    """One target's low-rank pair: down [r, in] and up [out, r] (fp32 on the host), and its alpha."""
    down: Any
    up: Any
    alpha: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def factor(self) -> float:
        """alpha / r: what multiplies B @ A before the adapter weight (PEFT `scaling`)."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class LoraAdapter:
    """A canonical adapter: {component: {target module: LoraPair}} for one family, with where it came from."""
    family: str
    targets: dict[str, dict[str, LoraPair]]
    source_format: str = "canonical"
    name: str = ""
    version: str = field(default="")

    def __post_init__(self) -> None:
        if not self.version:
            object.__setattr__(self, "version", adapter_version(self.targets))

    def validate(self) -> "LoraAdapter":
        if not self.targets or not any(self.targets.values()):
            raise ManifestError("LoRA adapter targets no layer")
        for comp, mods in self.targets.items():
            if comp not in LORA_COMPONENTS:
                raise ManifestError(f"LoRA adapter component {comp!r}: must be one of {LORA_COMPONENTS}")
            for mod, pair in mods.items():
                if pair.down.ndim != 2 or pair.up.ndim != 2 or pair.up.shape[1] != pair.down.shape[0]:
                    raise ManifestError(f"LoRA {comp}.{mod}: lora_A {list(pair.down.shape)} and lora_B "
                                        f"{list(pair.up.shape)} are not [r, in] / [out, r]")
                if not math.isfinite(pair.alpha) or pair.alpha <= 0:
                    raise ManifestError(f"LoRA {comp}.{mod}: alpha must be a finite number > 0, got {pair.alpha}")
        return self

    def with_name(self, name: str) -> "LoraAdapter":
        return LoraAdapter(self.family, self.targets, self.source_format, check_name(name), self.version)

    def modules(self) -> list[str]:
        return sorted(f"{c}.{m}" for c, mods in self.targets.items() for m in mods)

    def ranks(self) -> list[int]:
        return sorted({p.rank for mods in self.targets.values() for p in mods.values()})


def adapter_version(targets: dict[str, dict[str, LoraPair]]) -> str:
    """"lora:" + sha256 over component, module, alpha and both tensors' bytes, in sorted order."""
    import torch

    h = hashlib.sha256()
    for comp in sorted(targets):
        for mod in sorted(targets[comp]):
            p = targets[comp][mod]
            h.update(f"{comp}.{mod}:{p.alpha!r}".encode())
            for t in (p.down, p.up):
                t = t.detach().to("cpu", torch.float32).contiguous()
                h.update(repr(tuple(t.shape)).encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "lora:" + h.hexdigest()[:24]


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise ManifestError(f"LoRA name {name!r}: 1-64 characters of letters, digits, '.', '_' or '-'")
    return name


@dataclass(frozen=True)
class LoraRef:
    """A request's use of a loaded adapter: its name and its weight (diffusers' adapter weight)."""
    name: str
    scale: float = 1.0

    def validate(self) -> "LoraRef":
        try:
            check_name(self.name)
        except ManifestError as e:
            raise RequestFieldError(str(e), "lora") from None
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or \
                not math.isfinite(self.scale) or abs(self.scale) > SCALE_BOUND:
            raise RequestFieldError(f"lora {self.name!r}: scale must be a finite number within "
                                    f"[-{SCALE_BOUND:g}, {SCALE_BOUND:g}], got {self.scale!r}", "lora")
        return self


def parse_lora_field(value: Any) -> tuple[LoraRef, ...]:
    """The request field `lora`: a name, {name, scale}, or a list of names / {name, scale} (RequestFieldError)."""
    if value is None:
        return ()
    items: Iterable[Any] = value if isinstance(value, (list, tuple)) else [value]
    refs = []
    for item in items:
        if isinstance(item, LoraRef):
            ref = item
        elif isinstance(item, str):
            ref = LoraRef(item)
        elif isinstance(item, dict):
            unknown = sorted(set(item) - {"name", "scale"})
            if unknown or "name" not in item:
                raise RequestFieldError(f"lora: each entry is a name or {{name, scale}}; got keys {sorted(item)}",
                                        "lora")
            ref = LoraRef(item["name"], item.get("scale", 1.0))
        else:
            raise RequestFieldError(f"lora: each entry is a name or {{name, scale}}, got {type(item).__name__}",
                                    "lora")
        refs.append(ref.validate())
    names = [r.name for r in refs]
    if len(set(names)) != len(names):
        raise RequestFieldError(f"lora: adapter named twice in {names}", "lora")
    if len(refs) > MAX_ADAPTERS_PER_REQUEST:
        raise RequestFieldError(f"lora: at most {MAX_ADAPTERS_PER_REQUEST} adapters per request, got {len(refs)}",
                                "lora")
    return tuple(refs)


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """`FILE[:scale]` (fvgen --lora): the path and the scale (1.0 when absent). ManifestError when malformed."""
    path, sep, tail = spec.rpartition(":")
    if sep and path and re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?", tail):
        scale = float(tail)
        if not math.isfinite(scale) or abs(scale) > SCALE_BOUND:
            raise ManifestError(f"--lora {spec!r}: scale must be within [-{SCALE_BOUND:g}, {SCALE_BOUND:g}]")
        return path, scale
    return spec, 1.0
