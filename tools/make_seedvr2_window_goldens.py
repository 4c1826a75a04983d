"""Makes golden/seedvr2/windows/: upstream SeedVR's own window functions (models/dit_v2/window.py, regular
`720pwin_by_size_bysize` and shifted `720pswin_by_size_bysize`; models/dit/window.py must be identical) run on the
token grids of the seedvr2 geometry check (fixed grids plus those picked by the window rules, parity/families/
seedvr2/cases.py) and on the tiny NaDiT goldens' grids. Upstream code is read from a fetched copy of the repository
at the pinned commit and executed here; none of it is stored in the repo (only its listings).

Run: python tools/make_seedvr2_window_goldens.py --upstream /path/to/SeedVR[.git] [--commit SHA]
(a work tree, or a bare / mirror git directory read with `git show`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "golden" / "seedvr2" / "windows"
COMMIT = "673b56374c2adb21b7628b90df3829d457a52bbb"
NUM_WINDOWS = (4, 3, 3)   # configs_3b / configs_7b main.yaml: window [4, 3, 3] on every layer
FILES = ("models/dit_v2/window.py", "models/dit/window.py")


def read_upstream(upstream: Path, commit: str, rel: str) -> str:
    if (upstream / rel).is_file() and not (upstream / "HEAD").is_file():
        return (upstream / rel).read_text()
    return subprocess.run(["git", "--git-dir", str(upstream), "show", f"{commit}:{rel}"], check=True,
                          capture_output=True, text=True).stdout


def grids() -> list[tuple[int, int, int]]:
    from parity.families.seedvr2.cases import GEOMETRY_GRIDS, rule_token_grids
    tiny = [(5, 12, 40), (7, 8, 12), (5, 3, 4)]   # the nadit / restore goldens' token grids
    out: list[tuple[int, int, int]] = []
    for g in [*GEOMETRY_GRIDS, *rule_token_grids().values(), *tiny]:
        if g not in out:
            out.append(g)
    return out


def main(upstream: Path, commit: str) -> None:
    sources = {rel: read_upstream(upstream, commit, rel) for rel in FILES}
    if len(set(sources.values())) != 1:
        raise SystemExit("models/dit/window.py and models/dit_v2/window.py differ: record both")
    mod = types.ModuleType("upstream_window")
    exec(compile(sources[FILES[0]], FILES[0], "exec"), mod.__dict__)   # upstream's code, run, never stored
    ops = {"regular": mod.get_window_op("720pwin_by_size_bysize"),
           "shifted": mod.get_window_op("720pswin_by_size_bysize")}
    gs = grids()
    outputs = {}
    for method, op in ops.items():
        rows = []
        for i, g in enumerate(gs):
            for sl in op(g, NUM_WINDOWS):
                assert all(s.step is None for s in sl)
                rows.append([i] + [v for s in sl for v in (s.start, s.stop)])
        outputs[method] = torch.tensor(rows, dtype=torch.int64)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "upstream").mkdir(exist_ok=True)
    (OUT / "upstream" / "SOURCE.md").write_text(
        "No weights: the probe compares window listings. Upstream functions run by tools/make_seedvr2_window_goldens"
        f".py (not stored here), ByteDance-Seed/SeedVR @ {commit}, Apache-2.0:\n\n" +
        "".join(f"- `{rel}` sha256 {hashlib.sha256(src.encode()).hexdigest()}\n" for rel, src in sources.items()))
    save_file({"grids": torch.tensor(gs, dtype=torch.int64), "num_windows": torch.tensor(NUM_WINDOWS)},
              str(OUT / "inputs.safetensors"))
    save_file(outputs, str(OUT / "outputs.safetensors"))
    (OUT / "case.json").write_text(json.dumps({
        "family": "seedvr2", "probe": "seedvr2.windows",
        "upstream": {"package": "ByteDance-Seed/SeedVR", "version": commit, "class": "models.dit_v2.window",
                     "torch": "not used (pure Python)"},
        "upstream_format": "none", "dtype": "int64", "seed": None, "tolerance": {"rel_l2": 0.0},
        "params": {"functions": {"regular": "make_720Pwindows_bysize", "shifted": "make_shifted_720Pwindows_bysize"}},
        "description": "upstream window listings (regular and shifted, window (4,3,3)) on token grids (t, h, w): the "
                       "geometry check's fixed grids, the grids where truncating the scaled size moves a cut, the "
                       "shortest clips where the temporal cap of 30 moves a cut, and the tiny goldens' grids; rows "
                       "(grid index, t0, t1, h0, h1, w0, w1) in upstream order",
    }, indent=1) + "\n")
    print(f"{OUT}: {len(gs)} grids, {outputs['regular'].shape[0]} regular + {outputs['shifted'].shape[0]} shifted windows")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", type=Path, required=True)
    ap.add_argument("--commit", default=COMMIT)
    a = ap.parse_args()
    main(a.upstream, a.commit)
