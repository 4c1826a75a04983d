"""The named parallel plan and each family's parallelism contract, both plain data, validated at load time.

    plan = ParallelPlan.parse("cfgp2,ulysses2")      # ParallelPlan(dp=1, cfgp=2, sp_ulysses=2, sp_ring=1, tp=1)
    WAN_CONTRACT.validate(plan, cfg, world_size=4)   # ParallelPlanError naming the broken constraint, or the plan

Axes, outermost to innermost in the device mesh (torchtitan's order: the chattiest axis innermost, on the fastest
links): dp (independent requests) > cfgp (cond / uncond branches, one gather per step) > sp_ring (K/V passed around a
ring) > sp_ulysses (two all-to-alls per attention) > tp (two reductions per block). `sp_window` is seedvr2's
window-aligned SP (every rank keeps all heads; excludes ulysses and ring).

A family declares what its shapes admit and what the runtime realises today as a `ParallelismContract`; the
contract is also the family's `FamilyEntry.parallelize` hook (`contract(instance, mesh)` validates and attaches).
seedvr2 still writes plans in the earlier `ParallelPlan(((axis, degree), ...), sp_mode=...)` form; that form is
read into the same fields (see `_from_degrees`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

AXES = ("dp", "cfgp", "sp_ring", "sp_ulysses", "tp", "sp_window")      # mesh order, outermost first
ALIASES = {"dp": "dp", "cfgp": "cfgp", "cfg": "cfgp", "ulysses": "sp_ulysses", "sp_ulysses": "sp_ulysses",
           "ring": "sp_ring", "sp_ring": "sp_ring", "tp": "tp", "window": "sp_window", "sp_window": "sp_window"}
LEGACY_SP_MODES = ("window", "ulysses", "ring", "allgather", "advanced_uaa", "ulysses_a2a_permute")
SP_MODES = LEGACY_SP_MODES   # the earlier name, kept for seedvr2


class ParallelPlanError(ValueError):
    """A ParallelPlan that a component or loop cannot run (raised at load time, never mid-run)."""


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees of the named axes; the product is the world size. `sp_mode` is derived from the SP degrees
    ("ulysses", "ring", "ulysses+ring", "window"; "window" when no SP axis is used) unless the legacy form names it."""

    dp: Any = 1                   # an int; a tuple of (axis, degree) pairs selects the legacy form
    cfgp: int = 1
    sp_ulysses: int = 1
    sp_ring: int = 1
    tp: int = 1
    sp_window: int = 1
    sp_mode: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.dp, tuple):
            plan = _from_degrees(self.dp, self.sp_mode)
            for f in fields(self):
                object.__setattr__(self, f.name, getattr(plan, f.name))
            return
        for axis in AXES:
            d = getattr(self, axis)
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ParallelPlanError(f"ParallelPlan: axis {axis} degree must be a positive int, got {d!r}")
        if self.sp_window > 1 and (self.sp_ulysses > 1 or self.sp_ring > 1):
            raise ParallelPlanError("ParallelPlan: window SP (seedvr2) keeps every head on every rank and cannot be "
                                    "combined with ulysses or ring SP")
        if not self.sp_mode:
            mode = "+".join(m for m, d in (("ulysses", self.sp_ulysses), ("ring", self.sp_ring)) if d > 1)
            object.__setattr__(self, "sp_mode", mode or "window")

    # ---- construction
    @classmethod
    def parse(cls, text: str) -> "ParallelPlan":
        """"cfgp2,ulysses2" / "ulysses2xring2" / "tp2" / "" (single device). Axis names: dp, cfgp (cfg), ulysses,
        ring, tp, window (each also as sp_<name>)."""
        degrees: dict[str, int] = {}
        for part in filter(None, re.split(r"[,x* ]+", text.strip().lower())):
            m = re.fullmatch(r"([a-z_]+?)=?(\d+)", part)
            if not m or m.group(1) not in ALIASES:
                raise ParallelPlanError(f"ParallelPlan: cannot read {part!r} in {text!r}; write axis names with "
                                        f"degrees, e.g. 'cfgp2,ulysses2' (axes: dp, cfgp, ulysses, ring, tp, window)")
            axis = ALIASES[m.group(1)]
            if axis in degrees:
                raise ParallelPlanError(f"ParallelPlan: axis {axis} given twice in {text!r}")
            degrees[axis] = int(m.group(2))
        return cls(**degrees)

    # ---- views
    def degree(self, axis: str) -> int:
        """Degree of an axis; "sp" (legacy) is the product of the SP axes."""
        if axis == "sp":
            return self.sp_ulysses * self.sp_ring * self.sp_window
        return getattr(self, ALIASES.get(axis, axis)) if ALIASES.get(axis, axis) in AXES else 1

    @property
    def world_size(self) -> int:
        n = 1
        for axis in AXES:
            n *= getattr(self, axis)
        return n

    @property
    def sp_degree(self) -> int:
        return self.degree("sp")

    @property
    def active_axes(self) -> tuple[tuple[str, int], ...]:
        """(axis, degree) for every axis of degree > 1, in mesh order."""
        return tuple((a, getattr(self, a)) for a in AXES if getattr(self, a) > 1)

    @property
    def degrees(self) -> tuple[tuple[str, int], ...]:
        """The legacy view: dp, tp, sp (all SP axes), cfgp."""
        return tuple((a, self.degree(a)) for a in ("dp", "tp", "sp", "cfgp"))

    def name(self) -> str:
        """The short form `parse` reads: "cfgp2,ulysses2"; "single" for world size 1."""
        short = {"sp_ulysses": "ulysses", "sp_ring": "ring", "sp_window": "window"}
        return ",".join(f"{short.get(a, a)}{d}" for a, d in self.active_axes) or "single"

    def signature(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES) + f";sp_mode={self.sp_mode}"

    def hash(self) -> str:
        """What goes into CacheKey.parallel_plan_hash / GraphKey: "single" at world size 1 (the default in both),
        else the plan's name and a digest of its full signature."""
        if self.world_size == 1:
            return "single"
        return f"{self.name()}@{hashlib.sha256(self.signature().encode()).hexdigest()[:10]}"

    # ---- the legacy check seedvr2 calls
    def validate(self, supported_axes: tuple[str, ...] = ("dp", "tp", "sp", "cfgp"),
                 supported_sp_modes: tuple[str, ...] = LEGACY_SP_MODES, who: str = "model") -> "ParallelPlan":
        for axis, deg in self.degrees:
            if deg > 1 and axis not in supported_axes:
                raise ParallelPlanError(f"{who} does not support parallel axis {axis!r} (degree {deg}); "
                                        f"supported: {', '.join(supported_axes)}")
        if self.sp_mode not in supported_sp_modes:
            raise ParallelPlanError(f"{who} rejects sp_mode {self.sp_mode!r}; supported: "
                                    f"{', '.join(supported_sp_modes)}")
        return self


