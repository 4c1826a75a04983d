"""A model family on the optimized side is one typed entry: `FamilyEntry`.

Each `optimized/models/<family>/__init__.py` exports exactly one `FAMILY = FamilyEntry(...)`; `optimized.registry`
finds them by walking the `optimized.models` package, and the engine serves any of them without naming one. The
entry says how to get a config (named variants), how to load a resident model instance from canonical weights (by
component), which loops that instance runs (by name), which request type goes to which loop, what the family can do
(capabilities), and optional family-specific conveniences (request builders, programs, a `parallelize` hook).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from manifests.layouts import DEFAULT_GAINS, bare_variant
from optimized.runtime.cache import CacheStore
from optimized.runtime.loop import LoopKernel
from optimized.runtime.spec import ComponentSpec, SpecError

Weights = dict[str, dict[str, torch.Tensor]]   # component id -> canonical state dict


@dataclass(frozen=True)
class LoopOptions:
    """Engine-level knobs a loop factory may read (each family reads the ones that apply to it)."""
    cfg_policy: str = "batched"                 # "two-forward" | "batched" | "identity"
    kv_blocks: int = 512                        # AR decode KV pool
    kv_block_size: int = 16
    group: Any = None                           # a parallel group (seedvr2 window SP), None = single device


LoopFactory = Callable[[Any, LoopOptions], LoopKernel]


@dataclass(frozen=True)
class RequestExtent:
    """How big a request is, read from the request alone (nothing allocated): None = does not apply / unknown."""
    frames: int | None = None                   # pixel frames
    height: int | None = None                   # pixels
    width: int | None = None
    tokens: int | None = None                   # text tokens the request holds (prompt, + generated for AR)


@dataclass(frozen=True)
class RequestCost:
    """Peak bytes of a request by phase, computed from its fields alone (nothing allocated): what the engine compares
    against its memory budget at admission. A phase's bytes are everything alive at its peak (e.g. "denoise": the
    latents, solver history and texts held + the largest step's activations; "decode": the latents + the largest VAE
    chunk + the decoded video so far; "artifact": the decoded video + its uint8 frames + the writer's copies)."""
    phases: Mapping[str, int]                   # phase -> peak bytes while it runs
    fields: tuple[str, ...] = ()                # the request fields the bytes grow with (named in a rejection)

    @property
    def peak(self) -> tuple[str, int]:
        """(the phase of the peak, its bytes)."""
        return max(self.phases.items(), key=lambda kv: kv[1])


LIMITS = (("frames", "max_frames"), ("height", "max_height"), ("width", "max_width"), ("tokens", "max_tokens"))
LIMIT_FIELDS = {"frames": "num_frames", "height": "height", "width": "width", "tokens": "text_ids"}  # request fields


@dataclass(frozen=True)
class Capabilities:
    modalities: tuple[str, ...]                 # what the family produces: "video", "image", "sound", "action", "text"
    cfg_policies: tuple[str, ...] = ()          # CFG policies its denoise loop accepts
    max_frames: int | None = None               # pixel frames per request (None = no family limit)
    max_height: int | None = None
    max_width: int | None = None
    max_tokens: int | None = None               # text tokens per request (prompt; + max_new_tokens for reasoning)
    # request -> its extent (None = nothing to check); the engine checks it against the limits before any allocation
    extent: Callable[[Any], RequestExtent | None] = field(default=lambda request: None, compare=False, repr=False)

    def validate(self, who: str, needs_modality: bool = True) -> "Capabilities":
        if needs_modality and not self.modalities:
            raise SpecError(f"family {who!r}: capabilities name no modality")
        for _, name in LIMITS:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise SpecError(f"family {who!r}: capabilities.{name} must be a positive int or None, got {v!r}")
        return self

    def to_dict(self) -> dict:
        """JSON-ready data (the `extent` function left out)."""
        return {"modalities": list(self.modalities), "cfg_policies": list(self.cfg_policies),
                **{name: getattr(self, name) for _, name in LIMITS}}

    def size_problem(self, request: Any, who: str) -> str | None:
        """Why `request` is larger than the family serves, or None. Values of the wrong type are left to the
        request's own validation (it refuses them with its own message)."""
        problem = self.oversized(request, who)
        return problem[0] if problem else None

    def oversized(self, request: Any, who: str) -> tuple[str, str] | None:
        """(why, the request field) when `request` is larger than the family serves, else None."""
        try:
            ext = self.extent(request)
        except (TypeError, ValueError, AttributeError):
            return None  # a malformed request: its validation says what is wrong
        if ext is None:
            return None
        for what, limit_name in LIMITS:
            value, limit = getattr(ext, what), getattr(self, limit_name)
            if limit is not None and isinstance(value, int) and value > limit:
                return (f"{who} request: {value} {what} exceeds the family limit of {limit} "
                        f"(capabilities.{limit_name})", LIMIT_FIELDS[what])
        return None


def identity_job(request: Any, **options: Any) -> Any:
    if options:
        raise TypeError(f"{type(request).__name__} takes no job options, got {sorted(options)}")
    return request


