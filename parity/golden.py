"""Upstream golden cases: convert `upstream/` to the canonical layout, run the case's probe on each side,
compare with the upstream outputs. The format is documented in golden/README.md ("Case format").

Per case, beyond the probe's own rows: a case that cannot be read is that case's FAILED row (`<case>/case`) and
the run goes on; every stored tensor must be read by the probe or declared in case.json `ignore` with a reason
(`<case>/tensors:unchecked`); intermediates (`<output>@<upstream module>`) are compared in upstream forward order
and the first one outside tolerance is named."""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from manifests import ManifestError
from manifests.parity import Tolerance
from parity.errors import SetupError
from parity.metrics import compare, within
from parity.report import CheckResult, Report, exceptions_fail

CASE_FILES = ("case.json", "upstream", "inputs.safetensors", "outputs.safetensors")
CASE_KEYS = ("family", "probe", "upstream", "upstream_format", "dtype", "seed", "tolerance")
SIDES_FOR_UNCHECKED = ("reference", "optimized")  # a one-side run (--side) may leave the other side's tensors unread
INTERMEDIATE_SEP = "@"                            # "<final output>@<upstream module name>"


class TrackedTensors(dict):
    """A case's stored tensors, remembering which ones a probe read (by `[name]` or `.get(name)`): a stored
    tensor nothing reads is a check that cannot fail. Iterating names or `in` reads nothing."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        if name in self:
            self.read.add(name)
        return super().get(name, default)


@dataclass
class GoldenCase:
    path: Path
    meta: dict
    inputs: TrackedTensors
    outputs: TrackedTensors
    ignore: dict[str, str] = field(default_factory=dict)   # stored tensor (fnmatch pattern) -> why nothing reads it

    def __post_init__(self):
        self.inputs, self.outputs = TrackedTensors(self.inputs), TrackedTensors(self.outputs)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def tolerance(self) -> Tolerance:
        try:
            return Tolerance(**self.meta["tolerance"]).validate(f"{self.path}/case.json tolerance")
        except (TypeError, ManifestError) as e:
            raise SetupError(f"{self.path}/case.json: bad tolerance ({e})") from None

    @property
    def params(self) -> dict:
        return self.meta.get("params") or {}

    def ignored(self, tensor: str) -> bool:
        return any(fnmatchcase(tensor, pat) for pat in self.ignore)

    def unread(self) -> list[str]:
        """Stored tensors the probe did not read and the case does not ignore ("inputs:x" / "outputs:y")."""
        return [f"{kind}:{n}" for kind, store in (("inputs", self.inputs), ("outputs", self.outputs))
                for n in sorted(store) if n not in store.read and not self.ignored(n)]


def _validate_format_keys(path: Path, meta: dict, inputs: dict, outputs: dict) -> dict[str, str]:
    """The v2 keys (golden/README.md): `config` an object, `ignore` {stored tensor: non-empty reason},
    `intermediates` a list of stored output names."""
    if "config" in meta and not isinstance(meta["config"], dict):
        raise SetupError(f"golden case {path}: case.json config must be an object (the upstream config)")
    ignore = meta.get("ignore", {})
    if not isinstance(ignore, dict) or not all(isinstance(k, str) and isinstance(v, str) and v.strip()
                                               for k, v in ignore.items()):
        raise SetupError(f"golden case {path}: case.json ignore must map stored tensor names to a non-empty reason")
    stored = set(inputs) | set(outputs)
    stale = [pat for pat in ignore if not any(fnmatchcase(n, pat) for n in stored)]
    if stale:
        raise SetupError(f"golden case {path}: case.json ignore names no stored tensor: {', '.join(stale)}")
    inter = meta.get("intermediates", [])
    if not isinstance(inter, list) or not all(isinstance(n, str) and INTERMEDIATE_SEP in n for n in inter):
        raise SetupError(f"golden case {path}: case.json intermediates must be a list of '<output>@<module>' names")
    missing = [n for n in inter if n not in outputs]
    if missing:
        raise SetupError(f"golden case {path}: intermediates not in outputs.safetensors: {', '.join(missing)}")
    return dict(ignore)


def load_case(path: Path) -> GoldenCase:
    if not path.is_dir():
        raise SetupError(f"golden case {path}: not a directory")
    for f in CASE_FILES:
        if not (path / f).exists():
            raise SetupError(f"golden case {path}: missing {f}")
    try:
        meta = json.loads((path / "case.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SetupError(f"golden case {path}: case.json is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise SetupError(f"golden case {path}: case.json must hold a JSON object")
    missing = [k for k in CASE_KEYS if k not in meta]
    if missing:
        raise SetupError(f"golden case {path}: case.json lacks {missing}")
    tensors = {}
    for f in ("inputs.safetensors", "outputs.safetensors"):
        try:
            tensors[f] = load_file(str(path / f))
        except (SafetensorError, OSError, ValueError) as e:
            raise SetupError(f"golden case {path}: cannot read {f} ({e})") from None
    ignore = _validate_format_keys(path, meta, tensors["inputs.safetensors"], tensors["outputs.safetensors"])
    return GoldenCase(path, meta, tensors["inputs.safetensors"], tensors["outputs.safetensors"], ignore)


# ------------------------------------------------------------------------------------------------
# The case's own architecture
# ------------------------------------------------------------------------------------------------

def case_config(case: GoldenCase, spec: dict | None = None) -> dict | None:
    """The architecture a case carries: `spec["config"]` (one model of several, e.g. seedvr2.nadit's
    params.models.<tag>) or case.json `config`; None when the case carries none (its upstream/ folder's config
    then decides)."""
    cfg = (spec or {}).get("config", None if spec else case.meta.get("config"))
    if cfg is not None and not isinstance(cfg, dict):
        raise SetupError(f"golden case {case.path}: a config must be an object (the upstream config)")
    return cfg


@contextlib.contextmanager
def config_file(config: dict | None) -> Iterator[Path | None]:
    """`config` as a config.json file for the converters' `config=` (None stays None); removed afterwards."""
    if config is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="fvparity-golden-") as d:
        p = Path(d) / "config.json"
        p.write_text(json.dumps(config))
        yield p


