"""Model families known to the converter: how to build, check and serialise each family's config, where
its CheckpointManifests live, which config mappings its manifests may name, and how its canonical layout
splits into *parts* (so a format that fills only some of them, e.g. a reasoner-only release, yields a
clearly labelled partial checkpoint).

Adding a family = one `Family(...)` entry here + manifests under `manifests/<family>/checkpoints/`.

A config mapping takes the upstream config (a dict) and returns either the family config (the source
determines every field) or a dict of the family config fields it determines (a partial config: the rest
comes from --variant, else the family defaults, and the report lists them).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from converters.errors import ConversionError
from manifests.checkpoint import part_names, part_of, split_by_part  # one part logic, shared with the reader


@dataclass(frozen=True)
class Family:
    name: str
    checkpoints_dir: Path                            # manifests/<family>/checkpoints/*.json
    config_from_dict: Callable[[dict], Any]          # canonical config.json -> config (validated)
    config_to_dict: Callable[[Any], dict]
    key_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    fp32_keys: Callable[[Any], list[str]]
    load_variant: Callable[[str], Any]
    list_variants: Callable[[], list[str]]
    config_mappings: Mapping[str, Callable[[dict], Any]]  # manifest "config_mapping" id -> upstream config -> config
    layer_key: re.Pattern                            # canonical key of a repeated layer; group 1 = index
    num_layers_field: str                            # config field holding the layer count
    parts: tuple[tuple[str, tuple[str, ...], str], ...] = ()  # (part, regexes on canonical keys, what it is)
    placeholder: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor] | None = None
    component: str = "transformer"                   # the component kind this key set describes (manifests/checkpoint.py)

    def with_num_layers(self, cfg: Any, n: int) -> Any:
        cfg = dataclasses.replace(cfg, **{self.num_layers_field: n})
        return cfg.validate() if hasattr(cfg, "validate") else cfg

    def num_layers(self, cfg: Any) -> int:
        return getattr(cfg, self.num_layers_field)

    def formats(self) -> list[str]:
        """The formats converting into this component (a manifest's `component`, default the family's first)."""
        import json

        default = component_names(self.name)[0] if component_names(self.name) else self.component
        out = []
        for p in self.checkpoints_dir.glob("*.json"):
            try:
                comp = json.loads(p.read_text()).get("component") or default
            except (OSError, ValueError, AttributeError):
                comp = default      # an unreadable manifest is reported by load_manifest, by name
            if comp == self.component:
                out.append(p.stem)
        return sorted(out)

    # ---- parts ----
    @property
    def part_names(self) -> tuple[str, ...]:
        return part_names(self.parts)

    def part_of(self, key: str) -> str:
        name = part_of(self.parts, key)
        if name is None:
            raise ConversionError(f"{self.name}: canonical key {key!r} belongs to no part (family definition bug)")
        return name

    def part_keys(self, cfg: Any) -> dict[str, list[str]]:
        """{part: its canonical keys for this config}, in part order; parts with no key are left out."""
        return split_by_part(self.parts, self.key_shapes(cfg), self.part_of)

    def part_descriptions(self) -> dict[str, str]:
        return {p: d for p, _, d in self.parts}


# ---------------------------------------------------------------------------------------------
# cosmos3

from manifests.checkpoint import COSMOS3_PARTS  # noqa: E402  (one definition, shared with the reader)


def cosmos3_placeholder(key: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Seeded stand-in weights for parts a partial checkpoint lacks (used only inside a parity check)."""
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if key.endswith("norm.weight") or key.endswith("norm_for_gen.weight"):
        return 1.0 + 0.1 * x
    if len(shape) == 1 or key.startswith(("action_in.", "action_out.")):
        return 0.1 * x
    if key.startswith(("embed_tokens", "lm_head")):
        return 0.5 * x
    return x / math.sqrt(shape[-1])


