"""Check results, the tabulate report and the --json document."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tabulate import tabulate

from manifests.parity import Tolerance
from parity.metrics import Metrics, compare, within


@dataclass
class CheckResult:
    name: str
    passed: bool
    metrics: Metrics | None = None        # None for exact (bitwise / integer) checks
    tolerance: Tolerance | None = None
    detail: str = ""                      # what was compared, or why it failed
    divergence: str | None = None         # first divergent layer by canonical name (C0/C1)
    extra: dict | None = None             # per-modality metrics and other detail for --json

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "passed": self.passed,
            "metrics": self.metrics.to_dict() if self.metrics else None,
            "tolerance": {k: v for k, v in vars(self.tolerance).items() if v is not None} if self.tolerance else "exact",
            "detail": self.detail,
            "first_divergence": self.divergence,
            **({"extra": self.extra} if self.extra else {}),
        }


def tensor_check(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerance, divergence: str | None = None,
                 detail: str = "") -> CheckResult:
    """One tensor comparison as a check; `divergence` is reported only when it fails."""
    m = compare(got, want)
    ok = within(m, tol)
    return CheckResult(name, ok, m, tol, detail=detail, divergence=None if ok else divergence)


@dataclass
class Report:
    family: str
    level: str
    settings: dict
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def table(self) -> str:
        rows = []
        for c in self.checks:
            m = c.metrics
            tol = "exact" if c.tolerance is None else ", ".join(
                f"{k}{'>=' if k.startswith('min_') else '<='}{v:g}" for k, v in vars(c.tolerance).items() if v is not None)
            rows.append([
                c.name,
                f"{m.rel_l2:.2e}" if m else "-",
                f"{m.max_abs:.2e}" if m else "-",
                f"{m.cosine:.8f}" if m else "-",
                (m.nonfinite_candidate + m.nonfinite_reference) if m else "-",
                tol,
                "PASS" if c.passed else "FAIL",
                c.divergence or c.detail,
            ])
        head = ["check", "rel_l2", "max_abs", "cosine", "nan/inf", "tolerance", "result", "first divergence / detail"]
        return tabulate(rows, headers=head, tablefmt="simple")

    def summary(self) -> str:
        n_fail = sum(not c.passed for c in self.checks)
        verdict = "PASS" if self.passed else "FAIL"
        return f"{self.family} {self.level}: {verdict} ({len(self.checks) - n_fail}/{len(self.checks)} checks passed)"

    def to_dict(self) -> dict:
        return {"family": self.family, "level": self.level, "settings": self.settings, "passed": self.passed,
                "checks": [c.to_dict() for c in self.checks]}

    def write_json(self, path: str | Path) -> None:
        """Atomic: a temp file beside the target, then rename."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=2)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