def read_diffusers_dir(case: GoldenCase, sub: str = "upstream") -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json + the fp32 state dict of a case's diffusers component folder `sub` (diffusers names are the
    canonical names for the VAEs and the sound tokenizer: identity). case.json `config` (if any) stands in for a
    missing config.json and must equal a present one."""
    d = case.path / sub
    if case.meta.get("upstream_format") != "diffusers":
        raise SetupError(f"golden case {case.path}: upstream_format must be 'diffusers'")
    own = case_config(case) if sub == "upstream" else None
    try:
        config = json.loads((d / "config.json").read_text()) if own is None or (d / "config.json").exists() else own
        state = load_file(str(d / "diffusion_pytorch_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        raise SetupError(f"golden case {case.path}: cannot read {sub}/ ({e})") from None
    if own is not None and own != config:
        raise SetupError(f"golden case {case.path}: case.json config differs from {sub}/config.json")
    return config, {k: v.float() for k, v in state.items()}


def posterior_sample_seed(case: GoldenCase) -> int | None:
    """The seed of an encode case's posterior draw, or None when the case stores no `posterior_sample` (mean and
    std are the encoder's output; the sample is optional). A stored sample without `params.sample_seed` cannot be
    drawn again: a malformed case."""
    seed = case.params.get("sample_seed")
    if "posterior_sample" not in case.outputs:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SetupError(f"golden case {case.path}: posterior_sample is stored but params.sample_seed (an int, the "
                         f"draw's generator seed) is missing")
    return seed


# ------------------------------------------------------------------------------------------------
# Declared outputs, intermediates, unchecked tensors
# ------------------------------------------------------------------------------------------------

def declared_outputs(probe, case: GoldenCase):
    """The probe's GoldenOutputs (parity/family.py) for this case: `probe.golden_outputs_for(case)` when the
    declaration depends on the case (seedvr2.nadit: one set per model in params.models), else
    `probe.golden_outputs`."""
    per_case = getattr(probe, "golden_outputs_for", None)
    return per_case(case) if per_case is not None else getattr(probe, "golden_outputs", None)


def undeclared_outputs(case: GoldenCase, declared) -> list[str]:
    """Stored outputs the probe does not declare (required, required_with or optional) and the case does not
    ignore."""
    allowed = set(declared.required) | set(declared.optional) | {o for outs in declared.required_with.values()
                                                                 for o in outs}
    return sorted(n for n in case.outputs if not any(fnmatchcase(n, pat) for pat in allowed) and not case.ignored(n))


def output_checks(case: GoldenCase, declared) -> list[CheckResult]:
    """Strict outputs: a required output the case lacks, or an output the probe does not declare (so nothing
    would compare it) and the case does not ignore, is a failed check."""
    required = set(declared.required)
    for inp, outs in declared.required_with.items():
        if inp in case.inputs:
            required |= set(outs)
    missing = sorted(n for n in required if n not in case.outputs)
    extra = undeclared_outputs(case, declared)
    checks = []
    if missing:
        checks.append(CheckResult(f"{case.name}/outputs:required", False,
                                  detail=f"missing required output(s) {', '.join(missing)} "
                                         f"(probe {case.meta['probe']})"))
    if extra:
        checks.append(CheckResult(f"{case.name}/outputs:undeclared", False,
                                  detail=f"output(s) {', '.join(extra)} not declared by probe {case.meta['probe']} "
                                         f"(nothing compares them; declare them in case.json ignore with a reason)"))
    return checks


def stored_intermediates(case: GoldenCase, output: str) -> list[str]:
    """The stored intermediates of final output `output`, in upstream forward order (case.json intermediates),
    else in stored order (safetensors sorts names: then the side's trace order decides, see intermediate_checks)."""
    prefix = output + INTERMEDIATE_SEP
    listed = [n for n in case.meta.get("intermediates", []) if n.startswith(prefix)]
    return listed or [n for n in case.outputs if n.startswith(prefix)]


def intermediate_checks(case: GoldenCase, side: str, output: str, traced: dict[str, torch.Tensor],
                        tol: Tolerance) -> list[CheckResult]:
    """One row `<case>/<side>:<output>@intermediates` comparing every stored intermediate of `output` with the
    side's trace of the same upstream module (`traced`: module name -> tensor, in the side's forward order);
    the first outside tolerance (upstream order) is the row's divergence. No stored intermediate: no row."""
    names = stored_intermediates(case, output)
    if not names:
        return []
    modules = [n.split(INTERMEDIATE_SEP, 1)[1] for n in names]
    if "intermediates" not in case.meta:  # no declared order: the side's forward order, untraced ones last
        order = {m: i for i, m in enumerate(traced)}
        modules.sort(key=lambda m: order.get(m, len(order)))
    row = f"{case.name}/{side}:{output}{INTERMEDIATE_SEP}intermediates"
    first, worst, bad, untraced = None, None, 0, []
    for module in modules:
        want = case.outputs[f"{output}{INTERMEDIATE_SEP}{module}"]
        got = traced.get(module)
        if got is None:
            untraced.append(module)
            first = first or (module, None)
            continue
        m = compare(got.float(), want.float())  # shapes must agree: a reshape could hide a layout error
        if not within(m, tol):
            bad += 1
            first = first or (module, m)
        worst = m if worst is None or (m.rel_l2 or 0) > (worst.rel_l2 or 0) else worst
    if first is None:
        return [CheckResult(row, True, worst, tol, detail=f"{len(modules)} intermediates within tolerance "
                                                           f"({modules[0]} .. {modules[-1]})")]
    module, m = first
    what = "not traced by this side" if m is None else f"rel_l2 {m.rel_l2:.2e}"
    detail = (f"first diverging intermediate {module} ({what}); {bad} of {len(modules)} outside tolerance"
              + (f"; untraced: {', '.join(untraced)}" if untraced else ""))
    return [CheckResult(row, False, m, tol, detail=detail, divergence=module)]


def unchecked_check(case: GoldenCase, reported: set[str]) -> CheckResult | None:
    """`reported`: stored tensors ("outputs:x") another row already names (undeclared outputs): named once."""
    unread = [n for n in case.unread() if n not in reported]
    if not unread:
        return None
    return CheckResult(f"{case.name}/tensors:unchecked", False,
                       detail=f"{len(unread)} stored tensor(s) no check of probe {case.meta['probe']} reads: "
                              f"{', '.join(unread[:8])}{' ...' if len(unread) > 8 else ''} (compare them, or declare "
                              f"them in case.json ignore with a reason)")


def run_probe(probe, case: GoldenCase, sides: tuple[str, ...]) -> list[CheckResult]:
    """One case: its output declaration, then the probe, then the unchecked-tensor rule (both sides only). An
    exception of the probe or the engine becomes a failed check naming it; a SetupError (the case's files or
    params are bad) passes through to run_golden_cases, which makes it the case's own failure."""
    declared = declared_outputs(probe, case)
    checks = output_checks(case, declared) if declared is not None else []
    if any(c.name.endswith("outputs:required") for c in checks):
        return checks  # the probe would compare against nothing (or crash on the missing name)
    n_before = len(checks)
    with exceptions_fail(checks, f"{case.name}/probe", who="probe"), torch.no_grad():
        checks += probe(case, sides)
    raised = any(c.name == f"{case.name}/probe" for c in checks[n_before:])
    if not raised and all(s in sides for s in SIDES_FOR_UNCHECKED):
        undeclared = {f"outputs:{n}" for n in undeclared_outputs(case, declared)} if declared is not None else set()
        extra = unchecked_check(case, undeclared)
        checks += [extra] if extra is not None else []
    return checks


def case_dirs(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """(case folders, paths skipped). Several paths (a shell glob such as golden/seedvr2/*) may hold files and
    folders that are not cases (no case.json): they are skipped; one path given alone must be a case, and a path
    that does not exist is never skipped (a typo, not a glob)."""
    if len(paths) == 1:
        return list(paths), []
    skipped = [p for p in paths if p.exists() and not (p / "case.json").is_file()]
    cases = [p for p in paths if p not in skipped]
    if not cases:
        raise SetupError(f"no golden case among {len(paths)} paths (a case folder holds case.json): "
                         f"{', '.join(map(str, paths))}")
    return cases, skipped


def malformed_check(path: Path, e: SetupError) -> CheckResult:
    return CheckResult(f"{path.name}/case", False, detail=f"malformed case: {e}")


def run_golden_cases(paths: list[Path], sides: tuple[str, ...], progress: Callable[[str], None]) -> Report:
    """Every case, each on its own: a case that cannot be read, names an unknown probe or whose probe finds its
    files / params bad is that case's FAILED row and the others run (exit 1). Only when no case at all could be
    read is it a setup error (exit 2), naming each."""
    from parity.families import golden_probes

    probes = golden_probes()  # derived from every family's FAMILY entry
    paths, skipped = case_dirs(paths)
    if skipped:
        progress(f"[golden] skipped {len(skipped)} path(s) that are not case folders (no case.json): "
                 f"{', '.join(map(str, skipped))}")
    report = Report("golden", "upstream", {"cases": [str(p) for p in paths], "sides": list(sides),
                                           **({"skipped": [str(p) for p in skipped]} if skipped else {})})
    cases, errors = [], []
    for p in paths:  # read every case before running any: the malformed ones are named first
        try:
            c = load_case(p)
            if c.meta["probe"] not in probes:
                raise SetupError(f"golden case {c.path}: unknown probe {c.meta['probe']!r}; known: {', '.join(probes)}")
            cases.append(c)
        except SetupError as e:
            errors.append(e)
            report.checks.append(malformed_check(p, e))
            progress(f"[golden] {p.name}: FAILED, malformed case ({e})")
    for c in cases:
        progress(f"[golden] {c.name} ({c.meta['probe']}, {(c.meta['upstream'] or {}).get('package')} "
                 f"{(c.meta['upstream'] or {}).get('version')})")
        try:
            report.checks += run_probe(probes[c.meta["probe"]], c, sides)
        except SetupError as e:
            errors.append(e)
            report.checks.append(malformed_check(c.path, e))
    if len(errors) == len(paths):
        raise SetupError("; ".join(str(e) for e in errors) if len(errors) > 1 else str(errors[0]))
    return report

