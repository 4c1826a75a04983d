"""The wan parity family (Wan 2.1 / 2.2): one entry, assembled from one module per component or loop.

Today: vae.py (C0 of the Wan VAE decoder/encoder, golden probes `wan.vae_encode`, `wan.vae_decode`).
Where the rest goes: the DiT and UMT5 component checks in dit.py / umt5.py (their C0 suites and the probes
`wan.dit`, `wan.umt5`), the denoise loop in c1.py (probe `wan.generate`), decoded artifacts in c4.py (reuse
parity/artifacts.py). Each module exposes its runner(s) and a PROBES dict; this file wires them into LEVELS,
FAULTS and PROBES below, and nothing else needs to change (the registry, `fvparity list`, the golden table and
the fvconvert post-check all read FAMILY).
"""

from __future__ import annotations

from parity.checkpoints import c0_post_check
from parity.family import ParityFamily
from parity.families.wan import vae

LEVELS = {"C0": vae.run_c0}
FAULTS = vae.FAULTS
PROBES = {**vae.PROBES}


def check_converted(out_dir) -> dict:
    """fvconvert's post-check: C0 (fp32, CPU) on freshly converted wan VAE weights."""
    return c0_post_check(LEVELS["C0"], out_dir)


FAMILY = ParityFamily(
    name="wan",
    description="Wan 2.1 / 2.2: VAE decoder and encoder (chunked loops with carried conv caches)",
    levels=LEVELS, variants=vae.variants, default_variants=vae.DEFAULT_VARIANTS, faults=FAULTS,
    golden_probes=PROBES, check_converted=check_converted)
