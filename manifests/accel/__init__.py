"""Accelerations as typed, certified contracts (DESIGN "Beyond exactness"): data both sides read.

An acceleration is a named kind (`AccelKind`: exact or lossy, its knobs with defaults and ranges, the CacheKey fields
it adds, the loops it applies to) and a request asks for one instance of it as an `AccelSpec`, written on the
command line / HTTP as ``NAME[:knob=value,...]`` (``dbcache:fn=1,bn=0,threshold=0.08``). Both sides make the same
decisions from the same spec (which step, which block range, which CFG branch is computed or reused) and report
them as `AccelDecision` rows, so C1 under an acceleration compares decisions first and tensors second.

Kinds are declared in the modules beside this one (`caches.py`: step / residual caches and the guidance interval;
`sparse.py`: sparse attention) and collected here; a kind is looked up by name only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

KnobValue = int | float | str | bool


class AccelSpecError(ValueError):
    """A malformed acceleration request (unknown name, unknown knob, value out of range): one clear message."""


@dataclass(frozen=True)
class Knob:
    name: str
    default: KnobValue | None                  # None = required or "off" (say which in `help`)
    kind: type                                 # int | float | str | bool
    help: str
    low: float | None = None                   # inclusive bounds for numbers
    high: float | None = None
    choices: tuple[str, ...] = ()              # for str knobs

    def coerce(self, accel: str, raw: object) -> KnobValue | None:
        if raw is None:
            return None
        try:
            if self.kind is bool:
                if isinstance(raw, bool):
                    value: KnobValue = raw
                elif str(raw).lower() in ("1", "true", "yes", "on"):
                    value = True
                elif str(raw).lower() in ("0", "false", "no", "off"):
                    value = False
                else:
                    raise ValueError(raw)
            elif self.kind is int:
                if isinstance(raw, float) and not raw.is_integer():
                    raise ValueError(raw)
                value = int(str(raw)) if not isinstance(raw, (int, float)) else int(raw)
            elif self.kind is float:
                value = float(raw)
                if not math.isfinite(value):
                    raise ValueError(raw)
            else:
                value = str(raw)
        except (TypeError, ValueError):
            raise AccelSpecError(f"accel {accel}: knob {self.name} must be {self.kind.__name__}, got {raw!r}") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.low is not None and value < self.low or self.high is not None and value > self.high:
                raise AccelSpecError(f"accel {accel}: knob {self.name} must be in [{self.low}, {self.high}], "
                                     f"got {value!r}")
        if self.choices and value not in self.choices:
            raise AccelSpecError(f"accel {accel}: knob {self.name} must be one of {', '.join(self.choices)}, "
                                 f"got {value!r}")
        return value


@dataclass(frozen=True)
class AccelKind:
    name: str                                  # "fbcache", "dbcache", "taylorseer", "magcache", "sta", ...
    exact: bool                                # exact: must pass C1 bitwise; lossy: carries a budget
    summary: str                               # one line for --help and the DeploymentCard
    knobs: tuple[Knob, ...]
    cache_key_fields: tuple[str, ...]          # what it adds to the CacheKey of anything it caches
    loops: tuple[str, ...]                     # loop ids it applies to ("wan.denoise", "cosmos3.denoise", ...)
    upstream: str = ""                         # the semantics it reproduces ("diffusers 0.42.1 FirstBlockCacheConfig")

    def knob(self, name: str) -> Knob:
        for k in self.knobs:
            if k.name == name:
                return k
        raise AccelSpecError(f"accel {self.name}: unknown knob {name!r} (knobs: "
                             f"{', '.join(k.name for k in self.knobs) or 'none'})")


@dataclass(frozen=True)
class AccelSpec:
    """One requested acceleration: its kind's name and every knob's value (defaults filled in)."""
    name: str
    knobs: tuple[tuple[str, KnobValue | None], ...]   # sorted (knob, value) pairs, every knob of the kind

    @property
    def kind(self) -> AccelKind:
        return get_kind(self.name)

    @property
    def exact(self) -> bool:
        return self.kind.exact

    def get(self, knob: str) -> KnobValue | None:
        for k, v in self.knobs:
            if k == knob:
                return v
        raise AccelSpecError(f"accel {self.name}: unknown knob {knob!r}")

    def label(self) -> str:
        """The canonical text form: parse(spec.label()) == spec."""
        parts = [f"{k}={_fmt(v)}" for k, v in self.knobs if v is not None]
        return self.name + (":" + ",".join(parts) if parts else "")

    def cache_key_part(self) -> tuple[tuple[str, str], ...]:
        """(field, value) pairs this acceleration adds to a CacheKey: values computed under it differ from exact."""
        return (("accel", self.label()),)


@dataclass(frozen=True)
class AccelBudget:
    """What a lossy acceleration may cost against the exact run on the same seeds (the certificate checks it)."""
    min_psnr_db: float = 30.0
    min_ssim: float = 0.9
    max_adherence_drop: float = 0.02           # fraction of held-out prompts (2 points = 0.02)
    c3_alpha: float = 0.01                     # the distribution test must not reject at this level


@dataclass(frozen=True)
class AccelDecision:
    """One decision of an acceleration at one step for one request's CFG branch (both sides emit these)."""
    step: int
    branch: str                                # "cond" | "uncond"
    action: str                                # "compute" | "reuse" | "predict" | "skip" (CFG branch not run)
    blocks_computed: tuple[int, int] | None = None   # [start, end) of DiT blocks run this step; None = all / none
    blocks_reused: tuple[int, int] | None = None     # [start, end) replaced by a cached residual (blocks outside it ran)
    metric: float | None = None                # the quantity the rule compared (residual diff, magnitude ratio)
    keys_skipped: int = 0                      # sparse attention: attention (query, key) pairs not computed