def _from_degrees(degrees: tuple, sp_mode: str) -> ParallelPlan:
    """The earlier form ParallelPlan(((axis, degree), ...), sp_mode="window") with axes dp, tp, sp, cfgp."""
    names = [a for a, _ in degrees]
    if len(set(names)) != len(names):
        raise ParallelPlanError(f"ParallelPlan: duplicate axes {names}")
    mode = sp_mode or "window"
    if mode not in LEGACY_SP_MODES:
        raise ParallelPlanError(f"ParallelPlan: unknown sp_mode {mode!r}; known: {', '.join(LEGACY_SP_MODES)}")
    kw: dict[str, int] = {}
    for axis, deg in degrees:
        if axis not in ("dp", "tp", "sp", "cfgp"):
            raise ParallelPlanError(f"ParallelPlan: unknown axis {axis!r}; known: dp, tp, sp, cfgp")
        if not isinstance(deg, int) or deg < 1:
            raise ParallelPlanError(f"ParallelPlan: axis {axis} degree must be a positive int, got {deg!r}")
        if axis == "sp":
            axis = {"ulysses": "sp_ulysses", "ring": "sp_ring"}.get(mode, "sp_window")
        kw[axis] = deg
    return ParallelPlan(**kw, sp_mode=mode)


# ---------------------------------------------------------------------------------------------------------------
# Family contracts
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionShape:
    name: str             # e.g. "dit.self", "dit.cross", "dit_2.self"
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelShapes:
    """What the plan constraints read from a config."""
    attentions: tuple[AttentionShape, ...]
    ffn_dims: tuple[int, ...]          # TP column-splits these (and the heads); row-parallel outputs reduce
    hidden: int


