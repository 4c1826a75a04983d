"""The launcher's exit codes (issue 22, F18): a setup error is one message and exit 2, checked before any rank
starts under `--nproc-per-node`; the launcher's exit code is the ranks' when they agree, with one line naming them
(never the elastic agent's ChildFailedError traceback); under a bare torchrun only rank 0 prints a refusal."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def launch(*args: str, torchrun: int = 0, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
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


@pytest.mark.dist
def test_ranks_that_fail_alike_give_their_exit_code_and_one_line(tmp_path):
    bad = tmp_path / "requests.pt"
    bad.write_bytes(b"not a torch file")
    out = launch("--variant", "tiny-2.1-t2v", "--plan", "cfgp2", "--requests", str(bad), "--timeout", "20",
                 "--nproc-per-node", "2")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "ChildFailedError" not in out.stderr and "launch: 2 of 2 rank(s) failed" in out.stderr, out.stderr[-3000:]


@pytest.mark.dist
@pytest.mark.slow
def test_under_bare_torchrun_only_rank_0_prints_a_refusal():
    out = launch("--variant", "nope", "--request-json", "{}", torchrun=2)
    assert out.stderr.count("no family has a variant 'nope'") == 1, out.stderr[-3000:]
