"""tools/gpu_check.py's runner, which must fit the device tool (one command <= 10 min, <= 8 files back): steps in
order inside a budget, one log, a summary rewritten after every step. A fake clock and a fake runner: no step runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import gpu_check  # noqa: E402


class FakeRun:
    """Each command "takes" the seconds its name says on a fake clock; 'hang' runs past any timeout."""

    def __init__(self, seconds: dict[str, float], out: Path | None = None):
        self.now, self.seconds, self.timeouts, self.out, self.summaries_seen = 0.0, seconds, {}, out, []

    def clock(self) -> float:
        return self.now

    def __call__(self, cmd, capture_output, text, timeout):
        name = cmd[0]
        self.timeouts[name] = timeout
        if self.out is not None:  # what a run killed right now would bring back
            summary = self.out / "summary.json"
            self.summaries_seen.append(len(json.loads(summary.read_text())) if summary.exists() else 0)
        took = self.seconds[name]
        if took > timeout:
            self.now += timeout
            raise subprocess.TimeoutExpired(cmd, timeout, output=b"partial line\n", stderr=None)
        self.now += took
        return SimpleNamespace(returncode=1 if name == "fails" else 0, stdout=f"{name} done\n", stderr="")


def test_steps_run_in_order_within_the_budget_and_the_summary_survives_each(tmp_path: Path):
    run = FakeRun({"first": 100, "fails": 50, "hang": 10_000, "late": 10}, out=tmp_path)
    steps = [("first", ["first"], 900), ("fails", ["fails"], 900), ("hang", ["hang"], 900), ("late", ["late"], 900)]
    summary = gpu_check.run_steps(steps, tmp_path, budget_s=540, min_step_s=45, clock=run.clock, runner=run)
    assert [r["rc"] for r in summary] == [0, 1, 124, None]      # a failure does not stop the rest
    assert run.timeouts["hang"] == 390                           # cut at what the budget leaves (540 - 150)
    assert "late" not in run.timeouts and "skipped" in summary[3]["last_line"]
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["gpu_check.log", "summary.json"]   # 2 files of 8
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert run.summaries_seen == [0, 1, 2]                       # rewritten after every step, not only at the end
    log = (tmp_path / "gpu_check.log").read_text()
    assert log.index("===== first") < log.index("===== fails") < log.index("===== hang")
    assert "partial line" in log and "timed out after 390 s" in log


def test_without_a_budget_each_step_keeps_its_own_limit(tmp_path: Path):
    run = FakeRun({"a": 1000, "b": 1})
    summary = gpu_check.run_steps([("a", ["a"], 900), ("b", ["b"], 600)], tmp_path, None, 45, run.clock, run)
    assert run.timeouts == {"a": 900, "b": 600} and [r["rc"] for r in summary] == [124, 0]


def test_a_command_that_cannot_start_is_a_failed_step(tmp_path: Path):
    summary = gpu_check.run_steps([("missing", ["/nonexistent/binary"], 10), ("ok", [sys.executable, "-c", "0"], 60)],
                                  tmp_path, None, 45)
    assert [r["rc"] for r in summary] == [127, 0]


def test_the_first_steps_are_what_the_open_issue_needs_from_a_gpu():
    names = [name for name, _, _ in gpu_check.steps("cuda", quick=False)]
    assert names[:5] == ["env", "capture_interleave", "c1_graph_cuda", "capture_tests", "wan_c1_graph_cuda"]
    assert len(names) == len(set(names))
    wheels = gpu_check.steps("cuda", quick=False, wheels=Path("wheels"))[0][1]
    assert wheels[:2] == ["sh", "-c"] and "--no-index --no-deps wheels/*.whl" in wheels[2]
