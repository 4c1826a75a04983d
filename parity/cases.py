"""Case matrices by rule, family-agnostic: every family's cases.py draws its C0 / C1 cases from named rules with
these helpers (a fixed seed per rule and draw, so a run is reproducible; `ci` draws each rule once, `full` more)."""

from __future__ import annotations

import random
from dataclasses import fields

import torch

MATRICES = ("ci", "full")


def rule_rng(family: str, rule: str, seed: int, draw: int) -> random.Random:
    """The random stream of one draw of one rule (independent of every other rule and draw)."""
    return random.Random(f"{family}:{rule}:{seed}:{draw}")


def draws(matrix: str, ci: int = 1, full: int = 3) -> range:
    if matrix not in MATRICES:
        raise ValueError(f"unknown case matrix {matrix!r}; known: {', '.join(MATRICES)}")
    return range(ci if matrix == "ci" else full)


def rules_covered(cases) -> set[str]:
    return {rule for c in cases for rule in c.rules}


def describe(case) -> dict:
    """A case as plain data (for reproducibility checks and reports)."""
    def plain(v):
        if isinstance(v, torch.Tensor):
            return v.tolist()
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if hasattr(v, "__dataclass_fields__"):
            return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
        return v
    return plain(case)


def cfgp_mixes(cfgp: int) -> list[tuple[int, int]]:
    """(guided, unguided) request counts of a same-tick batch, at least one of each and at most cfgp + 2 requests,
    whose rows (one cond row per request, then one uncond row per guided request) split over `cfgp` CFG-parallel
    ranks (optimized/parallel/cfg_parallel.py `split_rows`) give some rank rows of both branches, with no rank idle:
    the batches a plan run's `cfgp_mixed_rows` rule draws from."""
    from optimized.parallel.cfg_parallel import split_rows

    most = cfgp + 2
    out = []
    for guided in range(1, most):
        for unguided in range(1, most - guided + 1):
            n_cond = guided + unguided
            parts = split_rows(n_cond + guided, cfgp)
            if all(b > a for a, b in parts) and any(a < n_cond < b for a, b in parts):
                out.append((guided, unguided))
    return out
