"""Upstream golden cases: convert `upstream/` to the canonical layout, run the case's probe on each side,
compare with the upstream outputs. The format is documented in golden/README.md."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from manifests import ManifestError
from manifests.parity import Tolerance
from parity.errors import SetupError
from parity.report import CheckResult, Report, exceptions_fail

CASE_FILES = ("case.json", "upstream", "inputs.safetensors", "outputs.safetensors")
CASE_KEYS = ("family", "probe", "upstream", "upstream_format", "dtype", "seed", "tolerance")


@dataclass
class GoldenCase:
    path: Path
    meta: dict
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def tolerance(self) -> Tolerance:
        try:
            return Tolerance(**self.meta["tolerance"]).validate(f"{self.path}/case.json tolerance")
        except (TypeError, ManifestError) as e:
            raise SetupError(f"{self.path}/case.json: bad tolerance ({e})") from None


def load_case(path: Path) -> GoldenCase:
    if not path.is_dir():
        raise SetupError(f"golden case {path}: not a directory")
    for f in CASE_FILES:
        if not (path / f).exists():
            raise SetupError(f"golden case {path}: missing {f}")
    try:
        meta = json.loads((path / "case.json").read_text())
    except json.JSONDecodeError as e:
        raise SetupError(f"golden case {path}: case.json is not valid JSON ({e})") from None
    missing = [k for k in CASE_KEYS if k not in meta]
    if missing:
        raise SetupError(f"golden case {path}: case.json lacks {missing}")
    tensors = {}
    for f in ("inputs.safetensors", "outputs.safetensors"):
        try:
            tensors[f] = load_file(str(path / f))
        except (SafetensorError, OSError, ValueError) as e:
            raise SetupError(f"golden case {path}: cannot read {f} ({e})") from None
    return GoldenCase(path, meta, tensors["inputs.safetensors"], tensors["outputs.safetensors"])


def read_diffusers_dir(case: GoldenCase, sub: str = "upstream") -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json + the fp32 state dict of a case's diffusers component folder `sub` (diffusers names are the
    canonical names for the VAEs and the sound tokenizer: identity)."""
    d = case.path / sub
    try:
        config = json.loads((d / "config.json").read_text())
        state = load_file(str(d / "diffusion_pytorch_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        raise SetupError(f"golden case {case.path}: cannot read {sub}/ ({e})") from None
    if case.meta.get("upstream_format") != "diffusers":
        raise SetupError(f"golden case {case.path}: upstream_format must be 'diffusers'")
    return config, {k: v.float() for k, v in state.items()}


def output_checks(case: GoldenCase, declared) -> list[CheckResult]:
    """Strict outputs: a required output the case lacks, or an output the probe does not declare (so nothing
    would compare it), is a failed check. `declared` is the probe's GoldenOutputs (parity/family.py)."""
    from fnmatch import fnmatchcase

    required = set(declared.required)
    for inp, outs in declared.required_with.items():
        if inp in case.inputs:
            required |= set(outs)
    allowed = required | set(declared.optional)
    missing = sorted(n for n in required if n not in case.outputs)
    extra = sorted(n for n in case.outputs if not any(fnmatchcase(n, pat) for pat in allowed))
    checks = []
    if missing:
        checks.append(CheckResult(f"{case.name}/outputs:required", False,
                                  detail=f"missing required output(s) {', '.join(missing)} "
                                         f"(probe {case.meta['probe']})"))
    if extra:
        checks.append(CheckResult(f"{case.name}/outputs:undeclared", False,
                                  detail=f"output(s) {', '.join(extra)} not declared by probe {case.meta['probe']} "
                                         f"(nothing compares them)"))
    return checks


def run_probe(probe, case: GoldenCase, sides: tuple[str, ...]) -> list[CheckResult]:
    """One case: its output declaration, then the probe; an exception of the probe or the engine becomes a failed
    check naming it (the run goes on). A SetupError (bad case files) still stops the run (exit 2)."""
    declared = getattr(probe, "golden_outputs", None)
    checks = output_checks(case, declared) if declared is not None else []
    if any(c.name.endswith("outputs:required") for c in checks):
        return checks  # the probe would compare against nothing (or crash on the missing name)
    with exceptions_fail(checks, f"{case.name}/probe", who="probe"), torch.no_grad():
        checks += probe(case, sides)
    return checks


def case_dirs(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """(case folders, paths skipped). Several paths (a shell glob such as golden/seedvr2/*) may hold files and
    folders that are not cases (no case.json): they are skipped; one path given alone must be a case, and a path
    that does not exist is never skipped (a typo, not a glob)."""
    if len(paths) == 1:
        return list(paths), []
    skipped = [p for p in paths if p.exists() and not (p / "case.json").is_file()]
    cases = [p for p in paths if p not in skipped]
    if not cases:
        raise SetupError(f"no golden case among {len(paths)} paths (a case folder holds case.json): "
                         f"{', '.join(map(str, paths))}")
    return cases, skipped


def run_golden_cases(paths: list[Path], sides: tuple[str, ...], progress: Callable[[str], None]) -> Report:
    from parity.families import golden_probes

    probes = golden_probes()  # derived from every family's FAMILY entry
    paths, skipped = case_dirs(paths)
    if skipped:
        progress(f"[golden] skipped {len(skipped)} path(s) that are not case folders (no case.json): "
                 f"{', '.join(map(str, skipped))}")
    cases = [load_case(p) for p in paths]  # validate every case before running any
    for c in cases:
        if c.meta["probe"] not in probes:
            raise SetupError(f"golden case {c.path}: unknown probe {c.meta['probe']!r}; known: {', '.join(probes)}")
    report = Report("golden", "upstream", {"cases": [str(p) for p in paths], "sides": list(sides),
                                           **({"skipped": [str(p) for p in skipped]} if skipped else {})})
    for c in cases:
        progress(f"[golden] {c.name} ({c.meta['probe']}, {c.meta['upstream'].get('package')} "
                 f"{c.meta['upstream'].get('version')})")
        report.checks += run_probe(probes[c.meta["probe"]], c, sides)
    return report
