"""The launcher's exit codes (issue 22, F18): a setup error is one message and exit 2, checked before any rank
starts under `--nproc-per-node`; the launcher's exit code is the ranks' when they agree, with one line naming them
(never the elastic agent's ChildFailedError traceback); under a bare torchrun only rank 0 prints a refusal."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def launch(*args: str, torchrun: int = 0, timeout: float = 240, path: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (path, str(ROOT)) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"] \
        if torchrun else [sys.executable]
    return subprocess.run(cmd + ["-m", "optimized.parallel.launch", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["--variant", "nope", "--request-json", "{}"], "no family has a variant 'nope'"),       # was a raw traceback
    (["--variant", "tiny-2.1-t2v", "--plan", "ulysses3", "--request-json", "{}"], "not divisible"),
    (["--variant", "tiny-2.1-t2v", "--plan", "cfgp2", "--requests", "/nonexistent.pt"], "no such file"),
    (["--checkpoint", "/nonexistent", "--plan", "cfgp2", "--request-json", "{}"], "/nonexistent"),
])
def test_setup_errors_exit_2_with_one_message_before_any_rank_starts(args, needle):
    out = launch(*args, "--nproc-per-node", "2", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert needle in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.count("error:") == 1


@pytest.mark.parametrize("make, needle", [
    (lambda d: (d / "r.pt").write_bytes(b"not a torch file") and str(d / "r.pt"), "not a list of requests"),
    (lambda d: torch.save([{"num_frames": 9}], d / "r.pt") or str(d / "r.pt"), "request 0 is a dict"),
])
def test_a_bad_requests_file_is_bad_input_exit_2(tmp_path, make, needle):
    """A file that is not a list of the family's requests was a rank failure (exit 1): it is bad input."""
    out = launch("--variant", "tiny-2.1-t2v", "--plan", "cfgp2", "--requests", make(tmp_path),
                 "--nproc-per-node", "2", timeout=120)
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("body, needle", [('{"num_frames": 9}', "TypeError"),       # missing fields
                                          ('{"text_ids": [1, 2], "num_frames": 9, "height": 32, "width": 32, '
                                           '"num_steps": 100000, "guidance_scale": 1.0}', "num_steps")])   # out of the contract's bounds
def test_an_invalid_request_json_is_bad_input_exit_2(body, needle):
    out = launch("--variant", "tiny-2.1-t2v", "--request-json", body, timeout=120)
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.dist
def test_ranks_that_fail_alike_give_their_exit_code_and_one_line(tmp_path):
    # a failure inside every rank's run (planted through sitecustomize, imported by each rank's interpreter)
    (tmp_path / "sitecustomize.py").write_text(
        "import optimized.engine as e\n"
        "def _fail(self, request):\n    raise RuntimeError('planted rank failure')\n"
        "e.Engine.submit = _fail\n")
    out = launch("--variant", "tiny-2.1-t2v", "--plan", "cfgp2", "--request-json",
                 '{"text_ids": [1, 2], "num_frames": 5, "height": 16, "width": 16, "num_steps": 1, "guidance_scale": 1.0}',
                 "--timeout", "20", "--nproc-per-node", "2", path=str(tmp_path))
    assert out.returncode == 1, out.stderr[-3000:]
    assert "ChildFailedError" not in out.stderr and "launch: 2 of 2 rank(s) failed" in out.stderr, out.stderr[-3000:]


@pytest.mark.dist
@pytest.mark.slow
def test_under_bare_torchrun_only_rank_0_prints_a_refusal():
    out = launch("--variant", "nope", "--request-json", "{}", torchrun=2)
    assert out.stderr.count("no family has a variant 'nope'") == 1, out.stderr[-3000:]
