"""Every registered ParityFamily provides every part it declares, and everything derived from the entries
(`fvparity list`, the golden probe table, the fvconvert post-checks found at run time) agrees with them."""

import ast
import json
import shutil
import sys
from importlib import import_module

import pytest

from parity.errors import SetupError
from parity.families import discover, families, golden_probes, post_checks
from parity.family import Fault, FamilyError, ParityFamily
from tests.conftest import ROOT

EXPECTED = {"cosmos3", "cosmos3-sound", "seedvr2", "wan"}
GOLDEN_CASES = sorted(p.parent for p in (ROOT / "golden").glob("*/*/case.json"))


def _quiet(msg: str) -> None:
    pass


def _run(fam: ParityFamily, level: str, fault: str | None, world_sizes=(1,)):
    kw = {"world_sizes": list(world_sizes)} if fam.supports_world_size else {}
    return fam.levels[level]([fam.default_variants[0]], None, "cpu", ["fp32"], 0, fault, _quiet, **kw)


# ------------------------------------------------------------------------------------------------ the entries

def test_every_family_module_is_discovered_and_valid():
    fams = families()
    assert set(fams) >= EXPECTED
    for name, fam in fams.items():
        assert fam.name == name and fam.validate() is fam
        assert all(callable(run) for run in fam.levels.values())
        assert set(fam.default_variants) <= set(fam.variants())


def test_list_shows_every_declared_level_and_fault(fvparity):
    proc = fvparity("list")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[2:] if line.strip()}
    assert set(rows) == set(families())
    for name, fam in families().items():
        cells = rows[name].split()
        for level in ("C0", "C1", "C2", "C3", "C4"):
            assert (level in cells) == (level in fam.levels), (name, level, rows[name])
            assert (f"{level}(-)" in cells) == (level not in fam.levels), (name, level, rows[name])
        for f in fam.faults:
            assert f.name in rows[name]
    proc = fvparity("list", "--probes")
    assert proc.returncode == 0 and all(p in proc.stdout for p in golden_probes())


def test_golden_probe_names_are_unique_and_cover_the_cases():
    per_family = [p for fam in families().values() for p in fam.golden_probes]
    assert len(per_family) == len(set(per_family)) == len(golden_probes())
    for case in GOLDEN_CASES:
        meta = json.loads((case / "case.json").read_text())
        if meta["probe"].startswith("wan.") and meta["probe"] not in golden_probes():
            continue  # wan DiT / UMT5 / pipeline cases land before their probes (reported as a SetupError below)
        assert meta["probe"] in golden_probes(), case


def test_unknown_golden_probe_is_a_setup_error(tmp_path):
    from parity.golden import run_golden_cases

    case = tmp_path / "case"
    shutil.copytree(ROOT / "golden" / "wan" / "tiny21_decode", case)
    meta = json.loads((case / "case.json").read_text())
    (case / "case.json").write_text(json.dumps({**meta, "probe": "wan.no_such_probe"}))
    with pytest.raises(SetupError, match="unknown probe 'wan.no_such_probe'"):
        run_golden_cases([case], ("reference",), _quiet)


# manifests whose post-check no parity entry declares yet: fvconvert refuses them without --skip-parity (exit 2)
# (the ltx2 media / text components: their C0 rows exist in parity/families/ltx2/media.py, the entry does not name
# them as component post-checks yet; a whole-pipeline conversion reports them "not run")
UNWIRED_POST_CHECKS: set[str] = set()   # a manifest's post-check no entry wires yet (none now)


def test_fvconvert_finds_every_post_check_from_the_entries():
    """converters/ may not import parity/, so fvconvert looks a manifest's post-check up at run time in
    parity.families.<family>.FAMILY: what it finds must be exactly the entries' checks, with no entry point."""
    from converters.families import family_formats, family_names
    from converters.hooks import MissingPostCheck, get_post_check
    from converters.manifest import load_manifest

    checks = post_checks()
    assert {"cosmos3", "cosmos3.sound", "seedvr2", "wan", "wan.transformer", "wan.text_encoder"} <= set(checks)
    for name, fn in checks.items():
        assert get_post_check(name) is fn, name
    named = {load_manifest(f, fmt).post_check_name for f in family_names() for fmt in family_formats(f)}
    assert named - set(checks) == UNWIRED_POST_CHECKS
    for name in UNWIRED_POST_CHECKS:
        with pytest.raises(MissingPostCheck, match=f"no parity post-check {name!r}.*--skip-parity"):
            get_post_check(name)


def test_a_post_check_outside_its_family_module_is_refused(tmp_path):
    """fvconvert finds post-checks as parity.families.<family>: an entry declaring one under another module name
    would never be found, so discovery refuses it."""
    text = GOOD.format(name="a", probe="a.p").replace("golden_probes=", "check_converted=print, golden_probes=")
    pkg = _package(tmp_path, "fams_misnamed", {"b": text})
    with pytest.raises(FamilyError, match="must be named 'a'"):
        discover(pkg)


# ------------------------------------------------------------------------------------------------ validator

def _entry(**over) -> ParityFamily:
    run = lambda *a, **k: None  # noqa: E731
    base = dict(name="toy", description="a toy family", levels={"C0": run}, variants=lambda: ["tiny"],
                default_variants=("tiny",), faults=(Fault("bad", "breaks it", "C0"),))
    return ParityFamily(**{**base, **over})


def test_validator_accepts_a_complete_entry():
    assert _entry().validate().name == "toy"


