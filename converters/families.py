"""Model families known to the converter, discovered from their folders: each `manifests/<family>/layout.py`
declares its components (`manifests.layouts.ComponentLayout`: how to build, check and serialise the config, which
config mappings its manifests may name, how its canonical layout splits into *parts*, so a format that fills only
some of them, e.g. a reasoner-only release, yields a clearly labelled partial checkpoint), and its
CheckpointManifests live under `manifests/<family>/checkpoints/`. Nothing here names a family.

A config mapping takes the upstream config (a dict) and returns either the family config (the source
determines every field) or a dict of the family config fields it determines (a partial config: the rest
comes from --variant, else the family defaults, and the report lists them).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from converters.errors import ConversionError
from manifests.layouts import ComponentLayout, family_layouts, part_names, part_of, split_by_part


@dataclass(frozen=True)
class Family:
    """One component kind of a model family, as the converter uses it (built from its ComponentLayout)."""
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

    @classmethod
    def from_layout(cls, layout: ComponentLayout) -> "Family":
        package = importlib.import_module(f"manifests.{layout.family}")
        return cls(name=layout.family, checkpoints_dir=Path(package.__file__).parent / "checkpoints",
                   config_from_dict=layout.config_from_dict, config_to_dict=layout.config_to_dict,
                   key_shapes=layout.key_shapes, fp32_keys=layout.fp32_keys, load_variant=layout.load_variant,
                   list_variants=layout.list_variants, config_mappings=layout.config_mappings,
                   layer_key=layout.layer_key, num_layers_field=layout.num_layers_field, parts=layout.parts,
                   placeholder=layout.placeholder, component=layout.component)

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


# (family, component kind) -> Family, built on first use from the discovered layouts (tests swap entries here)
_CACHE: dict[tuple[str, str], Family] = {}


def family_names() -> list[str]:
    return sorted(family_layouts())


def component_names(name: str) -> list[str]:
    """A family's component kinds, its default (first declared) first."""
    fam = family_layouts().get(name)
    return [c.component for c in fam.components] if fam is not None else []


def family_formats(name: str) -> list[str]:
    """Every format of a family, over all its components."""
    return sorted({f for c in component_names(name) for f in get_family(name, c).formats()})


def get_family(name: str, component: str | None = None) -> Family:
    """The converter Family of one component kind of a model family (default: the family's first component)."""
    layouts = family_layouts()
    if name not in layouts:
        raise ConversionError(f"unknown model family {name!r}; known families: {', '.join(family_names())}")
    component = component or layouts[name].default_component
    layout = layouts[name].component(component)
    if layout is None:
        raise ConversionError(f"{name} has no component {component!r}; components: "
                              f"{', '.join(component_names(name))}")
    if (name, component) not in _CACHE:
        _CACHE[(name, component)] = Family.from_layout(layout)
    return _CACHE[(name, component)]


def __getattr__(attr: str) -> Any:
    # older names of functions that now live in the family folders (tests import them from here)
    moved = {"cosmos3_from_transformers_config": ("manifests.cosmos3.layout", "from_transformers_config"),
             "cosmos3_placeholder": ("manifests.cosmos3.layout", "placeholder"),
             "wan_vae_from_config": ("manifests.wan.layout", "vae_from_config"),
             "wan_dit_from_config": ("manifests.wan.layout", "dit_from_config"),
             "wan_umt5_from_config": ("manifests.wan.layout", "umt5_from_config")}
    if attr in moved:
        module, name = moved[attr]
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
