"""fvparity align's pairing of upstream and canonical modules through a manifest's renames, and the scaffold's
shape-expression fit (no upstream package needed)."""

import subprocess
import sys
from pathlib import Path

from parity.port.kit import PortedSides
from parity.port.upstream import _fit

ROOT = Path(__file__).resolve().parents[1]


class RenamingSides(PortedSides):
    """A manifest that renames `blocks.<i>.attn.` to `layers.<i>.self_attn.` and keeps everything else."""

    def manifest(self):
        class M:
            @staticmethod
            def match(key, config):
                import re
                return None, re.sub(r"^blocks\.(\d+)\.attn\.", r"layers.\1.self_attn.", key)
        return M()


def sides() -> RenamingSides:
    return RenamingSides("x", None, None, ("norm.weight",), None, None, None, ("tiny",), "k", "blocks.1")


def test_module_map_pairs_renamed_modules_by_their_weight_keys():
    pairs = sides().module_map(["blocks.0.attn.to_q.weight", "blocks.0.ff.net.0.proj.weight", "proj_out.bias"], {})
    assert pairs["blocks.0.attn.to_q"] == "layers.0.self_attn.to_q"
    assert pairs["blocks.0.attn"] == "layers.0.self_attn"
    assert pairs["blocks.0.ff.net.0.proj"] == "blocks.0.ff.net.0.proj"
    assert pairs["proj_out"] == "proj_out"
    assert "blocks.0" not in pairs or pairs["blocks.0"] == "blocks.0"  # the renamed block pairs through ff only


def test_fit_finds_products_powers_and_offsets():
    tiny = {"heads": 2, "dim": 8, "patch": 2, "classes": 10}
    # 6 * heads * dim, doubling each field doubles it
    assert _fit({"": 96, "heads": 192, "dim": 192, "patch": 96}, tiny) == "6 * c.heads * c.dim"
    assert _fit({"": 11, "classes": 21}, tiny) == "c.classes + 1"
    assert _fit({"": 16, "patch": 64, "heads": 16}, tiny) == "4 * c.patch * c.patch"
    assert _fit({"": 256, "heads": 256}, tiny) is None           # a literal
    assert _fit({"": 7, "heads": 9}, tiny) is None                # no k * f^e + d explains it


def test_align_refuses_a_family_without_sides():
    r = subprocess.run([sys.executable, "-m", "parity.cli", "align", "seedvr2", "--upstream", "diffusers:X"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "exports no SIDES" in r.stderr and "Traceback" not in r.stderr