@pytest.mark.parametrize("over, needle", [
    ({"levels": {}}, "no level"),
    ({"levels": {"C9": lambda *a: None}}, "unknown level 'C9'"),
    ({"levels": {"C0": "not a runner"}}, "not callable"),
    ({"default_variants": ("huge",)}, "not among variants"),
    ({"default_variants": ()}, "no default variant"),
    ({"faults": (Fault("bad", "breaks it", "C1"),)}, "does not implement"),
    ({"faults": (Fault("bad", "", "C0"),)}, "does not say what it breaks"),
    ({"faults": (Fault("bad", "x", "C0"), Fault("bad", "y", "C0"))}, "duplicate fault"),
    ({"golden_probes": {"toy.p": None}}, "golden probe"),
    ({"check_converted": "nope"}, "check_converted"),
    ({"description": ""}, "description"),
])
def test_validator_rejects_a_missing_or_broken_piece(over, needle):
    with pytest.raises(FamilyError, match=needle):
        _entry(**over).validate()


def _package(tmp_path, name: str, modules: dict[str, str]):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for mod, text in modules.items():
        (pkg / f"{mod}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        return import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


GOOD = """
from parity.family import ParityFamily
FAMILY = ParityFamily(name={name!r}, description="d", levels={{"C0": print}}, variants=lambda: ["tiny"],
                      default_variants=("tiny",), golden_probes={{{probe!r}: print}})
"""


def test_discovery_reads_good_modules(tmp_path):
    pkg = _package(tmp_path, "fams_good", {"a": GOOD.format(name="a", probe="a.p"),
                                           "b": GOOD.format(name="b", probe="b.p")})
    assert set(discover(pkg)) == {"a", "b"}


@pytest.mark.parametrize("modules, needle", [
    ({"a": GOOD.format(name="a", probe="a.p"), "helpers": "X = 1\n"}, "exports no FAMILY"),
    ({"a": "FAMILY = {'name': 'a'}\n"}, "not a ParityFamily"),
    ({"a": GOOD.format(name="a", probe="x.p"), "b": GOOD.format(name="b", probe="x.p")}, "claimed by a and b"),
    ({"a": GOOD.format(name="a", probe="a.p"), "b": GOOD.format(name="a", probe="b.p")}, "exported twice"),
    ({"a": GOOD.format(name="a", probe="a.p").replace('("tiny",)', '("huge",)')}, "not among variants"),
])
def test_discovery_rejects_a_bad_family_module(tmp_path, modules, needle):
    pkg = _package(tmp_path, f"fams_bad_{abs(hash(needle))}", modules)
    with pytest.raises(FamilyError, match=needle):
        discover(pkg)


# ------------------------------------------------------------------------------------------------ faults

@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_level_rejects_an_unknown_fault(name):
    """Negative control for the sweep below: a runner that accepted any fault name would prove nothing."""
    fam = families()[name]
    for level in fam.levels:
        with pytest.raises(SetupError, match="no-such-fault"):
            _run(fam, level, "no-such-fault")


def _all_faults():
    return [(n, f.name) for n, fam in sorted(families().items()) for f in fam.faults]


# one cheap fault per family (seconds on CPU); the whole catalogue runs in the slow sweep
FAST = [("cosmos3", "perturbed-weight"), ("cosmos3-sound", "perturbed-weight"), ("wan", "dropped-cache"),
        ("seedvr2", "skipped-transition")]


def _assert_fault_fails(family: str, fault: str, world_sizes=(1,)):
    fam = families()[family]
    f = fam.fault(fault)
    report = _run(fam, f.level, fault, world_sizes)
    failed = [c for c in report.checks if not c.passed]
    assert report.checks and failed, f"{family} {f.level} passed with {fault} planted"
    if f.divergence:
        assert any(f.divergence in (c.divergence or "") for c in failed), \
            (f.divergence, [c.divergence for c in failed][:5])


@pytest.mark.parametrize("family, fault", FAST)
def test_a_declared_fault_fails_its_level(family, fault):
    assert (family, fault) in _all_faults()
    _assert_fault_fails(family, fault)


@pytest.mark.slow
@pytest.mark.parametrize("family, fault", [p for p in _all_faults() if p not in FAST])
def test_every_declared_fault_fails_its_level(family, fault):
    _assert_fault_fails(family, fault, world_sizes=(1, 2))  # some parallel-plan faults show only at sp > 1


# ------------------------------------------------------------------------------------------------ layout

def test_cosmos3_level_modules_import_only_downward():
    """No import cycle inside parity/families/cosmos3/, and no level module reads the package's own names."""
    pkg = ROOT / "parity" / "families" / "cosmos3"
    graph = {}
    for path in pkg.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "parity.families.cosmos3":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parity.families.cosmos3."):
                deps.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = deps
    modules = set(graph) - {"__init__"}
    for mod in modules:
        assert graph[mod] <= modules, f"{mod} imports {graph[mod] - modules} from the package __init__"
    done: set[str] = set()

    def visit(m, stack):
        assert m not in stack, f"import cycle: {' -> '.join(stack + [m])}"
        if m in done:
            return
        for d in graph.get(m, ()):
            visit(d, stack + [m])
        done.add(m)
    for mod in modules:
        visit(mod, [])


def test_parity_modules_stay_readable():
    big = [(str(p.relative_to(ROOT)), n) for p in (ROOT / "parity").rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 600]
    assert big == []
