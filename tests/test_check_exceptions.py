"""An exception inside a parity check is that check failing (exit 1, the check named with the exception), never a
crash of the run (exit 3); a bug of the harness outside any check still exits 3 (issue 29, item 4).

Each level gets an exception planted in a function it calls inside its checks (a model loader, the engine, a
comparison), chosen so the planted case fails at once and the run stays cheap; the CLI runs in-process."""

import importlib
import sys

import pytest
import torch

from parity import cli
from parity.family import ParityFamily
from parity.report import CheckResult, Report


class PlantedError(RuntimeError):
    pass


def run_fvparity(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["fvparity", *args])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    streams = capsys.readouterr()
    return stop.value.code, streams.out + streams.err


def plant(monkeypatch, target: str) -> str:
    """Replace `module:attr` (or `module:Class.method`) by a function raising PlantedError; returns the message."""
    module, attr = target.split(":")
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    assert callable(getattr(owner, name)), target
    message = f"planted in {attr}"

    def raising(*args, **kwargs):
        raise PlantedError(message)

    monkeypatch.setattr(owner, name, raising)
    return message


WAN = ("--variant", "tiny-2.1-t2v")
# (family, level, extra args, where the exception is planted, the check it must fail (name prefix), and whether
# other checks of the run still pass: the run goes on after the failed check)
PLANTED = [
    ("cosmos3", "C0", ("--variant", "tiny", "--dtype", "fp32"), "parity.families.cosmos3.c0:run_optimized",
     "tiny/fp32", True),
    ("cosmos3", "C1", ("--variant", "tiny"), "parity.families.cosmos3.c1:run_engine_case", "tiny/fp32/", True),
    ("cosmos3", "C2", ("--variant", "tiny"), "parity.rollout_checks:LogprobIdentity.single_cases", "tiny/fp32",
     False),
    ("cosmos3", "C3", ("--variant", "tiny"), "parity.families.cosmos3.c3:engine_sides", "tiny/fp32", False),
    ("cosmos3", "C4", ("--variant", "tiny"), "parity.families.cosmos3.c4:case_request", "tiny/fp32/", False),
    ("cosmos3-sound", "C0", (), "parity.families.cosmos3_sound:check_weight_norm_fold", "tiny/fp32", False),
    ("wan", "C0", WAN + ("--dtype", "fp32"), "parity.families.wan.c0:optimized_step_input",
     "tiny-2.1-t2v/fp32/input", True),
    ("wan", "C1", WAN, "parity.families.wan.c1:engine_for", "tiny-2.1-t2v/fp32/", False),
    ("wan", "C2", WAN, "parity.rollout_checks:LogprobIdentity.single_cases", "tiny-2.1-t2v/fp32", False),
    ("wan", "C3", WAN, "parity.families.wan.c3:engine_sides", "tiny-2.1-t2v/fp32", False),
    ("wan", "C4", WAN, "parity.families.wan.c4:engine_decode", "tiny-2.1-t2v/fp32/", False),
    ("ltx2", "C0", ("--variant", "tiny", "--dtype", "fp32"), "parity.port.kit:PortedSides.forward_all", "tiny/fp32",
     False),   # a family ported with the kit: its C0 is the kit's
    ("ltx2", "C1", ("--variant", "tiny"), "parity.families.ltx2.c1:fast_generate", "tiny/float32/loop", False),
    ("ltx2", "C2", ("--variant", "tiny"), "parity.families.ltx2.rollout:drive", "tiny/float32/", False),
    ("ltx2", "C3", ("--variant", "tiny"), "parity.families.ltx2.c3:CachedSides.sides", "tiny/float32", False),
    ("ltx2", "C4", ("--variant", "tiny"), "parity.families.ltx2.c4:components", "tiny/float32/", False),
    ("seedvr2", "C0", ("--variant", "tiny-3b", "--world-size", "1"), "parity.families.seedvr2.c0:run_reference",
     "tiny-3b/fp32/", True),
    ("seedvr2", "C1", ("--variant", "tiny-3b", "--world-size", "1"), "parity.families.seedvr2.restore:restore_inputs",
     "tiny-3b", False),
    ("seedvr2", "C4", ("--variant", "tiny-3b", "--world-size", "1"), "parity.families.seedvr2.restore:restore_inputs",
     "tiny-3b", False),
]


