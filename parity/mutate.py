"""`fvparity mutate FAMILY`: the harness measures its own power.

A catalogue of realistic porting bugs, kept as data (parity/mutations/<family>.json), each an exact source edit
(file, `find` text occurring exactly once, `replace` text) on the reference side, the optimized side, both, the
shared manifests or a converter manifest. The runner snapshots the repository's package folders, golden/ and
pyproject.toml into a scratch directory (the working tree is never touched), then, one mutation at a time in a
private copy per worker, runs the family's checks in a subprocess against that copy (PYTHONPATH = the copy):
every implemented `fvparity run` level on the default variants (the CLI's default dtypes: fp32 and bf16 for C0,
fp32 otherwise) and `fvparity golden` on the family's golden cases. Unit tests are NOT run.

Outcome of a mutation:
  caught    a check failed (exit 1): the first failing check is reported
  crashed   no check failed, but one exited 2 / 3 / timed out / died: counted as caught, reported separately
  survived  every check passed (exit 0)
  invalid   the edit did not apply (`find` not exactly once) or the mutated tree does not import: not counted
  control   an entry marked `"control": true` (a deliberately harmless edit): it must survive; a control that is
            caught is a false alarm of the harness and is reported, never counted in the score
Mutation score = (caught + crashed) / (caught + crashed + survived). (The import check runs only after a crash, so
a mutation is never charged for an import probe it does not need.)

Before the mutations, the clean snapshot is checked once (the baseline); a check that fails on the clean tree
cannot measure anything and is left out (reported). Checks then run cheapest first (baseline seconds), every
check on every mutation, so that the redundancy report can say what caught each one: every failing check inside
each level (names from --json), how many levels / golden cases, and which mutations hang on one check only (a
catch that one edited check would lose). `--stop-at-first` stops each mutation at its first failing check
(faster; the redundancy counts then cover only the checks that ran, and the report says so).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from parity.errors import SetupError

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE_DIR = Path(__file__).resolve().parent / "mutations"
PACKAGES = ("manifests", "reference", "optimized", "converters", "parity")   # what the checks import
COPIED = PACKAGES + ("golden", "examples", "pyproject.toml")   # examples: the C4 workflow rows read them
SIDES = ("reference", "optimized", "both", "manifests", "converters")
CATEGORIES = ("model math", "packing", "solvers", "noise order", "CFG", "caches", "AR sampling",
              "scheduler batching", "VAE", "SP layout", "converters", "control")
DEFAULT_TIMEOUT_S = 1800


# ------------------------------------------------------------------------------------------------
# The catalogue (data)
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Edit:
    file: str          # repository-relative path
    find: str          # must occur exactly once in the file
    replace: str


@dataclass(frozen=True)
class Mutation:
    name: str
    family: str
    side: str          # reference | optimized | both | manifests | converters
    category: str
    why: str           # one line: why a porter could make this mistake
    edits: tuple[Edit, ...]
    control: bool = False   # a deliberately harmless edit: must survive (a false-alarm detector)


def catalogue_path(family: str) -> Path:
    return CATALOGUE_DIR / f"{family}.json"


def catalogue_families() -> list[str]:
    return sorted(p.stem for p in CATALOGUE_DIR.glob("*.json"))


def _parse(entry: dict, family: str, where: str) -> Mutation:
    keys = {"name", "side", "category", "why", "edits", "control", "file", "find", "replace"}
    unknown = set(entry) - keys
    if unknown:
        raise SetupError(f"{where}: unknown keys {sorted(unknown)}")
    if "edits" in entry:
        if any(k in entry for k in ("file", "find", "replace")):
            raise SetupError(f"{where}: give either `edits` or file/find/replace, not both")
        raw = entry["edits"]
    else:
        raw = [{k: entry.get(k) for k in ("file", "find", "replace")}]
    if not isinstance(raw, list) or not raw:
        raise SetupError(f"{where}: `edits` must be a non-empty list")
    edits = []
    for i, e in enumerate(raw):
        if not isinstance(e, dict) or set(e) != {"file", "find", "replace"} or \
                not all(isinstance(e[k], str) for k in ("file", "find", "replace")):
            raise SetupError(f"{where}: edit {i} must be {{file, find, replace}} strings")
        edits.append(Edit(e["file"], e["find"], e["replace"]))
    for k in ("name", "side", "category", "why"):
        if not isinstance(entry.get(k), str) or not entry[k].strip():
            raise SetupError(f"{where}: `{k}` must be a non-empty string")
    return Mutation(name=entry["name"], family=family, side=entry["side"], category=entry["category"],
                    why=entry["why"], edits=tuple(edits), control=bool(entry.get("control", False)))


def load_catalogue(family: str) -> list[Mutation]:
    """The family's mutations, parsed (shape only; `validate_catalogue` checks them against a tree)."""
    path = catalogue_path(family)
    if not path.is_file():
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        raise SetupError(f"no mutation catalogue for {family!r} (expected {shown}; "
                         f"catalogues: {', '.join(catalogue_families()) or 'none'})")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SetupError(f"{path.name}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("family") != family or not isinstance(doc.get("mutations"), list):
        raise SetupError(f"{path.name}: expected {{\"family\": {family!r}, \"mutations\": [...]}}")
    return [_parse(e, family, f"{path.name} mutation {i} ({e.get('name') if isinstance(e, dict) else e!r})")
            for i, e in enumerate(doc["mutations"])]


def apply_edits(text_of: Callable[[str], str | None], m: Mutation) -> tuple[dict[str, str], str | None]:
    """({file: mutated text}, None) or ({}, why it does not apply). Edits of one file apply in order."""
    out: dict[str, str] = {}
    for e in m.edits:
        text = out.get(e.file)
        if text is None:
            text = text_of(e.file)
        if text is None:
            return {}, f"{e.file}: no such file"
        n = text.count(e.find)
        if n != 1:
            return {}, f"{e.file}: `find` occurs {n} times (must be exactly once): {e.find[:60]!r}"
        if e.find == e.replace:
            return {}, f"{e.file}: replace equals find (not a mutation)"
        out[e.file] = text.replace(e.find, e.replace)
    return out, None


def validate_catalogue(mutations: list[Mutation], root: Path = ROOT) -> list[str]:
    """Every problem of a catalogue against the tree at `root` (empty = valid): names unique, side and category
    known, every edit applies exactly once to a file inside the copied folders, no two mutations identical."""
    problems, names, seen = [], set(), set()

    def text_of(rel: str) -> str | None:
        p = root / rel
        return p.read_text() if p.is_file() else None

    for m in mutations:
        tag = f"{m.family}/{m.name}"
        if m.name in names:
            problems.append(f"{tag}: duplicate name")
        names.add(m.name)
        if m.side not in SIDES:
            problems.append(f"{tag}: side {m.side!r} not in {SIDES}")
        if m.category not in CATEGORIES:
            problems.append(f"{tag}: category {m.category!r} not in {CATEGORIES}")
        if m.control != (m.category == "control"):
            problems.append(f"{tag}: `control: true` and category 'control' go together")
        for e in m.edits:
            if e.file.split("/")[0] not in COPIED or ".." in Path(e.file).parts:
                problems.append(f"{tag}: {e.file} is outside the copied folders {COPIED}")
        key = tuple((e.file, e.find, e.replace) for e in m.edits)
        if key in seen:
            problems.append(f"{tag}: the same edits as another mutation")
        seen.add(key)
        _, why = apply_edits(text_of, m)
        if why:
            problems.append(f"{tag}: {why}")
    return problems


# ------------------------------------------------------------------------------------------------
# The family's checks
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    name: str                 # "run:C0" or "golden"
    argv: tuple[str, ...]     # after `python -m parity.cli`


def family_checks(family: str, root: Path = ROOT) -> list[Check]:
    """Every implemented `fvparity run` level (default variants and dtypes), the parallel plans the family asks
    the sweep to run (`run:C1@cfgp2`: its `mutate_plans`), and `fvparity golden` over the family's golden cases (a
    case belongs to the family whose entry owns its probe)."""
    from parity.families import get_family
    from parity.family import LEVELS

    fam = get_family(family)
    checks = [Check(f"run:{lv}", ("run", family, "--level", lv)) for lv in LEVELS if lv in fam.levels]
    on_variants = tuple(a for v in fam.mutate_plan_variants for a in ("--variant", v))
    checks += [Check(f"run:{lv}@{plan}", ("run", family, "--level", lv, "--plan", plan, *on_variants))
               for lv, plan in fam.mutate_plans]
    cases = []
    for case_json in sorted((root / "golden").glob("**/case.json")):
        try:
            probe = json.loads(case_json.read_text()).get("probe")
        except (OSError, json.JSONDecodeError):
            continue
        if probe in fam.golden_probes:
            cases.append(str(case_json.parent.relative_to(root)))
    if cases:
        checks.append(Check("golden", ("golden", *cases)))
    return checks


@dataclass
class CheckRun:
    check: str
    rc: int | None            # None: timed out
    seconds: float
    failed: list[str] = field(default_factory=list)   # names of the failing checks inside (from --json)
    tail: str = ""                                     # last lines of output when it did not pass

    @property
    def status(self) -> str:
        if self.rc == 0:
            return "pass"
        if self.rc == 1:
            return "fail"
        return "timeout" if self.rc is None else f"exit {self.rc}"


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)            # the scratch copy first, before the editable install
    env["PYTHONDONTWRITEBYTECODE"] = "1"     # never a stale .pyc of a mutated file in the shared copies
    env.pop("FVPARITY_DEBUG", None)
    env.setdefault("OMP_NUM_THREADS", "1")   # parallel mutations, not parallel BLAS
    return env


