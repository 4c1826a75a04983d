"""fvconvert defects of issue 11 (6, 7, 8), each pinned by a test that failed before the fix: temp directories of
killed runs, SIGTERM, atomic and safe --force, umask, the exit-code convention, bad inputs that were internal
errors, the `cosmos_framework` format name and vision keys under language_model.model.visual."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from converters import ConversionError, convert, load_canonical
from converters.cli import main
from manifests.cosmos3 import load_variant
from tests.conftest import ROOT
from tests.test_converter_formats import write_source
from tests.test_converters import assert_nothing_left, canonical_state, make_diffusers_ckpt


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".fvconvert-" in p.name)


# ---- 6: temp directories, signals, --force, umask ----------------------------------------------------------------

def test_stale_temp_dirs_of_dead_runs_are_removed_alive_ones_kept(tmp_path):
    src, _ = make_diffusers_ckpt(tmp_path / "src")
    dead = tmp_path / f".out.fvconvert-tmp-{dead_pid()}-0badc0de"
    alive = tmp_path / f".out.fvconvert-tmp-{os.getppid()}-0123abcd"   # a live process (pytest's parent)
    other = tmp_path / f".other.fvconvert-tmp-{dead_pid()}-00000000"   # another OUT's: not ours to touch
    for d in (dead, alive, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    convert("cosmos3", "diffusers", src, tmp_path / "out", skip_parity=True)
    assert not dead.exists() and alive.exists() and other.exists()
    assert leftovers(tmp_path) == sorted([alive.name, other.name])


SLOW_CLI = """
import sys, time, pathlib
import converters.cli as cli
def slow(out_dir):
    pathlib.Path(sys.argv[2]).write_text("writing")
    time.sleep(60)
    return {"status": "pass"}
cli.get_post_check = lambda name: slow
sys.exit(cli.main(["cosmos3", "--from", "diffusers", sys.argv[1], sys.argv[3], "-q"]))
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_removes_the_partial_output_and_exits_clearly(tmp_path, sig, code):
    src, _ = make_diffusers_ckpt(tmp_path / "src")
    marker, out = tmp_path / "marker", tmp_path / "o" / "out"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, str(src), str(marker), str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()
    assert leftovers(out.parent)  # mid-run: the staging directory exists
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists() or not leftovers(tmp_path / "o")
    assert_nothing_left(out)


CRASH_BETWEEN_RENAMES = """
import os, sys
import converters.staging as st
st.exchange = lambda a, b: False          # the journal fallback (no renameat2)
real, calls = os.replace, []
def replace(a, b):
    calls.append((a, b))
    if len(calls) == 2:                    # OUT moved aside, the new one not yet in place: die here
        os._exit(9)
    return real(a, b)
os.replace = replace
from converters import convert
convert("cosmos3", "diffusers", sys.argv[1], sys.argv[2], force=True, skip_parity=True)
"""


