"""What `fvparity port new` learns from an upstream class: its constructor config, a tiny config that builds, its
state-dict names and shapes, the config expression behind every dimension, its repeated layers, its fp32 modules,
its norm gains and a guess at its forward's tensor inputs.

Everything is read from the class itself (constructor signature, instances built on the meta device), never from
a checkpoint: a shape expression is fitted by doubling one config field at a time and watching which dimensions
move, then checked on the upstream default config.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from parity.errors import SetupError

PACKAGES = ("diffusers", "transformers")
# field name -> tiny value (first match wins); only int fields above the tiny value shrink
TINY_RULES: tuple[tuple[str, int], ...] = (
    (r"layers$|^depth$|^num_blocks$", 2),
    (r"head_dim$|^attention_head_dim$|^dim_head$", 8),
    (r"heads$", 2),
    (r"^(intermediate_size|ffn_dim|mlp_dim|ff_inner_dim)$", 32),
    (r"^vocab_size$", 64),
    (r"^(max_position_embeddings|max_seq_len|max_text_len|text_len)$", 64),
    (r"^sample_size$", 8),
    (r"^(num_embeds_ada_norm|num_classes)$", 10),
    (r"^norm_num_groups$", 1),
    # a modality prefix (`audio_cross_attention_dim`) names the same kind of width: it shrinks with the rest
    (r"(^|_)(hidden_size|d_model|cross_attention_dim|joint_attention_dim|caption_channels|text_dim|freq_dim|"
     r"pooled_projection_dim|time_embed_dim|encoder_hid_dim|caption_projection_dim|text_embed_dim)$", 16),
)
SKIPPED_FORWARD_ARGS = {"self", "return_dict", "cross_attention_kwargs", "attention_kwargs", "joint_attention_kwargs",
                        "output_attentions", "output_hidden_states", "use_cache", "past_key_values"}


class PortError(SetupError):
    """The upstream class cannot be scaffolded as asked (one line; fvparity exits 2)."""


@dataclass(frozen=True)
class Upstream:
    package: str                          # diffusers | transformers
    name: str                             # class name
    cls: type
    version: str

    @property
    def spec(self) -> str:
        return f"{self.package}:{self.name}"

    def config_params(self) -> dict[str, inspect.Parameter]:
        """The constructor's config arguments (diffusers: the model's __init__; transformers: its config class')."""
        target = self.cls.__init__ if self.package == "diffusers" else self.cls.config_class.__init__
        return {n: p for n, p in inspect.signature(target).parameters.items()
                if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}

    def build(self, config: dict, device: str = "meta") -> torch.nn.Module:
        with torch.device(device):
            if self.package == "diffusers":
                return self.cls(**config)
            return self.cls(self.cls.config_class(**config))


def resolve(spec: str) -> Upstream:
    """'diffusers:CLASS' | 'transformers:CLASS' -> the class (the package must be installed)."""
    pkg, _, name = spec.partition(":")
    if pkg not in PACKAGES or not name.isidentifier():
        raise PortError(f"--from {spec!r}: expected diffusers:CLASS or transformers:CLASS")
    try:
        mod = importlib.import_module(pkg)
    except ImportError:
        raise PortError(f"--from {spec}: the {pkg} package is not installed (pip install {pkg})") from None
    cls = getattr(mod, name, None)
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise PortError(f"--from {spec}: {pkg} has no model class {name!r}")
    if pkg == "transformers" and getattr(cls, "config_class", None) is None:
        raise PortError(f"--from {spec}: {name} has no config_class")
    return Upstream(pkg, name, cls, getattr(mod, "__version__", "unknown"))


def _json_value(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(_json_value(x) for x in v))


def default_config(up: Upstream) -> dict[str, Any]:
    """The constructor defaults (JSON values; tuples as lists). An argument without a JSON default is refused."""
    out = {}
    for name, p in up.config_params().items():
        if p.default is inspect.Parameter.empty:
            raise PortError(f"{up.spec}: config argument {name!r} has no default; pass it with --tiny {name}=VALUE")
        if not _json_value(p.default):
            continue  # an object-valued argument (a sub-config class): left to upstream's own default
        out[name] = list(p.default) if isinstance(p.default, tuple) else p.default
    return out


