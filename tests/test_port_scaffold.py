"""`fvparity port new` + `fvparity align` on a small diffusers DiT (DiTTransformer2DModel), in a temporary copy of the
tree: the skeleton is listed at once and C0 fails "not implemented"; with the two hand-written forwards
(tests/data/port_forwards/dit/) C0 passes, the planted fault fails naming its layer, fvconvert converts with its
post-check, align names a planted upstream-side difference, and no file outside the family's folders changed."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORWARDS = ROOT / "tests" / "data" / "port_forwards"
SPEC = "diffusers:DiTTransformer2DModel"
FAMILY = "ditport"   # a name no family has
FAMILY_PATHS = (f"manifests/{FAMILY}/", f"reference/{FAMILY}/", f"optimized/models/{FAMILY}/",
                f"parity/families/{FAMILY}/", f"golden/{FAMILY}/", f"tests/test_{FAMILY}.py")

pytestmark = pytest.mark.upstream


def tree_copy(dst: Path) -> Path:
    """The working tree's tracked and untracked (not ignored) files, goldens left out (not needed here)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for rel in files:
        if rel and not rel.startswith("golden/") and (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    return dst


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def cli(root: Path, module: str, *args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=root, capture_output=True, text=True,
                          timeout=timeout, env=env)


def outside_family(before: dict, after: dict) -> list[str]:
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    return sorted(k for k in changed if not k.startswith(FAMILY_PATHS))


@pytest.fixture
def scaffolded(tmp_path):
    root = tree_copy(tmp_path / "tree")
    before = snapshot(root)
    r = cli(root, "parity.cli", "port", "new", FAMILY, "--from", SPEC)
    assert r.returncode == 0, r.stdout + r.stderr
    return root, before


def test_port_new_is_listed_and_c0_says_not_implemented(scaffolded):
    root, before = scaffolded
    listed = cli(root, "parity.cli", "list")
    assert listed.returncode == 0 and FAMILY in listed.stdout, listed.stdout + listed.stderr
    r = cli(root, "parity.cli", "run", FAMILY, "--level", "C0", "--dtype", "fp32")
    assert r.returncode == 1 and "not implemented: reference.forward" in r.stdout, r.stdout + r.stderr
    assert outside_family(before, snapshot(root)) == []
    again = cli(root, "parity.cli", "port", "new", FAMILY, "--from", SPEC)   # never over an existing family
    assert again.returncode == 2 and "exists already" in again.stderr


def test_port_new_refuses_bad_input(tmp_path):
    root = tree_copy(tmp_path / "tree")
    r = cli(root, "parity.cli", "port", "new", "x", "--from", "diffusers:NoSuchModel")
    assert r.returncode == 2 and "no model class" in r.stderr and "Traceback" not in r.stderr
    assert not (root / "manifests" / "x").exists()


@pytest.mark.slow
def test_port_with_forwards_end_to_end(scaffolded, tmp_path):
    root, before = scaffolded
    subprocess.run([sys.executable, str(FORWARDS / "apply.py"), str(root), FAMILY, str(FORWARDS / "dit")],
                   check=True)
    listed = cli(root, "parity.cli", "list")
    assert FAMILY in listed.stdout
    ok = cli(root, "parity.cli", "run", FAMILY, "--level", "C0")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    fault = cli(root, "parity.cli", "run", FAMILY, "--level", "C0", "--dtype", "fp32",
                "--plant-fault", "scaled-weight-transformer_blocks.1")
    assert fault.returncode == 1 and "transformer_blocks.1" in fault.stdout, fault.stdout + fault.stderr
    aligned = cli(root, "parity.cli", "align", FAMILY, "--upstream", SPEC, "--save",
                  str(root / "golden" / FAMILY / "tiny_forward"))
    assert aligned.returncode == 0 and "ALIGNED" in aligned.stdout, aligned.stdout + aligned.stderr
    # a planted upstream-side difference in block 0 is named on both sides (and not block 1 or the output)
    planted = cli(root, "parity.cli", "align", FAMILY, "--upstream", SPEC, "--plant-upstream",
                  "transformer_blocks.0")
    assert planted.returncode == 1, planted.stdout + planted.stderr
    rows = [ln for ln in planted.stdout.splitlines() if ln.startswith(("reference", "optimized"))]
    assert len(rows) == 2 and all(ln.split()[1] == "transformer_blocks.0" for ln in rows), planted.stdout
    golden = cli(root, "parity.cli", "golden", str(root / "golden" / FAMILY / "tiny_forward"))
    assert golden.returncode == 0, golden.stdout + golden.stderr
    out = tmp_path / "converted"
    conv = cli(root, "converters.cli", FAMILY, "--from", "diffusers",
               str(root / "golden" / FAMILY / "tiny_forward" / "upstream"), str(out))
    assert conv.returncode == 0 and "parity:  pass" in conv.stdout, conv.stdout + conv.stderr
    on_ckpt = cli(root, "parity.cli", "run", FAMILY, "--level", "C0", "--dtype", "fp32", "--checkpoint", str(out))
    assert on_ckpt.returncode == 0, on_ckpt.stdout + on_ckpt.stderr
    generated = cli(root, "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", f"tests/test_{FAMILY}.py")
    assert generated.returncode == 0, generated.stdout[-2000:]
    assert outside_family(before, snapshot(root)) == []