def test_every_implemented_level_is_planted():
    from parity.families import families

    implemented = {(name, level) for name, fam in families().items() for level in fam.levels}
    assert implemented == {(f, lv) for f, lv, *_ in PLANTED}


@pytest.mark.parametrize("family, level, args, target, check, others_pass", PLANTED,
                         ids=[f"{f}-{lv}" for f, lv, *_ in PLANTED])
def test_exception_in_a_check_fails_that_check(monkeypatch, capsys, family, level, args, target, check,
                                               others_pass):
    torch.manual_seed(0)
    message = plant(monkeypatch, target)
    rc, out = run_fvparity(monkeypatch, capsys, "run", family, "--level", level, *args)
    assert rc == 1, out[-3000:]
    assert "internal error" not in out and "Traceback" not in out
    failed = [line for line in out.splitlines() if f"PlantedError: {message}" in line and " FAIL " in line]
    assert failed, out[-3000:]
    assert any(line.startswith(check) for line in failed), (check, failed)
    if others_pass:  # the run went on: checks outside the planted one ran and passed
        assert any(" PASS " in line for line in out.splitlines()), out[-3000:]


def test_a_level_that_raises_keeps_its_checks_and_names_where_it_was():
    """An exception escaping a level's own cases: the checks made so far stay, and the failed check is named after
    the level's last progress line (the cases it had reached)."""
    def runner(progress, **kw):
        report = Report("toy", "C0", {})
        report.checks.append(CheckResult("case-a/row", True))
        progress("[toy C0] case-b/fp32: the second case")
        raise PlantedError("in case b")

    fam = ParityFamily(name="toy", description="a toy", levels={"C0": runner}, variants=lambda: ["v"],
                       default_variants=("v",))
    seen = []
    report = fam.run("C0", progress=seen.append, variants=[])
    assert seen == ["[toy C0] case-b/fp32: the second case"]
    assert [(c.name, c.passed) for c in report.checks] == [("case-a/row", True),
                                                           ("case-b/fp32: the second case", False)]
    assert report.checks[-1].detail == "raised PlantedError: in case b"


def test_setup_error_inside_a_level_still_exits_2(monkeypatch, capsys):
    from parity.errors import SetupError

    def bad_input(*args, **kwargs):
        raise SetupError("a planted bad input")

    monkeypatch.setattr("parity.families.cosmos3_sound.check_weight_norm_fold", bad_input)
    rc, out = run_fvparity(monkeypatch, capsys, "run", "cosmos3-sound", "--level", "C0")
    assert rc == 2 and "fvparity: error: a planted bad input" in out


def test_harness_bug_outside_any_check_exits_3(monkeypatch, capsys):
    plant(monkeypatch, "parity.report:Report.table")
    rc, out = run_fvparity(monkeypatch, capsys, "run", "cosmos3-sound", "--level", "C0", "--dtype", "fp32")
    assert rc == 3 and "fvparity: internal error: PlantedError: planted in Report.table" in out


def test_unpadded_text_embeddings_are_named_not_an_index_error():
    """Prompt embeddings trimmed to the longest prompt instead of zero-padded to max_sequence_length: the padding
    localisation names it (it used to index a [B, L] mask into [B, n, D] embeddings: IndexError, exit 3)."""
    from manifests.parity import Tolerance
    from parity.families.wan.umt5 import PADDING, padding_divergence

    want = torch.zeros(1, 16, 8)
    want[:, :7] = torch.randn(1, 7, 8)
    mask = (torch.arange(16) < 7).long()[None]
    where = padding_divergence(want[:, :7].clone(), want, mask, Tolerance(rel_l2=1e-5))
    assert where.startswith(PADDING) and "[1, 7, 8]" in where and "16 rows" in where