def _fmt(v: KnobValue | None) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


_KINDS: dict[str, AccelKind] = {}


def _collect() -> dict[str, AccelKind]:
    if not _KINDS:
        from manifests.accel import caches, sparse   # the kind catalogues beside this module
        for module in (caches, sparse):
            for kind in module.KINDS:
                if kind.name in _KINDS:
                    raise AssertionError(f"accel kind {kind.name!r} declared twice")
                _KINDS[kind.name] = kind
    return _KINDS


def kinds() -> tuple[AccelKind, ...]:
    return tuple(_collect()[n] for n in sorted(_collect()))


def get_kind(name: str) -> AccelKind:
    known = _collect()
    if name not in known:
        raise AccelSpecError(f"unknown acceleration {name!r} (known: {', '.join(sorted(known)) or 'none'})")
    return known[name]


def make_spec(name: str, knobs: Mapping[str, object] | Iterable[tuple[str, object]] = ()) -> AccelSpec:
    kind = get_kind(name)
    given = dict(knobs.items() if isinstance(knobs, Mapping) else knobs)
    for k in given:
        kind.knob(k)                           # unknown knob -> AccelSpecError naming the known ones
    values = tuple(sorted((k.name, k.coerce(name, given.get(k.name, k.default))) for k in kind.knobs))
    return AccelSpec(name=name, knobs=values)


def parse_accel(text: str) -> AccelSpec:
    """``NAME`` or ``NAME:knob=value,knob=value`` -> a validated AccelSpec (AccelSpecError on bad input)."""
    if not isinstance(text, str) or not text.strip():
        raise AccelSpecError(f"accel must be NAME[:knob=value,...], got {text!r}")
    name, _, rest = text.strip().partition(":")
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise AccelSpecError(f"accel {name}: expected knob=value, got {item!r}")
        pairs.append((k.strip(), v.strip()))
    seen = [k for k, _ in pairs]
    if len(set(seen)) != len(seen):
        raise AccelSpecError(f"accel {name}: a knob is given twice in {text!r}")
    return make_spec(name.strip(), pairs)


__all__ = ["AccelBudget", "AccelDecision", "AccelKind", "AccelSpec", "AccelSpecError", "Knob", "get_kind", "kinds",
           "make_spec", "parse_accel"]
