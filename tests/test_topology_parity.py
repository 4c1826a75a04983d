"""Parity across topologies: a fleet of role workers equals the co-located engine bitwise (C1: the denoiser's input
and final latents; C4: frames / audio / fps); each planted transfer fault is caught naming the manifest field; a
fleet on other weights fails every comparison (the harness can fail). In-process roles in the default suite;
roles in spawned processes (disagg, replicas) and the other families are slow."""

import pytest

from parity.topology_checks import FAULTS, run_topology_checks


def assert_all_pass(rows):
    assert rows, "no rows"
    bad = [f"{r.case} {r.check}: {r.detail}" for r in rows if not r.ok]
    assert not bad, bad


def test_inprocess_c4_wan_is_bitwise():
    rows = run_topology_checks("wan", "C4", "inprocess", cases=("t2v",))
    assert_all_pass(rows)
    assert any("frames uint8" in r.check and "bitwise equal" in r.detail for r in rows)


def test_other_weights_fail_every_comparison():
    rows = run_topology_checks("wan", "C1", "inprocess", cases=("t2v",), fleet_seed=1)
    latents = [r for r in rows if "final latents" in r.check]
    assert latents and not any(r.ok for r in latents)


@pytest.mark.parametrize("fault", ["drop_last_chunk", pytest.param("cast_in_transit", marks=pytest.mark.slow),
                                   pytest.param("stale_cache", marks=pytest.mark.slow)])
def test_planted_fault_is_caught_naming_the_field(fault):
    rows = run_topology_checks("wan", "C4", "inprocess", fault=fault)
    assert len(rows) == 1 and rows[0].ok, rows
    assert rows[0].detail.startswith(f"caught: {FAULTS[fault]}:")


def test_bad_arguments_are_one_message():
    with pytest.raises(ValueError, match="^family 'ltx2'"):
        run_topology_checks("ltx2", "C4", "disagg")
    with pytest.raises(ValueError, match="^--level C2"):
        run_topology_checks("wan", "C2", "disagg")
    with pytest.raises(ValueError, match="^--topology 'mesh'"):
        run_topology_checks("wan", "C4", "mesh")
    with pytest.raises(ValueError, match="^unknown topology fault"):
        run_topology_checks("wan", "C4", "disagg", fault="bitflip")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan", "cosmos3"])
@pytest.mark.parametrize("level", ["C1", "C4"])
def test_inprocess_every_case(family, level):
    assert_all_pass(run_topology_checks(family, level, "inprocess"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan", "cosmos3"])
@pytest.mark.parametrize("topology", ["disagg", "replicas"])
def test_process_topologies_are_bitwise(family, topology):
    rows = run_topology_checks(family, "C4" if topology == "disagg" else "C1", topology, cases=None)
    assert_all_pass(rows)
    if topology == "replicas":
        assert any(r.check.startswith("replicas:") and r.ok for r in rows)
