"""ParityContract: tolerances per (level, dtype, device), loaded from a family's parity.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from manifests.errors import ManifestError

LEVELS = ("C0", "C1", "C2", "C3", "C4")
METRICS = ("rel_l2", "max_abs", "min_cosine", "min_ssim", "min_psnr", "min_snr_db", "alpha")


@dataclass(frozen=True)
class Tolerance:
    rel_l2: float | None = None      # norm(a - b) / norm(b) must be <= this
    max_abs: float | None = None     # max |a - b| must be <= this
    min_cosine: float | None = None  # cosine(a, b) must be >= this
    min_ssim: float | None = None
    min_psnr: float | None = None
    min_snr_db: float | None = None  # C4 audio: waveform SNR in dB must be >= this
    alpha: float | None = None       # C3: p-value must exceed alpha

    def validate(self, where: str) -> "Tolerance":
        if all(getattr(self, m) is None for m in METRICS):
            raise ManifestError(f"{where}: a tolerance must bound at least one metric")
        for m in METRICS:
            v = getattr(self, m)
            if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
                raise ManifestError(f"{where}: {m} must be a finite non-negative number, got {v!r}")
        return self


@dataclass(frozen=True)
class ParityContract:
    family: str
    tolerances: dict[tuple[str, str, str], Tolerance]  # (level, dtype, device) -> Tolerance

    def tolerance(self, level: str, dtype: str, device: str) -> Tolerance:
        for key in ((level, dtype, device), (level, dtype, "*")):
            if key in self.tolerances:
                return self.tolerances[key]
        raise ManifestError(f"{self.family}: parity contract has no tolerance for level {level}, "
                            f"dtype {dtype}, device {device}")


def load_parity_contract(family: str) -> ParityContract:
    path = Path(__file__).parent / family / "parity.json"
    if not path.is_file():
        raise ManifestError(f"no parity contract for family {family!r} ({path} missing)")
    raw = json.loads(path.read_text())
    tols: dict[tuple[str, str, str], Tolerance] = {}
    for entry in raw["tolerances"]:
        level, dtype, device = entry["level"], entry["dtype"], entry.get("device", "*")
        if level not in LEVELS:
            raise ManifestError(f"{path}: unknown level {level!r}")
        tol = Tolerance(**{k: v for k, v in entry.items() if k in METRICS})
        tols[(level, dtype, device)] = tol.validate(f"{path} [{level}/{dtype}/{device}]")
    return ParityContract(family=family, tolerances=tols)
