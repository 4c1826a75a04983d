"""`fvparity run --accel` end to end: cosmos3 dispatch, the planted fault localised, refusals exit 2."""

from click.testing import CliRunner

from parity.accel_checks import accel_report
from parity.cli import cli


def test_cosmos3_accel_c1_passes_and_a_wrong_branch_residual_is_named():
    clean = accel_report("cosmos3", "fbcache:threshold=0.3", num_steps=5)
    assert clean.passed, clean.table()
    faulted = accel_report("cosmos3", "fbcache:threshold=0.3", num_steps=5, fault="wrong_branch")
    assert not faulted.passed
    first = next(c for c in faulted.checks if not c.passed)
    assert first.name == "accel fbcache step 0" and "branch uncond" in first.divergence


def test_accel_refusals_exit_2_with_one_line():
    runner = CliRunner()
    for argv, needle in ((["run", "wan", "--level", "C0", "--accel", "fbcache"], "--accel runs C1 only"),
                         (["run", "wan", "--level", "C1", "--accel", "fbcache:bogus=1"], "unknown knob 'bogus'"),
                         (["run", "cosmos3", "--level", "C1", "--accel", "sta"], "sta"),
                         (["run", "wan", "--level", "C0", "--topology", "disagg"], "--topology runs C1 or C4")):
        result = runner.invoke(cli, argv)
        assert result.exit_code == 2, (argv, result.output)
        assert needle in result.output and "Traceback" not in result.output
