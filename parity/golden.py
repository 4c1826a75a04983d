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
from parity.report import CheckResult, Report

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


def run_golden_cases(paths: list[Path], sides: tuple[str, ...], progress: Callable[[str], None]) -> Report:
    from parity import vae_checks
    from parity.families import cosmos3, cosmos3_ar, cosmos3_c1, cosmos3_c4, wan

    probes = {"cosmos3.transformer": cosmos3.golden_transformer_probe,
              "cosmos3.generate": cosmos3_c1.golden_generate_probe,
              "cosmos3.reason": cosmos3_ar.golden_reason_probe,
              **cosmos3_c4.PROBES, **wan.PROBES, **vae_checks.PROBES}
    cases = [load_case(p) for p in paths]  # validate every case before running any
    for c in cases:
        if c.meta["probe"] not in probes:
            raise SetupError(f"golden case {c.path}: unknown probe {c.meta['probe']!r}; known: {', '.join(probes)}")
    report = Report("golden", "upstream", {"cases": [str(p) for p in paths], "sides": list(sides)})
    for c in cases:
        progress(f"[golden] {c.name} ({c.meta['probe']}, {c.meta['upstream'].get('package')} "
                 f"{c.meta['upstream'].get('version')})")
        report.checks += probes[c.meta["probe"]](c, sides)
    return report
