"""Check results, the tabulate report and the --json document; and the rule that an exception inside a check is
that check failing (`raised_check`, `exceptions_fail`, `opened_reports`), never a crash of the run."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import traceback
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from tabulate import tabulate

from manifests.parity import Tolerance
from parity.errors import SetupError
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


def raised_check(name: str, e: BaseException, who: str = "") -> CheckResult:
    """Check `name` failed because `who` (or the check itself) raised `e`: its type and message, one line (where it
    was raised too under FVPARITY_DEBUG=1)."""
    detail = f"{who + ' ' if who else ''}raised {type(e).__name__}: {' '.join(str(e).split())[:300]}"
    if os.environ.get("FVPARITY_DEBUG") and e.__traceback__ is not None:
        where = traceback.extract_tb(e.__traceback__)[-1]
        detail += f" (at {Path(where.filename).name}:{where.lineno})"
    return CheckResult(name, False, detail=detail)


@contextlib.contextmanager
def exceptions_fail(checks: list[CheckResult], name: str, who: str = "") -> Iterator[None]:
    """An exception inside the block is check `name` failing (appended to `checks`, after whatever the block
    appended before it) and the run goes on after the block. A SetupError (bad input: exit 2) passes through."""
    try:
        yield
    except SetupError:
        raise
    except Exception as e:  # noqa: BLE001 - a failure of what is checked, not of the harness
        checks.append(raised_check(name, e, who))


_OPENED: ContextVar[list[Report] | None] = ContextVar("parity_reports_opened", default=None)


@contextlib.contextmanager
def opened_reports() -> Iterator[list[Report]]:
    """Every Report created inside the block, in order: a level runner that raises still hands back the checks it
    made (ParityFamily.run)."""
    opened: list[Report] = []
    token = _OPENED.set(opened)
    try:
        yield opened
    finally:
        _OPENED.reset(token)


@dataclass
class Report:
    family: str
    level: str
    settings: dict
    checks: list[CheckResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        opened = _OPENED.get()
        if opened is not None:
            opened.append(self)

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