def tiny_config(up: Upstream, defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Shrink the int fields named like sizes (TINY_RULES), apply --tiny overrides, and build it (meta device)."""
    tiny = dict(defaults)
    for name, v in defaults.items():
        if isinstance(v, bool) or not isinstance(v, int):
            continue
        for pat, small in TINY_RULES:
            if re.search(pat, name):
                tiny[name] = min(v, small)
                break
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise PortError(f"--tiny {', '.join(unknown)}: not config arguments of {up.spec} "
                        f"(arguments: {', '.join(defaults)})")
    tiny.update(overrides)
    try:
        up.build(tiny)
    except Exception as e:  # noqa: BLE001 - upstream's own validation says what is wrong
        raise PortError(f"{up.spec} does not build with the tiny config ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]}); fix it with --tiny NAME=VALUE "
                        f"(tried {_changed(defaults, tiny)})") from None
    return tiny


def _changed(a: dict, b: dict) -> str:
    return ", ".join(f"{k}={b[k]}" for k in b if a.get(k) != b[k]) or "the defaults"


def shapes_of(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# key shapes as config expressions


@dataclass(frozen=True)
class LayerGroup:
    prefix: str                  # module path of the ModuleList, e.g. "transformer_blocks"
    field: str                   # the config field holding its length


@dataclass(frozen=True)
class KeyTable:
    """The canonical keys as code: segments of plain keys and repeated layer groups, each dim an expression."""
    segments: tuple[tuple[LayerGroup | None, tuple[tuple[str, tuple[str, ...]], ...]], ...]
    fp32_modules: tuple[str, ...]
    gains: tuple[str, ...]
    literal_dims: int            # dimensions no config field moved (written as numbers)
    default_mismatches: tuple[str, ...] = field(default=())   # keys the fitted table gets wrong on the defaults


def _probe(up: Upstream, tiny: dict) -> dict[str, dict[str, tuple[int, ...]]]:
    """{field doubled: shapes} for every int field whose doubled value still builds (plus "" = tiny itself)."""
    out = {"": shapes_of(up.build(tiny))}
    for name, v in tiny.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            continue
        try:
            out[name] = shapes_of(up.build({**tiny, name: 2 * v}))
        except Exception:  # noqa: BLE001 - a field that cannot move alone (a constraint upstream checks)
            continue
    return out


def _layer_groups(up: Upstream, tiny: dict, probes: dict) -> list[LayerGroup]:
    model = up.build(tiny)
    groups: list[LayerGroup] = []
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or not path or any(path.startswith(g.prefix + ".")
                                                                        for g in groups):
            continue
        n = len(mod)
        for fname, shapes in probes.items():
            if fname and tiny[fname] == n and _count(shapes, path) == 2 * n:
                groups.append(LayerGroup(path, fname))
                break
    return groups


def _count(shapes: dict, prefix: str) -> int:
    pat = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    return len({m.group(1) for k in shapes for m in [pat.match(k)] if m})


def _fit(values: dict[str, int], tiny: dict) -> str | None:
    """The expression `k * f1^e1 * ... + d` matching one dimension in every probe, or None (a literal)."""
    t = values[""]
    moved = [f for f, v in values.items() if f and v != t]
    if not moved:
        return None
    for d in (0, 1, -1, 2):
        if t - d <= 0:
            continue
        powers = {}
        for f in moved:
            ratio = (values[f] - d) / (t - d)
            e = round(math.log2(ratio)) if ratio > 0 else 0
            if e < 1 or e > 3 or abs(ratio - 2 ** e) > 1e-9:
                break
            powers[f] = e
        else:
            base = math.prod(tiny[f] ** e for f, e in powers.items())
            if (t - d) % base:
                continue
            k = (t - d) // base
            terms = ([str(k)] if k != 1 else []) + [f"c.{f}" for f, e in powers.items() for _ in range(e)]
            return " * ".join(terms) + (f" + {d}" if d > 0 else f" - {-d}" if d < 0 else "")
    return None


def _layer0(key: str, groups: list[LayerGroup]) -> tuple[LayerGroup | None, str | None]:
    """(group, key with the index as {i}) for a key inside a group's layer 0; (group, None) for another layer."""
    for g in groups:
        m = re.match(re.escape(g.prefix) + r"\.(\d+)\.(.+)$", key)
        if m:
            return g, (f"{g.prefix}.{{i}}.{m.group(2)}" if m.group(1) == "0" else None)
    return None, key


def key_table(up: Upstream, tiny: dict, defaults: dict) -> KeyTable:
    probes = _probe(up, tiny)
    groups = _layer_groups(up, tiny, probes)
    segments: list[tuple[LayerGroup | None, list[tuple[str, tuple[str, ...]]]]] = []
    literal = 0
    for key, shape in probes[""].items():
        group, pattern = _layer0(key, groups)
        if pattern is None:
            continue
        probe_key = key
        dims = []
        for i, size in enumerate(shape):
            values = {f: s[probe_key][i] for f, s in probes.items()
                      if probe_key in s and len(s[probe_key]) == len(shape)}
            expr = _fit(values, tiny)
            literal += expr is None
            dims.append(expr or str(size))
        if not segments or segments[-1][0] is not group:
            segments.append((group, []))
        segments[-1][1].append((pattern, tuple(dims)))
    table = KeyTable(tuple((g, tuple(ks)) for g, ks in segments), fp32_modules(up), gains(up, tiny), literal)
    try:
        want = shapes_of(up.build(defaults))
    except Exception:  # noqa: BLE001 - the defaults need not build (a required sub-config); nothing to check
        return table
    got = evaluate(table, defaults)
    bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    return KeyTable(table.segments, table.fp32_modules, table.gains, literal, tuple(bad))


def evaluate(table: KeyTable, config: dict) -> dict[str, tuple[int, ...]]:
    """The table's shapes for a config dict (what the generated key_shapes() returns for it)."""
    c = type("C", (), config)
    out = {}
    for group, keys in table.segments:
        for i in range(config[group.field]) if group else [None]:
            for pattern, dims in keys:
                out[pattern.format(i=i)] = tuple(eval(d, {"c": c}) for d in dims)  # noqa: S307 - our own exprs
    return out


@dataclass(frozen=True)
class KeySwitch:
    """A boolean config field whose flip changes upstream's state dict (the shapes are fitted on int fields only)."""
    field: str
    fitted: bool                 # the value key_shapes was fitted with
    added: int
    removed: int
    resized: int

    def describe(self) -> str:
        parts = [f"+{self.added}" if self.added else "", f"-{self.removed}" if self.removed else "",
                 f"{self.resized} resized" if self.resized else ""]
        return f"{self.field}={not self.fitted} ({', '.join(p for p in parts if p)} keys)"


def key_switches(up: Upstream, tiny: dict) -> tuple[KeySwitch, ...]:
    """Flip each boolean field of the tiny config alone and watch the keys (LTX-2: gated_attn adds gate logits,
    cross_attn_mod resizes the modulation tables, ff_bias drops biases). A flip upstream refuses is skipped."""
    base = shapes_of(up.build(tiny))
    found = []
    for name, v in tiny.items():
        if not isinstance(v, bool):
            continue
        try:
            flipped = shapes_of(up.build({**tiny, name: not v}))
        except Exception:  # noqa: BLE001, S112 - a switch upstream cannot build alone: nothing to learn from it
            continue
        added, removed = len(set(flipped) - set(base)), len(set(base) - set(flipped))
        resized = sum(1 for k in set(base) & set(flipped) if base[k] != flipped[k])
        if added or removed or resized:
            found.append(KeySwitch(name, v, added, removed, resized))
    return tuple(found)


def fp32_modules(up: Upstream) -> tuple[str, ...]:
    return tuple(getattr(up.cls, "_keep_in_fp32_modules", None) or ())


def gains(up: Upstream, tiny: dict) -> tuple[str, ...]:
    """Key suffixes of norm scales (`<norm module>.weight`): the random-weight rule draws them near 1."""
    model = up.build(tiny)
    found = {f"{path.rsplit('.', 1)[-1]}.weight" for path, mod in model.named_modules()
             if path and "norm" in type(mod).__name__.lower() and getattr(mod, "weight", None) is not None
             and not isinstance(getattr(mod, "weight"), torch.nn.Module) and mod.weight.ndim == 1}
    return tuple(sorted(found)) or ("norm.weight",)


# ---------------------------------------------------------------------------------------------
# forward inputs


@dataclass(frozen=True)
class InputGuess:
    name: str
    code: str | None             # an expression on cfg / batch / g, or None: the porter writes it
    required: bool


def _size_field(tiny: dict, *names: str) -> str | None:
    return next((n for n in names if isinstance(tiny.get(n), int) and not isinstance(tiny.get(n), bool)), None)


def guess_inputs(up: Upstream, tiny: dict) -> list[InputGuess]:
    """The forward's tensor arguments with a seeded construction where the name says what it is."""
    params = inspect.signature(up.cls.forward).parameters
    video = "3d" in up.name.lower() or "video" in up.name.lower()
    out = []
    for name, p in params.items():
        if name in SKIPPED_FORWARD_ARGS or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        required = p.default is inspect.Parameter.empty
        code = None
        if name in ("hidden_states", "sample", "x"):
            ch, size = _size_field(tiny, "in_channels", "num_channels"), _size_field(tiny, "sample_size")
            if ch and size:
                frames = "2, " if video else ""
                code = f"torch.randn(batch, cfg.{ch}, {frames}cfg.{size}, cfg.{size}, generator=g)"
        elif name in ("timestep", "timesteps", "t"):
            code = "torch.randint(0, 1000, (batch,), generator=g)"
        elif name == "class_labels":
            n = _size_field(tiny, "num_embeds_ada_norm", "num_classes")
            code = f"torch.randint(0, cfg.{n}, (batch,), generator=g)" if n else None
        elif name == "encoder_hidden_states":
            d = _size_field(tiny, "cross_attention_dim", "joint_attention_dim", "caption_channels", "text_dim",
                            "encoder_hid_dim", "text_embed_dim")
            code = f"torch.randn(batch, 8, cfg.{d}, generator=g)" if d else None
        elif name == "pooled_projections":
            d = _size_field(tiny, "pooled_projection_dim")
            code = f"torch.randn(batch, cfg.{d}, generator=g)" if d else None
        elif name == "input_ids":
            code = "torch.randint(0, cfg.vocab_size, (batch, 8), generator=g)" if "vocab_size" in tiny else None
        if code is None and not required:
            continue  # an optional argument left at upstream's default
        out.append(InputGuess(name, code, required))
    return out