@dataclass(frozen=True)
class ParallelismContract:
    """What a family's model admits (`axes`, with the shape rules below) and what the runtime realises today
    (`implemented`). Callable as the family's `parallelize(instance, mesh)` hook."""

    family: str
    axes: tuple[str, ...]                          # axes whose degree may exceed 1
    implemented: tuple[str, ...]                   # of those, the ones the runtime runs today
    shapes: Callable[[Any], ModelShapes] | None = None   # config -> shapes (None: no head / width rule)
    kv_rule: str = "divide"       # "divide": kv heads % (ulysses*tp) == 0; "replicate": or (ulysses*tp) % kv == 0
    seq_rule: str = "pad"         # "pad": a sequence is padded to a multiple of ulysses*ring and padded keys masked
    max_cfgp: int = 2             # guided batches have two branches
    notes: tuple[str, ...] = ()   # constraints the runtime keeps that are not checked here (said in errors / docs)
    # instance -> (object, method name) pairs whose CacheKeys must carry the plan hash (filled by the hook)
    cache_keys: Callable[[Any], tuple[tuple[Any, str], ...]] | None = None
    # (checkpoint path, mesh, device, dtype) -> this rank's instance with its tp shards read from the checkpoint only
    load_sharded: Callable[..., Any] | None = None

    def check(self, plan: ParallelPlan, cfg: Any = None, world_size: int | None = None,
              require_implemented: bool = True) -> list[str]:
        """Every broken constraint as one sentence (empty: the plan runs)."""
        who, errs = f"{self.family}", []
        if world_size is not None and plan.world_size != world_size:
            errs.append(f"{who}: plan {plan.name()} needs world size {plan.world_size} (the product of its degrees), "
                        f"the launch has {world_size}")
        for axis, deg in plan.active_axes:
            if axis not in self.axes:
                errs.append(f"{who} does not support axis {axis} (degree {deg}); supported: "
                            f"{', '.join(self.axes) or 'none'}")
            elif require_implemented and axis not in self.implemented:
                errs.append(f"{who}: axis {axis} is admitted by the model's shapes but not wired in the runtime yet "
                            f"(runs today: {', '.join(self.implemented) or 'none'})")
        if plan.cfgp > self.max_cfgp:
            errs.append(f"{who}: cfgp={plan.cfgp} exceeds the {self.max_cfgp} CFG branches of a guided batch")
        if cfg is not None and self.shapes is not None:
            errs += self._check_shapes(plan, self.shapes(cfg))
        return errs

    def _check_shapes(self, plan: ParallelPlan, shapes: ModelShapes) -> list[str]:
        errs, head_split = [], plan.sp_ulysses * plan.tp
        for a in shapes.attentions:
            if a.heads % head_split:
                errs.append(f"{self.family} {a.name}: {a.heads} heads are not divisible by ulysses x tp = "
                            f"{plan.sp_ulysses} x {plan.tp} = {head_split}")
            if a.kv_heads % head_split and a.kv_heads != a.heads:   # MHA: said once, by the heads rule
                replicable = self.kv_rule == "replicate" and head_split % a.kv_heads == 0
                if not replicable:
                    rule = ("nor does ulysses x tp divide by them (the declared GQA KV-replication rule)"
                            if self.kv_rule == "replicate" else "and the family declares no KV-replication rule")
                    errs.append(f"{self.family} {a.name}: {a.kv_heads} KV heads are not divisible by ulysses x tp "
                                f"= {head_split}, {rule}")
        for f in shapes.ffn_dims:
            if f % plan.tp:
                errs.append(f"{self.family}: ffn width {f} is not divisible by tp = {plan.tp}")
        return errs

    def validate(self, plan: ParallelPlan, cfg: Any = None, world_size: int | None = None,
                 require_implemented: bool = True) -> ParallelPlan:
        errs = self.check(plan, cfg, world_size, require_implemented)
        if errs:
            raise ParallelPlanError(f"plan {plan.name()} refused: " + "; ".join(errs))
        return plan

    def padded_sequence(self, tokens: int, plan: ParallelPlan) -> int:
        """The sequence length SP runs at: padded to a multiple of ulysses x ring ("pad"), else as is."""
        n = plan.sp_ulysses * plan.sp_ring
        if self.seq_rule != "pad" or n == 1:
            return tokens
        return -(-tokens // n) * n

    def __call__(self, instance: Any, mesh: Any) -> Any:
        """The FamilyEntry.parallelize hook: validate the mesh's plan against the instance's config and attach the
        mesh (`instance.parallel_mesh`) so loops and caches can read it."""
        plan = mesh.plan if hasattr(mesh, "plan") else mesh
        self.validate(plan, getattr(instance, "cfg", None), getattr(mesh, "world_size", None))
        instance.parallel_mesh = mesh
        if self.cache_keys is not None and plan.world_size > 1:
            for owner, method in self.cache_keys(instance):
                # an instance-level override until the model reads its plan itself: the key of every cached
                # value this instance writes names the layout it was computed under
                setattr(owner, method, _plan_keyed(getattr(type(owner), method).__get__(owner), plan))
        return instance


def _plan_keyed(make_key: Callable[..., Any], plan: ParallelPlan) -> Callable[..., Any]:
    def key(*args: Any, **kw: Any) -> Any:
        return keyed(make_key(*args, **kw), plan)
    return key


def keyed(key: Any, plan: ParallelPlan) -> Any:
    """A CacheKey / GraphKey with `parallel_plan_hash` filled from the plan."""
    return replace(key, parallel_plan_hash=plan.hash())
