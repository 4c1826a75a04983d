"""`fvparity align FAMILY --upstream diffusers:CLASS`: where a port first leaves upstream, module by module.

Upstream and both sides run on the same seeded inputs and the same weights (upstream's, mapped to canonical names
by the family's CheckpointManifest). Upstream's module outputs are taken with forward hooks, the sides' from their
`trace(name, tensor)` calls; modules pair through the manifest's key map (a weight `M.rest` renamed `N.rest` pairs
module M with N). The first upstream module (in the order upstream finished them) whose paired side output is out
of the family's C0 tolerance is named, with both names, both shapes and the metrics. `--save CASE` freezes the
inputs, the upstream weights, the output and every paired module output into a golden case (golden/README.md,
`out@<upstream module>` intermediates) for the family's `<family>.forward` probe.
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from manifests.parity import Tolerance, load_parity_contract
from parity.errors import SetupError
from parity.metrics import Metrics, compare, within
from parity.port.kit import PortedSides, gain_init
from parity.port.upstream import resolve, shapes_of
from parity.weights import random_state_dict

SIDES = ("reference", "optimized")
PLANT_SCALE = 1.01          # --plant-upstream: that module's output scaled (align's own negative control)


@dataclass
class ModuleRow:
    upstream: str
    canonical: str
    upstream_shape: tuple[int, ...]
    side_shape: tuple[int, ...]
    metrics: Metrics


@dataclass
class SideAlignment:
    side: str
    error: str | None = None                  # the side did not run (e.g. "not implemented: reference.forward")
    compared: int = 0
    first: ModuleRow | None = None            # the first divergent module
    output: Metrics | None = None
    output_ok: bool = True
    untraced: list[str] = field(default_factory=list)   # upstream modules the side did not trace

    @property
    def aligned(self) -> bool:
        return self.error is None and self.first is None and self.output is not None and self.output_ok


@dataclass
class Alignment:
    family: str
    upstream: str
    tolerance: Tolerance
    sides: list[SideAlignment]
    paired: int                               # upstream modules with a canonical name

    @property
    def passed(self) -> bool:
        return all(s.aligned for s in self.sides)


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor)), None)
    return getattr(out, "sample", None)


def family_sides(family: str) -> PortedSides:
    try:
        module = importlib.import_module(f"parity.families.{family}")
    except ModuleNotFoundError:
        raise SetupError(f"unknown family {family!r} (no parity/families/{family})") from None
    sides = getattr(module, "SIDES", None)
    if not isinstance(sides, PortedSides):
        raise SetupError(f"{family} exports no SIDES = PortedSides(...) (families made by `fvparity port new` do), "
                         f"so align does not know how to run its sides")
    return sides


@dataclass
class UpstreamRun:
    config: dict                                              # the upstream config (config.json spelling)
    model: torch.nn.Module
    state: dict[str, torch.Tensor]                            # upstream names
    output: torch.Tensor
    modules: dict[str, torch.Tensor]                          # upstream module -> output, in finishing order


def run_upstream(spec: str, sides: PortedSides, variant: str | None, checkpoint: str | None, seed: int,
                 plant: str | None) -> tuple[UpstreamRun, Any, dict]:
    up = resolve(spec)
    if checkpoint is not None:
        try:
            model = up.cls.from_pretrained(checkpoint).float().eval()
        except Exception as e:  # noqa: BLE001 - a folder upstream cannot read is bad input
            raise SetupError(f"--checkpoint {checkpoint}: {up.name}.from_pretrained failed ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]})") from None
        config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    else:
        cfg = sides.load_variant(variant or sides.default_variants[0])
        config = cfg.to_dict()
        model = up.build(config, "cpu").float().eval()
        model.load_state_dict(random_state_dict(shapes_of(model), seed, gain_init(sides.gains)), strict=True)
    cfg = sides.config_from_upstream({"_class_name": up.name, **config})
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    inputs = sides.make_inputs(cfg, seed)
    names = sides.module_map(state, config)
    modules: dict[str, torch.Tensor] = {}
    handles = []
    by_name = dict(model.named_modules())
    if plant is not None:
        if plant not in by_name:
            raise SetupError(f"--plant-upstream {plant!r}: no such upstream module")
        handles.append(by_name[plant].register_forward_hook(_scaled))
    for name, mod in by_name.items():
        if name in names:
            handles.append(mod.register_forward_hook(_recorder(name, modules)))
    try:
        with torch.no_grad():
            out = _first_tensor(model(**inputs, return_dict=False))
    finally:
        for h in handles:
            h.remove()
    return UpstreamRun(config, model, state, out.float(), modules), cfg, inputs


def _scaled(module, args, out):
    if isinstance(out, torch.Tensor):
        return out * PLANT_SCALE
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (out[0] * PLANT_SCALE, *out[1:])
    raise SetupError("--plant-upstream: that module returns no tensor")


def _recorder(name: str, into: dict) -> Callable:
    def hook(module, args, out):
        t = _first_tensor(out)
        if t is not None and name not in into:  # a module called twice: its first call
            into[name] = t.detach().float().clone()
    return hook


def align(family: str, spec: str, variant: str | None = None, checkpoint: str | None = None, seed: int = 0,
          plant: str | None = None, progress: Callable[[str], None] = lambda m: None
          ) -> tuple[Alignment, UpstreamRun, dict, dict[str, dict]]:
    sides = family_sides(family)
    progress(f"[align {family}] upstream {spec}")
    run, cfg, inputs = run_upstream(spec, sides, variant, checkpoint, seed, plant)
    names = sides.module_map(run.state, run.config)
    state = sides.canonical_state(run.state, run.config)
    tol = load_parity_contract(family).tolerance("C0", "float32", "cpu")
    results, traces = [], {}
    for side in SIDES:
        progress(f"[align {family}] {side}")
        res = SideAlignment(side)
        try:
            out, trace = sides.forward(side, cfg, state, inputs)
        except Exception as e:  # noqa: BLE001 - a side that does not run is that side's finding
            res.error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            results.append(res)
            continue
        traces[side] = trace
        for up_name, want in run.modules.items():
            got = trace.get(names[up_name])
            if got is None:
                res.untraced.append(up_name)
                continue
            res.compared += 1
            m = compare(got, want)
            if res.first is None and not within(m, tol):
                res.first = ModuleRow(up_name, names[up_name], tuple(want.shape), tuple(got.shape), m)
        res.output = compare(out, run.output)
        res.output_ok = within(res.output, tol)
        results.append(res)
    return Alignment(family, spec, tol, results, len(run.modules)), run, inputs, traces


def table(a: Alignment) -> str:
    from tabulate import tabulate

    rows = []
    for s in a.sides:
        if s.error:
            rows.append([s.side, "-", "-", "-", "-", "-", "-", f"did not run: {s.error}"])
            continue
        f = s.first
        out = f"output rel_l2 {s.output.rel_l2:.2e}" + ("" if s.output_ok else " (FAIL)")
        if f is None:
            rows.append([s.side, "-", "-", "-", "-", "-", "-", f"aligned: {s.compared} modules; {out}"])
        else:
            rows.append([s.side, f.upstream, f.canonical, list(f.upstream_shape), list(f.side_shape),
                         f"{f.metrics.rel_l2:.2e}", f"{f.metrics.max_abs:.2e}",
                         f"first divergent of {s.compared} compared; {out}"])
    head = ["side", "upstream module", "canonical module", "upstream shape", "side shape", "rel_l2", "max_abs",
            "detail"]
    return tabulate(rows, headers=head)


def save_case(case: Path, a: Alignment, run: UpstreamRun, inputs: dict, traces: dict, seed: int,
              force: bool) -> list[str]:
    """A golden case (golden/README.md) of the upstream run: only module outputs every side traced are stored, so
    each one is compared. Written into a temp dir beside the target, then renamed."""
    if case.exists() and not force:
        raise SetupError(f"--save {case}: exists (pass --force to replace it)")
    from safetensors.torch import save_file

    names = family_sides(a.family).module_map(run.state, run.config)
    kept = [m for m in run.modules if all(names[m] in t for t in traces.values())] if traces else []
    up = resolve(a.upstream)
    case.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=case.parent, prefix=f".{case.name}."))
    try:
        run.model.save_pretrained(str(tmp / "upstream"), safe_serialization=True)
        config = json.loads((tmp / "upstream" / "config.json").read_text())
        save_file({k: v.contiguous() for k, v in inputs.items()}, str(tmp / "inputs.safetensors"))
        outputs = {"out": run.output.contiguous(), **{f"out@{m}": run.modules[m].contiguous() for m in kept}}
        save_file(outputs, str(tmp / "outputs.safetensors"))
        meta = {"family": a.family, "probe": f"{a.family}.forward",
                "upstream": {"package": up.package, "version": up.version, "class_name": up.name},
                "upstream_format": "diffusers", "dtype": "float32", "seed": seed,
                "tolerance": {k: v for k, v in vars(a.tolerance).items() if v is not None},
                "config": config, "intermediates": [f"out@{m}" for m in kept],
                "made_by": f"fvparity align {a.family} --upstream {a.upstream} --seed {seed} --save"}
        (tmp / "case.json").write_text(json.dumps(meta, indent=2) + "\n")
        if case.exists():
            shutil.rmtree(case)
        tmp.rename(case)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return kept
