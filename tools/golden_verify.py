"""How a golden maker's `--verify` judges a fresh upstream run against a case's stored outputs.

Bit-exact is the norm. A case made in another environment (another torch build, BLAS kernel or thread count) may
differ by fp32 re-association only; that is reported as such, with the size, and still verifies. Anything larger,
any integer/bool difference, or a key / shape / dtype change is a mismatch.
"""

from __future__ import annotations

import torch

ROUNDING_REL_L2 = 1e-6   # fp32 re-association noise; 3-10x below every golden comparison tolerance in golden/README.md


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def judge(fresh: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]) -> tuple[bool, str]:
    """(verifies, one-line verdict)."""
    bad = [f"{k} (missing on one side)" for k in sorted(set(fresh) ^ set(stored))]
    worst, worst_key = 0.0, ""
    for k in sorted(set(fresh) & set(stored)):
        a, b = fresh[k], stored[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            bad.append(f"{k} ({a.dtype} {list(a.shape)} vs stored {b.dtype} {list(b.shape)})")
        elif not torch.equal(a, b):
            if not a.is_floating_point():
                bad.append(f"{k} (integer values differ)")
                continue
            r = _rel_l2(a, b)
            if r > ROUNDING_REL_L2:
                bad.append(f"{k} (rel-L2 {r:.2e})")
            elif r > worst:
                worst, worst_key = r, k
    if bad:
        return False, "mismatch in " + ", ".join(bad)
    if worst_key:
        return True, (f"fp32 rounding only (max rel-L2 {worst:.1e} in {worst_key} <= {ROUNDING_REL_L2:.0e}; "
                      "made in another environment)")
    return True, "bit-exact"
