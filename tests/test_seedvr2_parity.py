"""seedvr2 parity harness: C0 / C1 / C4 pass at world size 1; every planted fault FAILS and names its layer;
the restoration loop on gloo ranks reproduces world size 1."""

from __future__ import annotations

import pytest

from parity.families import seedvr2 as fam
from parity.families.seedvr2 import cases


def quiet(msg: str) -> None:
    pass


@pytest.fixture
def one_case(monkeypatch):
    monkeypatch.setattr(cases, "CASES", cases.CASES[:1])       # the ragged single-sample case
    monkeypatch.setattr(cases, "GEOMETRY_GRIDS", cases.GEOMETRY_GRIDS[:4])


def test_interface():
    assert set(fam.LEVELS) == {"C0", "C1", "C4"}
    assert "tiny-3b" in fam.variants() and set(fam.DEFAULT_VARIANTS) <= set(fam.variants())
    assert set(fam.FAULTS) == {"cyclic-shift", "token-weighted-text", "plan-cache-ignores-world-size",
                               "skipped-transition"}


@pytest.mark.parametrize("variant", ["tiny-3b", "tiny-7b"])
def test_c0_passes_at_world_size_1(variant):
    report = fam.run_c0([variant], None, "cpu", ["fp32"], 0, None, quiet, world_sizes=[1])
    assert report.passed, report.table()
    assert any(c.name.endswith("batch2/sp=1") for c in report.checks)


@pytest.mark.parametrize("fault", fam.FAULTS)
def test_negative_controls_fail_and_name_the_layer(fault, one_case):
    report = fam.run_c0(["tiny-3b"], None, "cpu", ["fp32"], 0, fault, quiet, world_sizes=[1])
    assert not report.passed
    layer = fam.FAULTS_INFO[fault][1]
    failed = [c for c in report.checks if not c.passed]
    assert failed and all(c.divergence for c in failed)
    assert any(c.divergence.startswith(layer) for c in failed), [c.divergence for c in failed]


@pytest.mark.parametrize("level", ["C1", "C4"])
def test_restoration_levels_pass_at_world_size_1(level):
    report = fam.LEVELS[level](["tiny-3b"], None, "cpu", ["fp32"], 0, None, quiet, world_sizes=[1])
    assert report.passed, report.table()


def test_c1_fault_fails():
    report = fam.run_c1(["tiny-3b"], None, "cpu", ["fp32"], 0, "token-weighted-text", quiet, world_sizes=[1])
    assert not report.passed


@pytest.mark.dist
def test_c1_on_four_ranks_with_an_empty_rank():
    """17x48x64 clip -> 3 windows per layout: rank 3 owns none."""
    report = fam.run_c1(["tiny-3b"], None, "cpu", ["fp32"], 0, None, quiet, world_sizes=[4])
    assert report.passed, report.table()