def test_force_replacement_killed_between_renames_is_recovered(tmp_path):
    old_src, old = make_diffusers_ckpt(tmp_path / "old_src", seed=1)
    new_src, new = make_diffusers_ckpt(tmp_path / "new_src", seed=2)
    out = tmp_path / "out"
    convert("cosmos3", "diffusers", old_src, out, skip_parity=True)
    proc = subprocess.run([sys.executable, "-c", CRASH_BETWEEN_RENAMES, str(new_src), str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert not out.exists() and any("journal" in n for n in leftovers(tmp_path))  # the crash window
    from converters.staging import recover_stale
    assert recover_stale(out)                      # what the next run does first
    _, got = load_canonical(out)
    assert all(torch.equal(got[k], old[k]) for k in old) and leftovers(tmp_path) == []
    convert("cosmos3", "diffusers", new_src, out, force=True, skip_parity=True)   # and --force works again
    _, got = load_canonical(out)
    assert all(torch.equal(got[k], new[k]) for k in new) and leftovers(tmp_path) == []


def test_force_replaces_atomically_by_exchange(tmp_path, monkeypatch):
    src, canon = make_diffusers_ckpt(tmp_path / "src", seed=3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    import converters.staging as st
    swaps = []
    real = st.exchange
    monkeypatch.setattr(st, "exchange", lambda a, b: swaps.append((a, b)) or real(a, b))
    monkeypatch.setattr(os, "replace", lambda *a: pytest.fail("--force must not rename OUT away"))
    convert("cosmos3", "diffusers", src, out, force=True, skip_parity=True)
    assert swaps and not (out / "old.txt").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["inside_source_dir", "a_source_file", "the_source_dir_parent"])
def test_force_never_replaces_the_source(tmp_path, capsys, where):
    src, _ = make_diffusers_ckpt(tmp_path / "src")
    if where == "inside_source_dir":
        out = src / "sub"
        out.mkdir()
    elif where == "a_source_file":
        out = src / "diffusion_pytorch_model.safetensors"
    else:
        out = tmp_path
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    rc = main(["cosmos3", "--from", "diffusers", str(src), str(out), "--force", "--skip-parity", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "refusing" in err
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == before


def test_force_never_replaces_a_shard_folder_of_an_index(tmp_path):
    src, _ = make_diffusers_ckpt(tmp_path / "src", layout="sharded")
    idx = json.loads((src / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = tmp_path / "src" / "shards"
    shards.mkdir()
    for name in set(idx["weight_map"].values()):
        os.replace(src / name, shards / name)
    idx["weight_map"] = {k: f"shards/{v}" for k, v in idx["weight_map"].items()}
    (src / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ConversionError, match="refusing"):
        convert("cosmos3", "diffusers", src / "diffusion_pytorch_model.safetensors.index.json", shards,
                config=src / "config.json", force=True, skip_parity=True)
    assert len(list(shards.iterdir())) == 3


def test_outputs_respect_the_umask(tmp_path):
    src, _ = make_diffusers_ckpt(tmp_path / "src")
    old = os.umask(0o027)
    try:
        convert("cosmos3", "diffusers", src, tmp_path / "out", skip_parity=True)
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750
    for f in (tmp_path / "out").iterdir():
        assert f.stat().st_mode & 0o777 == 0o640, f


# ---- 7: one exit-code convention; bad inputs are exit 2 with one line --------------------------------------------

def test_internal_error_is_exit_3_and_help_documents_the_convention(tmp_path, capsys, monkeypatch):
    src, _ = make_diffusers_ckpt(tmp_path / "src")
    import converters.cli as cli
    monkeypatch.setattr(cli, "convert", lambda *a, **k: {}["a bug"])
    assert main(["cosmos3", "--from", "diffusers", str(src), str(tmp_path / "out"), "--skip-parity"]) == 3
    assert "internal error: KeyError" in capsys.readouterr().err
    main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "1 parity failure" in text and "3 internal error" in text and "143" in text


def test_failed_post_check_is_exit_1(tmp_path, capsys, monkeypatch):
    src, _ = make_diffusers_ckpt(tmp_path / "src")
    import converters.cli as cli
    monkeypatch.setattr(cli, "get_post_check", lambda name: lambda d: {"status": "fail", "summary": "3 checks"})
    assert main(["cosmos3", "--from", "diffusers", str(src), str(tmp_path / "out")]) == 1
    assert "parity" in capsys.readouterr().err
    assert_nothing_left(tmp_path / "out")


def _index_with(src: Path, mutate) -> Path:
    idx_path = src / "diffusion_pytorch_model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    mutate(src, idx)
    idx_path.write_text(json.dumps(idx))
    return src


def _list_valued(src, idx):
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = [idx["weight_map"][k]]


def _symlink_loop(src, idx):
    os.symlink("loop_b", src / "loop_a")
    os.symlink("loop_a", src / "loop_b")
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = "loop_a/x.safetensors"


def _sparse_pth(src, idx):
    sd = load_file(str(next(src.glob("*-00001-of-*.safetensors"))))
    k = next(iter(sd))
    sd[k] = sd[k].reshape(sd[k].shape[0], -1).to_sparse() if sd[k].dim() <= 2 else sd[k].to_sparse()
    torch.save(sd, src / "weights.pth")


@pytest.mark.parametrize("bad, needle", [("list_valued_weight_map", "not to one shard file name"),
                                          ("symlink_loop", "symlink loop"), ("sparse_pth", "sparse")])
def test_bad_inputs_are_exit_2_with_one_line(tmp_path, capsys, bad, needle):
    src, _ = make_diffusers_ckpt(tmp_path / "src", layout="sharded")
    _index_with(src, {"list_valued_weight_map": _list_valued, "symlink_loop": _symlink_loop,
                      "sparse_pth": _sparse_pth}[bad])
    arg = src / ("weights.pth" if bad == "sparse_pth" else "diffusion_pytorch_model.safetensors.index.json")
    rc = main(["cosmos3", "--from", "diffusers", str(arg), str(tmp_path / "out"), "--config", str(src / "config.json"),
               "--skip-parity", "-q"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and needle in err.lower() and "internal" not in err
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("argv", [["run", "seedvr2", "--level", "C0", "--device", "nosuchdev"],
                                  ["run", "seedvr2", "--level", "C0", "--json", "{file}/r.json"],
                                  ["run", "seedvr2", "--level", "C0", "--json", "{dir}"],
                                  ["golden", "golden/seedvr2/vae", "--json", "{file}/r.json"]])
def test_fvparity_setup_errors_are_exit_2_before_the_run(fvparity, tmp_path, argv):
    (tmp_path / "a_file").write_text("")  # a path under a regular file can never be written
    argv = [a.format(file=tmp_path / "a_file", dir=tmp_path) for a in argv]
    t0 = time.time()
    proc = fvparity(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fvparity: error:") and proc.stdout == ""
    assert time.time() - t0 < 30  # nothing ran


# ---- 8: the cosmos-framework format name and its vision keys ------------------------------------------------------

def test_cosmos_framework_alias_and_model_visual_sidecar(tmp_path):
    cfg, canon = load_variant("tiny"), canonical_state("tiny", seed=1)
    vit = {"language_model.model.visual.blocks.0.attn.qkv.weight": torch.randn(6, 4),
           "language_model.visual.merger.linear_fc1.weight": torch.randn(4, 4)}
    src = write_source(tmp_path / "s", "framework", canon, cfg, {}, kind="safetensors", extra=vit)
    rep = convert("cosmos3", "cosmos_framework", src, tmp_path / "o", variant="tiny", keep_sidecars=True,
                  skip_parity=True)
    assert rep.format == "framework" and rep.sidecars["vision_encoder"]["keys"] == 2
    side = load_file(str(tmp_path / "o" / "vision_encoder" / "model.safetensors"))
    assert set(side) == {"blocks.0.attn.qkv.weight", "merger.linear_fc1.weight"}
    _, got = load_canonical(tmp_path / "o")
    assert all(torch.equal(got[k], canon[k]) for k in canon)