def run_check(tree: Path, check: Check, timeout: float) -> CheckRun:
    with tempfile.TemporaryDirectory(prefix="fvmutate-json-") as tmp:
        report = Path(tmp) / "report.json"
        argv = [sys.executable, "-m", "parity.cli", *check.argv, "--json", str(report)]
        start = time.monotonic()
        try:
            p = subprocess.run(argv, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc = None
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        run = CheckRun(check.name, rc, time.monotonic() - start)
        if rc != 0:
            run.tail = "\n".join(out.strip().splitlines()[-6:])
            try:
                doc = json.loads(report.read_text())
                run.failed = [c["name"] for c in doc.get("checks", []) if not c.get("passed")]
            except (OSError, json.JSONDecodeError, AttributeError, TypeError):
                pass
    return run


IMPORT_PROBE = ("import sys, parity\n"
                "from pathlib import Path\n"
                "assert Path(parity.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), parity.__file__\n"
                "from parity.families import families\n"
                "families()\n"
                "import converters.cli\n")


def import_problem(tree: Path) -> str | None:
    """None when the tree imports (every family entry, the converters); else the last error line."""
    p = subprocess.run([sys.executable, "-c", IMPORT_PROBE, str(tree)], cwd=tree, env=_env(tree),
                       capture_output=True, text=True, timeout=600)
    if p.returncode == 0:
        return None
    lines = (p.stderr or p.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {p.returncode}"


# ------------------------------------------------------------------------------------------------
# Running mutations
# ------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    name: str
    side: str
    category: str
    why: str
    status: str                          # caught | crashed | survived | invalid | control-ok | false-alarm
    first_failure: str = ""              # "run:C1 cosmos3/...:vision" / "golden gen_t2v/optimized:vision"
    detail: str = ""
    seconds: float = 0.0
    checks: list[dict] = field(default_factory=list)

    @property
    def counted(self) -> bool:
        return self.status in ("caught", "crashed", "survived")

    @property
    def caught_by(self) -> Redundancy:
        return redundancy(self.checks)


@dataclass(frozen=True)
class Redundancy:
    """What caught one mutation: every failing check (qualified by the level that ran it), the levels that failed
    and the golden cases among them. A level that crashed without a report counts as one check, named by status."""
    checks: tuple[str, ...]        # "run:C1 tiny/fp32/t2v/step3", "golden gen_t2v/optimized:vision", "run:C2 (exit 3)"
    levels: tuple[str, ...]        # "run:C1", "golden", "run:C1@cfgp2"
    golden_cases: tuple[str, ...]  # the case folders whose checks failed

    def to_dict(self) -> dict:
        return {"n_checks": len(self.checks), "n_levels": len(self.levels), "n_golden_cases": len(self.golden_cases),
                "levels": list(self.levels), "golden_cases": list(self.golden_cases), "checks": list(self.checks)}


def redundancy(check_runs: list[dict]) -> Redundancy:
    """From a mutation's CheckRun records (asdict + status): who failed."""
    checks, levels, cases = [], [], []
    for run in check_runs:
        if run["rc"] == 0:
            continue
        levels.append(run["check"])
        inner = run.get("failed") or [f"({run['status']})"]
        checks += [f"{run['check']} {name}" for name in inner]
        if run["check"].startswith("golden"):
            cases += [name.split("/")[0] for name in run.get("failed") or []]
    return Redundancy(tuple(checks), tuple(levels), tuple(dict.fromkeys(cases)))


def snapshot(dest: Path, root: Path = ROOT) -> Path:
    """Copy what the checks need (package folders, golden/, pyproject.toml) into `dest`; never the .venv or .git."""
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore, symlinks=True)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    return dest


def run_mutation(tree: Path, m: Mutation, checks: list[Check], timeout: float, stop_at_first: bool = False
                 ) -> Outcome:
    """Apply `m` to `tree` (a private copy), run every check (or until one fails: `stop_at_first`), restore the
    tree."""
    base = Outcome(m.name, m.side, m.category, m.why, status="invalid")
    start = time.monotonic()

    def text_of(rel: str) -> str | None:
        p = tree / rel
        return p.read_text() if p.is_file() else None

    mutated, why = apply_edits(text_of, m)
    if why:
        base.detail = f"does not apply: {why}"
        return base
    originals = {rel: (tree / rel).read_text() for rel in mutated}
    try:
        for rel, text in mutated.items():
            (tree / rel).write_text(text)
        status, import_checked = "survived", False
        for check in checks:
            run = run_check(tree, check, timeout)
            base.checks.append(asdict(run) | {"status": run.status})
            if run.rc == 0:
                continue
            if run.rc != 1 and not import_checked:  # a crash: a mutation that breaks import is invalid, not caught
                problem, import_checked = import_problem(tree), True
                if problem:
                    base.detail = f"breaks import: {problem}"
                    return base
            if status != "caught":  # a parity failure (exit 1) anywhere makes it caught, else crashed
                status = "caught" if run.rc == 1 else "crashed"
                base.first_failure = f"{check.name} {run.failed[0]}" if run.failed else \
                    f"{check.name} ({run.status})"
                base.detail = run.tail.splitlines()[-1] if status == "crashed" and run.tail else ""
            if stop_at_first:
                break
        if m.control:
            status = "control-ok" if status == "survived" else "false-alarm"
        base.status = status
        return base
    finally:
        for rel, text in originals.items():
            (tree / rel).write_text(text)
        base.seconds = time.monotonic() - start


@dataclass
class MutationRun:
    family: str
    outcomes: list[Outcome]
    baseline: list[dict]
    dropped_checks: list[str]
    checks: list[str]
    redundancy_complete: bool = True     # every check ran on every mutation (not --stop-at-first)

    def count(self, *statuses: str) -> int:
        return sum(o.status in statuses for o in self.outcomes)

    @property
    def valid(self) -> int:
        return self.count("caught", "crashed", "survived")

    @property
    def score(self) -> float | None:
        return None if not self.valid else self.count("caught", "crashed") / self.valid

    def summary(self) -> str:
        s = "n/a (no valid mutation)" if self.score is None else f"{100 * self.score:.1f}%"
        return (f"{self.family} mutation score: {s} = {self.count('caught', 'crashed')} caught / {self.valid} valid "
                f"(caught {self.count('caught')}, crashed {self.count('crashed')}, survived {self.count('survived')}; "
                f"invalid {self.count('invalid')}; controls ok {self.count('control-ok')}, "
                f"false alarms {self.count('false-alarm')})")

    def table(self) -> str:
        from tabulate import tabulate

        rows = []
        for o in self.outcomes:
            by = o.caught_by
            rows.append([o.name, o.side, o.category, o.status, f"{len(by.checks)} / {len(by.levels)}" if by.levels
                         else "-", o.first_failure or o.detail, f"{o.seconds:.0f}s"])
        return tabulate(rows, headers=["mutation", "side", "category", "result", "caught by checks / levels",
                                       "first failing check / detail", "time"], tablefmt="simple")

    def caught(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status in ("caught", "crashed")]

    def redundancy(self) -> dict:
        """Per caught mutation, how many checks and levels caught it; the ones that hang on one check or level."""
        by = {o.name: o.caught_by for o in self.caught()}
        return {"complete": self.redundancy_complete,
                "caught_by_one_check": sorted(n for n, r in by.items() if len(r.checks) == 1),
                "caught_by_one_level": sorted(n for n, r in by.items() if len(r.levels) == 1),
                "per_mutation": {n: r.to_dict() for n, r in by.items()}}

    def redundancy_summary(self) -> str:
        red = self.redundancy()
        by = {o.name: o.caught_by for o in self.caught()}
        if not by:
            return "redundancy: no caught mutation"
        counts = sorted(len(r.checks) for r in by.values())
        lines = [f"redundancy: {len(by)} caught mutation(s), failing checks per mutation min {counts[0]}, median "
                 f"{counts[len(counts) // 2]}, max {counts[-1]}"
                 + ("" if red["complete"] else " (--stop-at-first: only the checks that ran)")]
        one_check = red["caught_by_one_check"]
        lines.append(f"  caught by one check only ({len(one_check)}): "
                     + (", ".join(f"{n} ({by[n].checks[0]})" for n in one_check) or "none"))
        one_level = [n for n in red["caught_by_one_level"] if n not in one_check]
        lines.append(f"  caught by several checks of one level only ({len(one_level)}): "
                     + (", ".join(f"{n} ({by[n].levels[0]}: {len(by[n].checks)})" for n in one_level) or "none"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"family": self.family, "score": self.score, "caught": self.count("caught"),
                "crashed": self.count("crashed"), "survived": self.count("survived"),
                "invalid": self.count("invalid"), "controls_ok": self.count("control-ok"),
                "false_alarms": self.count("false-alarm"), "valid": self.valid, "checks": self.checks,
                "dropped_checks": self.dropped_checks, "baseline": self.baseline,
                "redundancy": self.redundancy(),
                "mutations": [asdict(o) | ({"caught_by": o.caught_by.to_dict()} if o.status in ("caught", "crashed")
                                           else {}) for o in self.outcomes]}


def select(mutations: list[Mutation], only: tuple[str, ...] = (), categories: tuple[str, ...] = ()) -> list[Mutation]:
    known = {m.name for m in mutations}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise SetupError(f"--only {', '.join(unknown)}: no such mutation (see `fvparity mutate FAMILY --list`)")
    bad = [c for c in categories if c not in CATEGORIES]
    if bad:
        raise SetupError(f"--category {', '.join(bad)}: categories are {', '.join(CATEGORIES)}")
    out = [m for m in mutations if (not only or m.name in only) and (not categories or m.category in categories)]
    if not out:
        raise SetupError("no mutation selected")
    return out


def run_mutations(family: str, mutations: list[Mutation], *, jobs: int = 1, timeout: float = DEFAULT_TIMEOUT_S,
                  check_names: tuple[str, ...] = (), baseline: bool = True, stop_at_first: bool = False,
                  root: Path = ROOT, scratch: Path | None = None,
                  progress: Callable[[str], None] = lambda s: None) -> MutationRun:
    """Snapshot `root`, check the clean snapshot (baseline), then each mutation in its own worker copy (every
    check, or up to its first failing one: `stop_at_first`)."""
    checks = family_checks(family, root)
    if check_names:
        unknown = [c for c in check_names if c not in {k.name for k in checks}]
        if unknown:
            raise SetupError(f"--check {', '.join(unknown)}: {family} has {', '.join(k.name for k in checks)}")
        checks = [k for k in checks if k.name in check_names]
    own_scratch = scratch is None
    scratch = Path(tempfile.mkdtemp(prefix=f"fvmutate-{family}-")) if own_scratch else scratch
    try:
        base = snapshot(scratch / "base", root)
        progress(f"[mutate {family}] snapshot of {root} in {base}; checks: {', '.join(k.name for k in checks)}")
        problem = import_problem(base)
        if problem:
            raise SetupError(f"the clean tree does not import: {problem}")
        jobs = max(1, min(jobs, len(mutations)))
        baseline_runs: list[dict] = []
        dropped: list[str] = []
        if baseline:
            progress(f"[mutate {family}] baseline: the clean tree, {len(checks)} check(s)")
            with ThreadPoolExecutor(max(1, min(jobs, len(checks)))) as pool:
                runs = list(pool.map(lambda k: run_check(base, k, timeout), checks))
            for k, r in zip(checks, runs):
                baseline_runs.append(asdict(r) | {"status": r.status})
                progress(f"[mutate {family}] baseline {k.name}: {r.status} ({r.seconds:.0f}s)")
                if r.rc != 0:
                    dropped.append(k.name)
            by_time = {k.name: r.seconds for k, r in zip(checks, runs)}
            checks = sorted((k for k in checks if k.name not in dropped), key=lambda k: by_time[k.name])
            if not checks:
                raise SetupError(f"every {family} check fails on the clean tree; nothing can measure a mutation")
        workers: queue.Queue[Path] = queue.Queue()
        for w in range(jobs):
            tree = scratch / f"worker{w}"
            shutil.copytree(base, tree, symlinks=True)
            workers.put(tree)
        done, lock = [0], threading.Lock()

        def one(m: Mutation) -> Outcome:
            tree = workers.get()
            try:
                o = run_mutation(tree, m, checks, timeout, stop_at_first)
            finally:
                workers.put(tree)
            with lock:
                done[0] += 1
                n_by = len(o.caught_by.checks)
                progress(f"[mutate {family}] {done[0]}/{len(mutations)} {m.name}: {o.status}"
                         f"{' by ' + o.first_failure if o.first_failure else ''}"
                         f"{f' (+{n_by - 1} more)' if n_by > 1 else ''}"
                         f"{' (' + o.detail + ')' if o.detail and not o.first_failure else ''} [{o.seconds:.0f}s]")
            return o

        with ThreadPoolExecutor(jobs) as pool:
            outcomes = list(pool.map(one, mutations))
        return MutationRun(family, outcomes, baseline_runs, dropped, [k.name for k in checks], not stop_at_first)
    finally:
        if own_scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def write_json(run: MutationRun, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(run.to_dict(), indent=2))
    os.replace(tmp, path)
