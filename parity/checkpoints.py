"""The models a parity run checks: a family's variants with seeded random weights, or one converted checkpoint."""

from __future__ import annotations

from typing import Any, Callable

import torch

from manifests import ManifestError
from parity.errors import SetupError
from parity.weights import random_state_dict


def models_to_check(family: str, variants: list[str], default_variants, checkpoint: str | None, seed: int,
                    load_variant: Callable[[str], Any], key_shapes: Callable[[Any], dict]
                    ) -> list[tuple[str, Any, dict[str, torch.Tensor]]]:
    """(name, config, fp32 canonical state dict) per model. A checkpoint must be the family's (as fvconvert
    recorded it) and equal every named variant's architecture."""
    try:
        if checkpoint is None:
            return [(v, cfg, random_state_dict(key_shapes(cfg), seed))
                    for v in (variants or default_variants) for cfg in [load_variant(v)]]
        from converters import ConversionError, load_canonical
        from converters.canonical import read_resolved_manifest
        try:
            recorded = (read_resolved_manifest(checkpoint) or {}).get("family", family)
            if recorded != family:
                raise SetupError(f"checkpoint {checkpoint} is a {recorded} checkpoint, not {family}")
            cfg, state = load_canonical(checkpoint, family=family)
        except ConversionError as e:
            raise SetupError(str(e)) from None
        for v in variants:
            if load_variant(v) != cfg:
                raise SetupError(f"checkpoint {checkpoint} does not have the architecture of variant {v!r}")
        return [("checkpoint", cfg, {k: t.float() for k, t in state.items()})]
    except ManifestError as e:
        raise SetupError(str(e)) from None


def c0_post_check(run_c0, out_dir) -> dict:
    """fvconvert's post-check for a family: its C0 (fp32, CPU) on freshly converted weights, before the output
    is committed. The dict goes into conversion_report.json under `parity`."""
    try:
        report = run_c0([], str(out_dir), "cpu", ["fp32"], 0, None, progress=lambda msg: None)
    except SetupError as e:
        return {"status": "error", "level": "C0", "detail": str(e)}
    failed = [c.name for c in report.checks if not c.passed]
    return {"status": "pass" if report.passed else "fail", "level": "C0", "dtype": "float32", "device": "cpu",
            "checks": len(report.checks), "failed": failed}
