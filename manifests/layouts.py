"""Each family's canonical layout, declared in its own folder and discovered: nothing registers a family by hand.

A model family `foo` is a package `manifests/foo/` whose module `manifests/foo/layout.py` exports

    LAYOUT = FamilyLayout(name="foo", components=(ComponentLayout(...), ...), model=None)

The first component is the family's default (what a canonical dir without a recorded component holds, what
`fvconvert foo` converts without naming one). The checkpoint reader (manifests/checkpoint.py) and the converter
(converters/families.py) both read these declarations; the converter-only fields (variants, config mappings,
truncatable layers, placeholders) sit beside the reader's so one declaration serves both. A package under
manifests/ without a layout module is not a family (shared contracts live in plain modules).

The random-weight rule is declared here too (`ComponentLayout.gains`): which canonical keys are gains (norm scales,
drawn near 1 by the seeded random-weight generators of both sides), so a family whose q/k norms are spelled
`norm_q.weight` says so once instead of inheriting the `*norm.weight` default.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Mapping

import torch

from manifests.errors import CheckpointError, ManifestError, PipelineError

Part = tuple[str, tuple[str, ...], str]          # (part name, regexes on canonical keys, what it is)
DEFAULT_GAINS: tuple[str, ...] = ("norm.weight",)  # the rule every family had before it was declared per family
NO_LAYERS = re.compile(r"(?!)")                  # a layer pattern that never matches: no truncatable layer list


class LayoutError(ManifestError):
    """A family layout declaration that is missing or malformed (a bug in the family folder)."""


def part_names(parts: tuple[Part, ...]) -> tuple[str, ...]:
    """The part names of a layout; a layout without parts has the one part "all"."""
    return tuple(p for p, _, _ in parts) or ("all",)


def part_of(parts: tuple[Part, ...], key: str) -> str | None:
    """The part a canonical key belongs to (the first whose regexes match); None when no part claims it."""
    for name, pats, _ in parts:
        if any(re.search(p, key) for p in pats):
            return name
    return None if parts else "all"


def split_by_part(parts: tuple[Part, ...], keys, which: Callable[[str], str]) -> dict[str, list[str]]:
    """{part: keys}, in part order; parts with no key are left out. `which` names a key's part (or raises)."""
    out: dict[str, list[str]] = {p: [] for p in part_names(parts)}
    for k in keys:
        out[which(k)].append(k)
    return {p: ks for p, ks in out.items() if ks}


def _no_variants() -> list[str]:
    return []


def _no_variant(name: str) -> Any:
    raise LayoutError(f"no variant {name!r}: this component declares no variants")


@dataclass(frozen=True)
class ComponentLayout:
    """How one kind of component of a family is stored canonically (reader) and converted into (fvconvert)."""
    family: str
    component: str                                           # transformer | text_encoder | vae | sound | ...
    config_from_dict: Callable[[dict], Any]                   # canonical config.json -> validated config
    key_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    fp32_keys: Callable[[Any], list[str]] = lambda cfg: []
    parts: tuple[Part, ...] = ()
    # the reader drops a "description" field before parsing (canonical configs written with one); fvconvert parses
    # what the mappings give, which never holds one
    reader_drops_description: bool = False
    # ---- converter fields (converters/families.py) ----
    config_to_dict: Callable[[Any], dict] = lambda cfg: cfg.to_dict()
    load_variant: Callable[[str], Any] = _no_variant
    list_variants: Callable[[], list[str]] = _no_variants
    config_mappings: Mapping[str, Callable[[dict], Any]] = field(default_factory=dict)  # manifest "config_mapping" id
    layer_key: re.Pattern = NO_LAYERS                        # canonical key of a repeated layer; group 1 = index
    num_layers_field: str = "num_layers"                     # config field holding the layer count (only read
                                                             # when layer_key matches)
    placeholder: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor] | None = None  # partial-ckpt fill
    # ---- the random-weight rule ----
    gains: tuple[str, ...] = DEFAULT_GAINS                   # key suffixes that are gains (norm scales, near 1)

    @property
    def part_names(self) -> tuple[str, ...]:
        return part_names(self.parts)

    def part_of(self, key: str) -> str:
        name = part_of(self.parts, key)
        if name is None:
            raise CheckpointError(f"{self.family}: canonical key {key!r} belongs to no part (layout definition bug)")
        return name

    def part_keys(self, cfg: Any) -> dict[str, list[str]]:
        """{part: its canonical keys for this config}, in part order; parts with no key are left out."""
        return split_by_part(self.parts, self.key_shapes(cfg), self.part_of)

    def read_config(self, d: dict) -> Any:
        """A canonical config.json (as the reader finds it) -> the validated config."""
        if self.reader_drops_description:
            d = {k: v for k, v in d.items() if k != "description"}
        return self.config_from_dict(d)

    def is_gain(self, key: str) -> bool:
        """True for a canonical key the family declares a gain (a random-weight generator draws it near 1)."""
        return key.endswith(self.gains)


@dataclass(frozen=True)
class ModelLayout:
    """A whole-model directory (model_index.json): parse its config, and name its components as
    {component name: (layout kind, that component's config)}; a kind "family:kind" is a component stored with
    another family's layout (the cosmos3 VAE is a wan VAE)."""
    config_from_dict: Callable[[dict], Any]
    components: Callable[[Any], dict[str, tuple[str, Any]]]


def read_pipeline_json(path: Any, what: str) -> dict:
    """A JSON object from a pipeline root's file (model_index.json, a scheduler or processor config); PipelineError
    naming the file otherwise."""
    from manifests.serialise import read_json_object

    return read_json_object(path, what, PipelineError)


