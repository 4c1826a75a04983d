"""The parity side of a family made by `fvparity port new`: one `PortedSides` per family (in its
parity/families/<family>/__init__.py) gives the C0 runner, the planted weight fault, the golden probe, the fvconvert
post-check, and what `fvparity align` needs (the sides' forwards and the upstream <-> canonical name map).

Contract with the family's two sides: `load(cfg, canonical_state, device, dtype)` returns a model whose
`forward(**inputs, trace=None)` takes the upstream forward's tensor arguments by name and, when `trace` is given,
calls `trace(canonical_module_name, tensor)` for each module output it wants localised (blocks at least).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from manifests.parity import load_parity_contract
from parity.checkpoints import c0_post_check, models_to_check
from parity.errors import SetupError
from parity.family import DTYPE_NAMES, DTYPES, golden_probe
from parity.localise import TraceRecorder, first_divergence
from parity.report import CheckResult, Report, exceptions_fail, tensor_check
from parity.weights import random_state_dict

SideLoader = Callable[..., Any]         # (cfg, state, device, dtype) -> model with forward(**inputs, trace=None)
FAULT_SCALE = 1.5                       # the planted fault scales one weight of one layer on the optimized side


def gain_init(gains: tuple[str, ...]):
    """The random-weight rule of a ported family: its declared gains near 1, biases small, fan-in otherwise."""
    def init(name: str, shape: tuple[int, ...], r: torch.Tensor) -> torch.Tensor:
        if name.endswith(gains):
            return 1.0 + 0.1 * r
        if len(shape) == 1:
            return 0.1 * r
        return r / max(1.0, float(torch.tensor(shape[1:]).prod())) ** 0.5
    return init


@dataclass(frozen=True)
class PortedSides:
    family: str
    load_variant: Callable[[str], Any]
    key_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    gains: tuple[str, ...]
    make_inputs: Callable[[Any, int], dict[str, torch.Tensor]]
    reference: SideLoader
    optimized: SideLoader
    default_variants: tuple[str, ...]
    fault_key: str                      # the weight the planted fault scales
    fault_layer: str                    # where C0 must localise it
    upstream_format: str = "diffusers"  # the CheckpointManifest that maps upstream names to canonical ones
    # more planted faults, (weight, layer) each: e.g. one per output stream of a multi-output forward
    extra_faults: tuple[tuple[str, str], ...] = ()

    @property
    def fault_name(self) -> str:
        return f"scaled-weight-{self.fault_layer}"

    @property
    def faults(self) -> dict[str, tuple[str, str]]:
        """{fault name: (weight it scales, layer C0 must name)}, the scaffold's first."""
        pairs = ((self.fault_key, self.fault_layer), *self.extra_faults)
        return {f"scaled-weight-{layer}": (key, layer) for key, layer in pairs}

    def random_state(self, cfg: Any, seed: int) -> dict[str, torch.Tensor]:
        return random_state_dict(self.key_shapes(cfg), seed, gain_init(self.gains))

    def forward(self, side: str, cfg: Any, state: dict, inputs: dict, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(output, {canonical module: traced tensor}) of one side; a forward returning several outputs gives
        its first (upstream's `return_dict=False` order)."""
        outs, trace = self.forward_all(side, cfg, state, inputs, device, dtype)
        return outs[0], trace

    def forward_all(self, side: str, cfg: Any, state: dict, inputs: dict, device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """([every output], {canonical module: traced tensor}) of one side (LTX-2 returns video and audio)."""
        model = (self.reference if side == "reference" else self.optimized)(cfg, state, device=device, dtype=dtype)
        rec = TraceRecorder()
        args = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in inputs.items()}
        with torch.no_grad():
            out = model(**args, trace=rec)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        return [o.float().cpu() for o in outs], {k: v.float().cpu() for k, v in rec.records.items()}

    def planted(self, fault: str | None, state: dict) -> dict:
        if fault is None:
            return state
        if fault not in self.faults:
            raise SetupError(f"unknown fault {fault!r} for {self.family}; faults: {', '.join(self.faults)}")
        key, _ = self.faults[fault]
        return {**state, key: state[key] * FAULT_SCALE}

    # ---- C0 ----
    def run_c0(self, variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
               fault: str | None, progress: Callable[[str], None], **_: Any) -> Report:
        """The full forward of each model, reference vs optimized, with first-divergent-layer localisation."""
        report = Report(self.family, "C0", {"variants": variants, "checkpoint": checkpoint, "device": device,
                                             "dtypes": dtypes, "seed": seed, "fault": fault})
        contract = load_parity_contract(self.family)
        if checkpoint is None:  # the family's own random-weight rule (its declared gains)
            models = [(v, cfg, self.random_state(cfg, seed)) for v in (variants or self.default_variants)
                      for cfg in [self._variant(v)]]
        else:
            models = models_to_check(self.family, variants, self.default_variants, checkpoint, seed,
                                     self.load_variant, self.key_shapes)
        for name, cfg, state in models:
            inputs = self.make_inputs(cfg, seed)
            for dt in dtypes:
                check = f"{name}/{dt}/forward"
                progress(f"[{self.family} C0] {check}")
                tol = contract.tolerance("C0", DTYPE_NAMES[dt], device)
                with exceptions_fail(report.checks, check):
                    want, want_trace = self.forward_all("reference", cfg, state, inputs, device, DTYPES[dt])
                    got, got_trace = self.forward_all("optimized", cfg, self.planted(fault, state), inputs, device,
                                                      DTYPES[dt])
                    if len(got) != len(want):
                        raise ValueError(f"optimized returned {len(got)} outputs, reference {len(want)}")
                    div = first_divergence(got_trace, want_trace, tol)
                    # every output is a check (`forward`, then `forward.out1` ...): none goes uncompared
                    for n, (g, w) in enumerate(zip(got, want)):
                        report.checks.append(tensor_check(check + (f".out{n}" if n else ""), g, w, tol,
                                                          div.name if div else None,
                                                          detail=f"{len(want_trace)} traced modules"))
        return report

    def _variant(self, name: str) -> Any:
        from manifests import ManifestError
        try:
            return self.load_variant(name)
        except ManifestError as e:
            raise SetupError(str(e)) from None

    def check_converted(self, out_dir) -> dict:
        return c0_post_check(self.run_c0, out_dir)

    # ---- upstream names ----
    def canonical_state(self, upstream_state: dict, config: dict) -> dict[str, torch.Tensor]:
        """Upstream weights -> canonical, by the family's CheckpointManifest (every key must map)."""
        manifest = self.manifest()
        out = {}
        for k, v in upstream_state.items():
            _, target = manifest.match(k, config)
            if target is None:
                raise SetupError(f"{self.family}: upstream key {k!r} has no rule in the {self.upstream_format} "
                                 f"manifest")
            out[target] = v
        return out

    def manifest(self):
        from converters.manifest import load_manifest
        return load_manifest(self.family, self.upstream_format)

    def module_map(self, upstream_keys, config: dict) -> dict[str, str]:
        """{upstream module path: canonical module path}, read off the weight keys: a key `M.rest` renamed to
        `N.rest` pairs module M with N (every prefix M of the key)."""
        manifest = self.manifest()
        pairs: dict[str, str] = {}
        for k in upstream_keys:
            _, target = manifest.match(k, config)
            if target is None:
                continue
            up, can = k.split("."), target.split(".")
            for n in range(1, min(len(up), len(can))):
                if up[n:] != can[len(can) - len(up) + n:]:
                    continue  # renamed inside the suffix: a shorter suffix may still pair
                pairs.setdefault(".".join(up[:n]), ".".join(can[:len(can) - len(up) + n]))
        return pairs

    # ---- golden ----
    def golden_probe(self):
        @golden_probe(required=("out",), optional=("out@*",))
        def probe(case, sides: tuple[str, ...]) -> list[CheckResult]:
            """A case made by `fvparity align --save`: the upstream forward's inputs, its output `out` and its
            module outputs `out@<upstream module>`; each side is compared on both."""
            from parity.golden import intermediate_checks, read_diffusers_dir

            config, up_state = read_diffusers_dir(case)
            cfg = self.config_from_upstream(config)
            state = self.canonical_state(up_state, config)
            to_upstream = {v: k for k, v in self.module_map(up_state, config).items()}
            inputs = {k: case.inputs[k] for k in sorted(case.inputs)}
            checks = []
            for side in sides:
                with exceptions_fail(checks, f"{case.name}/{side}:out"):
                    out, trace = self.forward(side, cfg, state, inputs)
                    checks.append(tensor_check(f"{case.name}/{side}:out", out, case.outputs["out"], case.tolerance))
                    traced = {to_upstream.get(k, k): v for k, v in trace.items()}
                    checks += intermediate_checks(case, side, "out", traced, case.tolerance)
            return checks
        return probe

    def config_from_upstream(self, config: dict) -> Any:
        from manifests.layouts import family_layouts
        layout = family_layouts()[self.family].components[0]
        mapping = next(iter(layout.config_mappings.values()))
        return mapping(config)