def _text_config(c: dict) -> dict:
    tc = c.get("text_config")
    if tc is None:
        return c  # a bare text config
    if not isinstance(tc, dict):
        raise ValueError("text_config must be an object")
    return tc


def cosmos3_from_transformers_config(c: dict) -> dict[str, Any]:
    """transformers reasoner config (`Cosmos3OmniConfig`, Qwen3-VL text tower; or `Cosmos3EdgeConfig`,
    Nemotron-style text tower) -> the Cosmos3Config fields it determines (und pathway only).

    Qwen3-VL text layers always carry q/k RMSNorm and a SiLU-gated MLP; the Edge text tower has neither
    (relu2 fc1/fc2 MLP). Both use interleaved mRoPE with `mrope_section` = rope_axes_dim.
    """
    mt = c.get("model_type")
    tc = _text_config(c)
    edge = mt == "cosmos3_edge" or tc.get("model_type") == "cosmos3_edge_text"
    rp = tc.get("rope_parameters") or {}
    rs = tc.get("rope_scaling") or {}
    theta = rp.get("rope_theta", tc.get("rope_theta", 1e8 if edge else 5e6))
    section = rp.get("mrope_section") or rs.get("mrope_section") or [24, 20, 20]
    rope_type = rp.get("rope_type") or rs.get("rope_type") or "default"
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope_type {rope_type!r} is not the plain (default) rotary embedding the canonical model uses")
    fields: dict[str, Any] = {
        "hidden_size": tc.get("hidden_size", 2048 if edge else 4096),
        "num_layers": tc.get("num_hidden_layers", 28 if edge else 32),
        "num_heads": tc.get("num_attention_heads", 16 if edge else 32),
        "num_kv_heads": tc.get("num_key_value_heads") or tc.get("num_attention_heads", 16 if edge else 32),
        "head_dim": tc.get("head_dim", 128),
        "intermediate_size": tc.get("intermediate_size", 9216 if edge else 22016),
        "vocab_size": tc.get("vocab_size", 131072 if edge else 151936),
        "attention_bias": bool(tc.get("attention_bias", False)),
        "rms_norm_eps": tc.get("rms_norm_eps", 1e-5 if edge else 1e-6),
        "hidden_act": tc.get("hidden_act", "relu2" if edge else "silu"),
        "qk_norm_for_text": not edge,
        "rope_theta": float(theta),
        "rope_axes_dim": tuple(section),
    }
    if edge and tc.get("mlp_bias"):
        raise ValueError("mlp_bias=true: the canonical cosmos3 MLP has no biases")
    return fields


def _cosmos3() -> Family:
    from manifests.cosmos3 import config as c3
    from manifests.cosmos3 import keys as k3

    return Family(
        name="cosmos3",
        checkpoints_dir=Path(c3.__file__).parent / "checkpoints",
        config_from_dict=c3.Cosmos3Config.from_dict,
        config_to_dict=lambda cfg: cfg.to_dict(),
        key_shapes=k3.canonical_key_shapes,
        fp32_keys=k3.fp32_keys,
        load_variant=c3.load_variant,
        list_variants=c3.list_variants,
        config_mappings={"diffusers_transformer_config": c3.Cosmos3Config.from_diffusers_config,
                         "transformers_reasoner_config": cosmos3_from_transformers_config},
        layer_key=re.compile(r"^layers\.(\d+)\."),
        num_layers_field="num_layers",
        parts=COSMOS3_PARTS,
        placeholder=cosmos3_placeholder,
    )


def _cosmos3_sound() -> Family:  # the AVAE sound tokenizer (diffusers Cosmos3AVAEAudioTokenizer names); "sound"
    from manifests.cosmos3 import config as c3
    from manifests.cosmos3 import sound

    return Family(name="cosmos3", checkpoints_dir=Path(c3.__file__).parent / "checkpoints",
                  config_from_dict=sound.Cosmos3SoundConfig.from_dict, config_to_dict=lambda cfg: cfg.to_dict(),
                  key_shapes=sound.canonical_key_shapes, fp32_keys=lambda cfg: [], load_variant=sound.load_variant,
                  list_variants=sound.list_variants,
                  config_mappings={"cosmos3_sound_config": sound.Cosmos3SoundConfig.from_diffusers_config},
                  # no truncatable layer list: a pattern that never matches (dec_dim is only read)
                  layer_key=re.compile(r"(?!)"), num_layers_field="dec_dim", component="sound")


