"""seedvr2 parity checks (reference vs optimized, and both vs the upstream goldens).

c0.py: window geometry, the planner and the full NaDiT (3B / 7B tiny variants) at SP world sizes 1..4 with
first-divergent-layer localisation; cases.py: the cases (fixed grids and grids picked by the window rules);
restore.py: C1 (the one-step restoration loop) and C4 (decoded frames); golden.py: the probes seedvr2.nadit /
.vae / .restore / .windows over golden/seedvr2/ (the public upstream goldens in the project's case format);
faults.py: the planted faults (module patches at declared seams).
"""

from __future__ import annotations

from pathlib import Path

from manifests.seedvr2 import list_variants
from parity.family import Fault, ParityFamily
from parity.families.seedvr2.c0 import (DEFAULT_VARIANTS, DEFAULT_WORLD_SIZES, check_geometry, check_planner,
                                        nadit_checks, run_c0, sp_worker)
from parity.families.seedvr2.cases import (CASES, GEOMETRY_GRIDS, NaDiTCase, NaDiTInputs, make_inputs, nadit_state,
                                           rule_token_grids)
from parity.families.seedvr2.faults import FAULTS, FAULTS_INFO, planted
from parity.families.seedvr2.golden import PROBES
from parity.families.seedvr2.restore import run_c1, run_c4

SUPPORTS_WORLD_SIZE = True  # fvparity --world-size
ROOT = Path(__file__).resolve().parents[3]
GOLDEN_DIR = ROOT / "golden" / "seedvr2"  # `fvparity golden golden/seedvr2/*/`
LEVELS = {"C0": run_c0, "C1": run_c1, "C4": run_c4}


def variants() -> list[str]:
    return list_variants()


def check_converted(out_dir) -> dict:
    """fvconvert's post-check: C0 (fp32, CPU, one process: sp=1) on the converted NaDiT."""
    from parity.checkpoints import c0_post_check
    return c0_post_check(lambda *a, **kw: run_c0(*a, world_sizes=[1], **kw), out_dir)


FAMILY = ParityFamily(
    name="seedvr2",
    description="NaDiT with 3D window attention, one-step restoration, window-aligned sequence parallelism",
    levels=LEVELS, variants=variants, default_variants=DEFAULT_VARIANTS,
    faults=tuple(Fault(name, what, "C0", layer) for name, (what, layer) in FAULTS_INFO.items()),
    golden_probes=PROBES, supports_world_size=SUPPORTS_WORLD_SIZE, check_converted=check_converted)

__all__ = ["CASES", "DEFAULT_VARIANTS", "DEFAULT_WORLD_SIZES", "FAMILY", "FAULTS", "FAULTS_INFO", "GEOMETRY_GRIDS",
           "GOLDEN_DIR", "LEVELS", "NaDiTCase", "NaDiTInputs", "PROBES", "check_geometry", "check_planner",
           "make_inputs", "nadit_checks", "nadit_state", "planted", "rule_token_grids", "run_c0", "run_c1", "run_c4",
           "sp_worker", "variants"]