@dataclass(frozen=True)
class FamilyEntry:
    name: str
    config_class: type
    load_variant: Callable[[str], Any]                       # variant name -> config
    list_variants: Callable[[], list[str]]                   # whole-model variants (what Engine.from_variant takes)
    config_from_dict: Callable[[dict], Any]                  # a checkpoint's config dict -> config
    load: Callable[..., Any]                                 # (config, weights, device, dtype, weights_version)
    random_weights: Callable[[Any, int], Weights]            # (config, seed) -> weights by component
    components: Callable[[Any], tuple[ComponentSpec, ...]]   # config -> the components its checkpoint holds
    loops: Mapping[str, LoopFactory]                         # loop name -> factory(instance, options)
    request_types: Mapping[type, str]                        # request class -> loop name
    capabilities: Capabilities
    jobs: Mapping[str, Callable[..., Any]] = field(default_factory=dict)  # loop name -> (request, **opts) -> job
    request_builders: Mapping[str, Callable[..., Any]] = field(default_factory=dict)  # kind -> (instance, **kw)
    programs: Mapping[str, Callable[..., Any]] = field(default_factory=dict)          # name -> (engine, *args)
    caches: Callable[[Any], tuple[CacheStore, ...]] = lambda instance: ()   # the instance's caches (traced)
    parallelize: Callable[[Any, Any], Any] | None = None     # (instance, parallel plan / mesh) -> instance
    processor: Callable | None = None                        # (tokenizer_dir | None) -> processor with build_request
    # serving (optimized/serving names no family: these say everything family-specific it needs)
    media: Callable | None = None                            # engine -> MediaChain (latents -> pixels / audio)
    request_from_fields: Callable | None = None              # (engine, serving RequestFields) -> generation request
    request_defaults: Mapping[str, Any] = field(default_factory=dict)  # num_frames, height, width, num_steps, ...
    processor_options: Callable[[Any], dict] = lambda engine: {}  # engine -> extra build_request options (model's)
    instance_config: Callable[[Any], Any] | None = None      # a model directory's whole-model config -> the
                                                             # instance's config (None: the same config)
    # (engine, request, phases) -> its peak bytes by phase, from its fields alone (None: unknown); phases: the loop
    # names to cost for a bare loop request, or ("denoise", "decode", "artifact") for a whole video program
    request_cost: Callable[[Any, Any, tuple[str, ...]], RequestCost | None] | None = None

    def __post_init__(self) -> None:
        # variants are per family: the entry's loader also takes its own qualified names ("wan:tiny-2.1-t2v")
        object.__setattr__(self, "load_variant", _qualified_loader(self.name, self.load_variant))

    def validate(self) -> "FamilyEntry":
        if not self.name or not self.name.isidentifier():
            raise SpecError(f"family name must be an identifier, got {self.name!r}")
        # no loop and no request type: a component-only family (e.g. a transformer port at C0); the engine loads it
        # and refuses generate() (loop_for); request types without loops are a broken entry
        if not self.loops and self.request_types:
            raise SpecError(f"family {self.name!r} declares request types "
                            f"{sorted(t.__name__ for t in self.request_types)} but no loop to run them")
        for rtype, loop in self.request_types.items():
            if not isinstance(rtype, type):
                raise SpecError(f"family {self.name!r}: request type {rtype!r} is not a class")
            if loop not in self.loops:
                raise SpecError(f"family {self.name!r}: request type {rtype.__name__} goes to loop {loop!r}, "
                                f"which the family does not declare (loops: {sorted(self.loops)})")
        unknown = sorted(set(self.jobs) - set(self.loops))
        if unknown:
            raise SpecError(f"family {self.name!r}: job builders for undeclared loops {unknown}")
        self.capabilities.validate(self.name, needs_modality=not self.component_only)
        return self

    @property
    def component_only(self) -> bool:
        """True for a family with components but no loop (it is loaded and compared, never generates)."""
        return not self.loops

    def loop_for(self, request: Any) -> str:
        if self.component_only:
            raise TypeError(f"family {self.name!r} is component-only (it declares no loop): it loads and runs its "
                            f"components, but cannot generate (no {type(request).__name__} or any other request)")
        for rtype in type(request).__mro__:
            if rtype in self.request_types:
                return self.request_types[rtype]
        known = ", ".join(t.__name__ for t in self.request_types)
        raise TypeError(f"family {self.name!r} serves no {type(request).__name__} (request types: {known})")

    def make_job(self, loop: str, request: Any, **options: Any) -> Any:
        return self.jobs.get(loop, identity_job)(request, **options)

    def random_variant(self, variant: str, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
        """A model instance with seeded random weights at a variant's shapes (smoke runs, released-size benchmarks)."""
        variant = bare_variant(self.name, variant)
        cfg = self.load_variant(variant)
        return self.load(cfg, self.random_weights(cfg, seed), device=device, dtype=dtype,
                         weights_version=f"random:{self.name}:{variant}:{seed}")


def _qualified_loader(family: str, load: Callable[[str], Any]) -> Callable[[str], Any]:
    if getattr(load, "qualified_for", None) == family:
        return load

    def load_variant(name: str) -> Any:
        return load(bare_variant(family, name))   # another family's qualified name: LayoutError names both
    load_variant.qualified_for = family
    load_variant.__wrapped__ = load
    return load_variant


def seeded_random_state(key_shapes: Mapping[str, tuple[int, ...]], seed: int,
                        ones: tuple[str, ...] = DEFAULT_GAINS, scale: float = 0.02) -> dict[str, torch.Tensor]:
    """Seeded N(0, scale) tensors at the given shapes (sorted key order), plus 1.0 on keys ending in `ones` (norm
    gains), so a randomly-weighted model keeps activations O(1). A family declares its gains in its layout
    (manifests/<family>/layout.py `ComponentLayout.gains`; `declared_random_state` reads them)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * scale + (1.0 if k.endswith(ones) else 0.0)
            for k, shape in sorted(key_shapes.items())}


def declared_random_state(family: str, component: str, cfg: Any, seed: int, scale: float = 0.02
                          ) -> dict[str, torch.Tensor]:
    """`seeded_random_state` at a component's canonical shapes with the gains its family declares (its layout)."""
    from manifests.checkpoint import get_layout

    layout = get_layout(family, component)
    return seeded_random_state(layout.key_shapes(cfg), seed, ones=layout.gains, scale=scale)
