"""The cosmos3 parity family: one entry assembled from one module per level.

Imports only go downward: common.py (the two sides' adapters, comparison, models to check) and faults.py (every
planted fault) are used by c0.py (components), ar.py (AR decoding, used by C1), c1.py (denoise loops), c4_setup.py
and c4.py (decoded artifacts); each level module exposes its runner and a PROBES dict (upstream golden probes).
"""

from __future__ import annotations

from parity.checkpoints import c0_post_check
from parity.families.cosmos3 import ar, c0, c1, c2, c3, c4, common, faults, processors
from parity.family import ParityFamily

LEVELS = {"C0": processors.with_processor_checks(c0.run_c0), "C1": c1.run_c1, "C2": c2.run_c2, "C3": c3.run_c3,
          "C4": c4.run_c4}
PROBES = {**c0.PROBES, **c1.PROBES, **ar.PROBES, **c4.PROBES, **processors.PROBES}


def check_converted(out_dir) -> dict:
    """fvconvert's post-check: C0 (fp32, CPU) on freshly converted weights."""
    return c0_post_check(c0.run_c0, out_dir)


FAMILY = ParityFamily(
    name="cosmos3",
    description="omni MoT transformer (vision, sound, action), UniPC denoise loop with CFG, AR reasoning, decoders",
    levels=LEVELS, variants=common.variants, default_variants=common.DEFAULT_VARIANTS,
    faults=faults.FAULTS + c2.FAULTS + c3.FAULTS,
    golden_probes=PROBES, check_converted=check_converted, supports_world_size=False)