def _seedvr2() -> Family:  # the SeedVR2 NaDiT (3B dit_v2 / 7B dit); manifests/seedvr2/checkpoints/
    from manifests.seedvr2 import config as sc
    from manifests.seedvr2 import keys as sk

    return Family(name="seedvr2", checkpoints_dir=Path(sc.__file__).parent / "checkpoints",
                  config_from_dict=sc.NaDiTConfig.from_dict, config_to_dict=lambda cfg: cfg.to_dict(),
                  key_shapes=sk.nadit_key_shapes, fp32_keys=sk.nadit_fp32_keys, load_variant=sc.load_variant,
                  list_variants=sc.list_variants,
                  config_mappings={"seedvr2_upstream_nadit_config": sc.nadit_from_upstream_config},
                  layer_key=re.compile(r"^blocks\.(\d+)\."), num_layers_field="num_layers")


def wan_vae_from_config(c: dict) -> Any:
    """A Wan VAE config.json -> WanVAEConfig: a diffusers `AutoencoderKLWan` config (it has `_class_name` or
    diffusers' `temperal_downsample` spelling), else our own canonical config (WanVAEConfig.to_dict)."""
    from manifests.wan.config import WanVAEConfig

    cls_name = c.get("_class_name")
    if cls_name is not None and cls_name != "AutoencoderKLWan":
        raise ValueError(f"_class_name is {cls_name!r}, not the AutoencoderKLWan config a Wan VAE needs")
    if cls_name is not None or "temperal_downsample" in c:
        return WanVAEConfig.from_diffusers_config(c)
    return WanVAEConfig.from_dict({k: v for k, v in c.items() if k != "description"})


def _wan() -> Family:  # the Wan 2.1 / 2.2 VAE (diffusers AutoencoderKLWan names); manifests/wan/checkpoints/
    from manifests.wan import config as wc
    from manifests.wan import keys as wk

    return Family(name="wan", checkpoints_dir=Path(wc.__file__).parent / "checkpoints",
                  config_from_dict=wc.WanVAEConfig.from_dict, config_to_dict=lambda cfg: cfg.to_dict(),
                  key_shapes=wk.canonical_key_shapes, fp32_keys=lambda cfg: [], load_variant=wc.load_variant,
                  list_variants=wc.list_variants, config_mappings={"wan_vae_config": wan_vae_from_config},
                  # a VAE has no truncatable layer list: a pattern that never matches (num_res_blocks is only read)
                  layer_key=re.compile(r"(?!)"), num_layers_field="num_res_blocks", component="vae")


def wan_dit_from_config(c: dict) -> Any:
    """A DiT config.json -> WanDiTConfig: a diffusers `WanTransformer3DModel` config (`_class_name`, or diffusers'
    `num_attention_heads` spelling), else our own canonical config (WanDiTConfig.to_dict)."""
    from manifests.wan.dit import WanDiTConfig

    cls_name = c.get("_class_name")
    if cls_name is not None and cls_name != "WanTransformer3DModel":
        raise ValueError(f"_class_name is {cls_name!r}, not the WanTransformer3DModel config a Wan DiT needs")
    if cls_name is not None or "num_attention_heads" in c:
        return WanDiTConfig.from_diffusers_config(c)
    return WanDiTConfig.from_dict({k: v for k, v in c.items() if k != "description"})