def pipeline_lists(index: dict, name: str) -> bool:
    """Whether a model_index.json lists entry `name` (diffusers writes [null, null] for an absent one)."""
    entry = index.get(name)
    return isinstance(entry, list) and entry not in ([None, None], [])


@dataclass(frozen=True)
class PipelineLayout:
    """How the family's diffusers pipeline root becomes one model directory (converters/pipeline.py runs it).
    `model_config` and `precheck` raise ManifestError (the converter reports it as a conversion error)."""
    components: Mapping[str, tuple[str, str]]       # pipeline entry -> (converter family, format) it is written with
    required: tuple[str, ...]                       # entries the model cannot do without
    assets: Mapping[str, str]                       # pipeline entry copied verbatim -> its folder in OUT
    not_converted: Mapping[str, str]                # entries deliberately left out -> why
    model_config: Callable[..., tuple[Any, str]]    # (model_index, root, {entry: config}, variant) -> (config, class)
    variants: Callable[[], list[str]]               # what --variant may name
    optional_assets: Mapping[str, str] = field(default_factory=dict)   # copied verbatim when the pipeline lists them
    precheck: Callable[[dict, Any], None] = lambda index, root: None   # (model_index, root): refuse before planning


@dataclass(frozen=True)
class FamilyLayout:
    name: str
    components: tuple[ComponentLayout, ...]                  # the first is the family's default component
    model: ModelLayout | None = None                         # None: no whole-model directory format
    pipeline: PipelineLayout | None = None                   # None: no whole-pipeline conversion
    # `--from NAME` aliases: the formats NAME may mean (detection picks one by the source's config / keys)
    source_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    format_aliases: Mapping[str, str] = field(default_factory=dict)   # other names a format goes by

    @property
    def default_component(self) -> str:
        return self.components[0].component

    def component(self, kind: str) -> ComponentLayout | None:
        return next((c for c in self.components if c.component == kind), None)

    def validate(self, where: str) -> "FamilyLayout":
        problems = []
        if not self.components:
            problems.append("declares no component")
        kinds = [c.component for c in self.components]
        if len(set(kinds)) != len(kinds):
            problems.append(f"duplicate component kinds {kinds}")
        for c in self.components:
            if not isinstance(c, ComponentLayout):
                problems.append(f"component {c!r} is not a ComponentLayout")
            elif c.family != self.name:
                problems.append(f"component {c.component!r} says family {c.family!r}")
            elif not (callable(c.config_from_dict) and callable(c.key_shapes)):
                problems.append(f"component {c.component!r}: config_from_dict and key_shapes must be callables")
            elif not c.gains or not all(isinstance(g, str) and g for g in c.gains):
                problems.append(f"component {c.component!r}: gains must be non-empty key suffixes")
        if problems:
            raise LayoutError(f"{where}: " + "; ".join(problems))
        return self


VARIANT_SEP = ":"           # "wan:tiny-2.1-t2v": a variant qualified by its family (variants are per family)


def split_variant(name: str, family: str | None = None) -> tuple[str | None, str]:
    """'wan:tiny' -> ('wan', 'tiny'); a bare 'tiny' -> (family, 'tiny'). With `family` given, a qualifier naming
    another family is an error (LayoutError)."""
    qual, sep, bare = name.partition(VARIANT_SEP)
    if not sep:
        return family, name
    if not qual or not bare:
        raise LayoutError(f"variant {name!r}: a qualified variant is FAMILY{VARIANT_SEP}NAME (e.g. wan:tiny-2.1-t2v)")
    if family is not None and qual != family:
        raise LayoutError(f"variant {name!r} belongs to family {qual!r}, not {family!r}")
    return qual, bare


def bare_variant(family: str, name: str) -> str:
    """A variant name as `family`'s own loaders know it: 'wan:tiny-2.1' -> 'tiny-2.1' (another family's: error)."""
    return split_variant(name, family)[1]


LAYOUT_MODULE = "layout"    # manifests/<family>/layout.py


def discover_layouts(package: Any = None) -> dict[str, FamilyLayout]:
    """{family: FamilyLayout} from every subpackage of `package` (default: manifests) holding a layout module."""
    if package is None:
        package = importlib.import_module("manifests")
    found: dict[str, FamilyLayout] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if not info.ispkg:
            continue
        name = f"{package.__name__}.{info.name}.{LAYOUT_MODULE}"
        if importlib.util.find_spec(f"{package.__name__}.{info.name}") is None \
                or importlib.util.find_spec(name) is None:
            continue
        layout = getattr(importlib.import_module(name), "LAYOUT", None)
        if not isinstance(layout, FamilyLayout):
            raise LayoutError(f"{name} must export LAYOUT = FamilyLayout(...), found {type(layout).__name__}")
        if layout.name != info.name:
            raise LayoutError(f"{name}.LAYOUT is named {layout.name!r}; a family is named after its folder")
        found[layout.name] = layout.validate(name)
    return found


@lru_cache(maxsize=None)
def family_layouts() -> dict[str, FamilyLayout]:
    """Every family layout under manifests/ (discovered once per process; `family_layouts.cache_clear()` re-walks)."""
    return discover_layouts()


__all__ = ["VARIANT_SEP", "bare_variant", "split_variant", "ComponentLayout", "DEFAULT_GAINS", "FamilyLayout", "PipelineLayout", "LayoutError", "ModelLayout", "NO_LAYERS", "Part",
           "discover_layouts", "family_layouts", "part_names", "part_of", "split_by_part"]
