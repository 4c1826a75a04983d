"""Model families known to the converter: how to build, check and serialise each family's config, where
its CheckpointManifests live, and which config mappings its manifests may name.

Adding a family = one `Family(...)` entry here + manifests under `manifests/<family>/checkpoints/`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from converters.errors import ConversionError


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

    def with_num_layers(self, cfg: Any, n: int) -> Any:
        cfg = dataclasses.replace(cfg, **{self.num_layers_field: n})
        return cfg.validate() if hasattr(cfg, "validate") else cfg

    def num_layers(self, cfg: Any) -> int:
        return getattr(cfg, self.num_layers_field)

    def formats(self) -> list[str]:
        return sorted(p.stem for p in self.checkpoints_dir.glob("*.json"))


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
        config_mappings={"diffusers_transformer_config": c3.Cosmos3Config.from_diffusers_config},
        layer_key=re.compile(r"^layers\.(\d+)\."),
        num_layers_field="num_layers",
    )


_FACTORIES: dict[str, Callable[[], Family]] = {"cosmos3": _cosmos3}
_CACHE: dict[str, Family] = {}


def family_names() -> list[str]:
    return sorted(_FACTORIES)


def get_family(name: str) -> Family:
    if name not in _FACTORIES:
        raise ConversionError(f"unknown model family {name!r}; known families: {', '.join(family_names())}")
    if name not in _CACHE:
        _CACHE[name] = _FACTORIES[name]()
    return _CACHE[name]