def wan_umt5_from_config(c: dict) -> Any:
    """A text-encoder config.json -> UMT5Config: a transformers `UMT5Config` (model_type umt5), else ours."""
    from manifests.wan.dit import UMT5Config

    if c.get("model_type") is not None or "architectures" in c:
        if c.get("model_type") not in (None, "umt5"):
            raise ValueError(f"model_type is {c.get('model_type')!r}, not the umt5 a Wan text encoder needs")
        return UMT5Config.from_transformers_config(c)
    return UMT5Config.from_dict({k: v for k, v in c.items() if k != "description"})


def _wan_model_variant(pick: Callable[[Any], Any]) -> Callable[[str], Any]:
    """--variant for a DiT / UMT5 component names a whole wan model variant (manifests/wan/models/)."""
    def load(name: str) -> Any:
        from manifests.wan.model import load_model_variant
        return pick(load_model_variant(name))
    return load


def _wan_model_variants() -> list[str]:
    from manifests.wan.model import list_model_variants
    return list_model_variants()


def _wan_transformer() -> Family:  # the Wan DiT (diffusers WanTransformer3DModel names); component "transformer"
    from manifests.wan import config as wc
    from manifests.wan import dit

    return Family(name="wan", checkpoints_dir=Path(wc.__file__).parent / "checkpoints",
                  config_from_dict=dit.WanDiTConfig.from_dict, config_to_dict=lambda cfg: cfg.to_dict(),
                  key_shapes=dit.dit_key_shapes, fp32_keys=dit.dit_fp32_keys,
                  load_variant=_wan_model_variant(lambda m: m.dit), list_variants=_wan_model_variants,
                  config_mappings={"wan_dit_config": wan_dit_from_config},
                  layer_key=re.compile(r"^blocks\.(\d+)\."), num_layers_field="num_layers", component="transformer")


def _wan_text_encoder() -> Family:  # UMT5 (transformers UMT5EncoderModel names); component "text_encoder"
    from manifests.wan import config as wc
    from manifests.wan import dit

    return Family(name="wan", checkpoints_dir=Path(wc.__file__).parent / "checkpoints",
                  config_from_dict=dit.UMT5Config.from_dict, config_to_dict=lambda cfg: cfg.to_dict(),
                  key_shapes=dit.umt5_key_shapes, fp32_keys=lambda cfg: [],
                  load_variant=_wan_model_variant(lambda m: m.text_encoder), list_variants=_wan_model_variants,
                  config_mappings={"wan_umt5_config": wan_umt5_from_config},
                  layer_key=re.compile(r"^encoder\.block\.(\d+)\."), num_layers_field="num_layers",
                  component="text_encoder")


# (family, component kind) -> Family; the first component of a family is its default (what `get_family(name)`
# gives and what a canonical dir without a recorded component holds)
_FACTORIES: dict[str, dict[str, Callable[[], Family]]] = {
    "cosmos3": {"transformer": _cosmos3, "sound": _cosmos3_sound},
    "seedvr2": {"transformer": _seedvr2},
    "wan": {"vae": _wan, "transformer": _wan_transformer, "text_encoder": _wan_text_encoder},
}
_CACHE: dict[tuple[str, str], Family] = {}


def family_names() -> list[str]:
    return sorted(_FACTORIES)


def component_names(name: str) -> list[str]:
    return list(_FACTORIES.get(name, {}))


def family_formats(name: str) -> list[str]:
    """Every format of a family, over all its components."""
    return sorted({f for c in component_names(name) for f in get_family(name, c).formats()})


def get_family(name: str, component: str | None = None) -> Family:
    """The converter Family of one component kind of a model family (default: the family's first component)."""
    if name not in _FACTORIES:
        raise ConversionError(f"unknown model family {name!r}; known families: {', '.join(family_names())}")
    comps = _FACTORIES[name]
    component = component or next(iter(comps))
    if component not in comps:
        raise ConversionError(f"{name} has no component {component!r}; components: {', '.join(comps)}")
    if (name, component) not in _CACHE:
        _CACHE[(name, component)] = comps[component]()
    return _CACHE[(name, component)]
