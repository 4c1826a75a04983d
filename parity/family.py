"""`ParityFamily`: one typed entry per model family, from which the harness derives everything else.

Each module (or package) under parity/families/ exports exactly one `FAMILY = ParityFamily(...)`. The registry
(parity/families/__init__.py) discovers them with pkgutil; `fvparity list`, `fvparity run`, the golden probe
table (parity/golden.py) and the fvconvert post-checks (found at run time as `parity.families.<family>.FAMILY`
by converters/hooks.py, no entry point) are read from these entries, never from a hand-written list. A family with
only components (a transformer port, no loop) declares C0 alone and is as valid as any other.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol

import torch

from parity.errors import SetupError
from parity.report import CheckResult, Report, opened_reports, raised_check

LEVELS = {  # the ladder (../DESIGN.md): level -> what it compares
    "C0": "components: blocks, full forward, VAE / text encoder / audio decoder, packing, position ids, batching",
    "C1": "whole loops: denoise trajectories step by step, batched concurrent requests, CFG policies; AR tokens",
    "C2": "logprob identity: SDE rollout vs trainer recompute per step (exact in batch-invariant fp32), batch / cache / "
          "weight-update cases",
    "C3": "rollout distributions: K seeded rollouts per side, energy + KS tests, perturbed controls and their power",
    "C4": "decoded artifacts: SSIM/PSNR of frames, SNR of audio",
}
# the run precisions every family understands: CLI name -> torch dtype, and the ParityContract's name for it
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16"}


class LevelRunner(Protocol):
    """run(variants, checkpoint, device, dtypes, seed, fault, progress[, world_sizes]) -> Report"""

    def __call__(self, variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
                 fault: str | None, progress: Callable[[str], None], **kw) -> Report: ...


GoldenProbe = Callable[..., list[CheckResult]]     # probe(case: GoldenCase, sides: tuple[str, ...]) -> checks


@dataclass(frozen=True)
class GoldenOutputs:
    """The outputs.safetensors names a golden probe reads: `required` must be present; `optional` may be
    (fnmatch patterns allowed, e.g. "block_*"); `required_with` {input name: outputs} are required whenever that
    input is present. Anything else in a case is undeclared and reported (parity/golden.py)."""
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    required_with: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def golden_probe(required: tuple[str, ...] = (), optional: tuple[str, ...] = (),
                 required_with: Mapping[str, tuple[str, ...]] | None = None) -> Callable[[GoldenProbe], GoldenProbe]:
    """Decorator declaring a probe's outputs (as `probe.golden_outputs`); `fvparity golden` checks cases against it."""
    def mark(fn: GoldenProbe) -> GoldenProbe:
        fn.golden_outputs = GoldenOutputs(tuple(required), tuple(optional), dict(required_with or {}))
        return fn
    return mark
PostCheck = Callable[[Path], dict]                  # check_converted(tmp_out_dir) -> {"status": ..., ...}


class FamilyError(Exception):
    """A family entry that does not provide what it declares (a harness bug: fvparity exits 3)."""


@dataclass(frozen=True)
class Fault:
    """A planted porting bug (negative control): the optimized side broken in one known place."""
    name: str
    breaks: str                     # what it breaks, in one line
    level: str                      # the (cheapest) level whose runner plants it and must FAIL
    divergence: str | None = None   # what the harness should report as the first divergence, where known


@dataclass(frozen=True)
class ParityFamily:
    name: str                                        # `fvparity run NAME`
    description: str
    levels: Mapping[str, LevelRunner]                # implemented levels only; others exit 2 ("not implemented")
    variants: Callable[[], list[str]]                # every variant the family's manifests know
    default_variants: tuple[str, ...]                # what `run` checks without --variant (tiny, CPU seconds)
    faults: tuple[Fault, ...] = ()
    golden_probes: Mapping[str, GoldenProbe] = field(default_factory=dict)   # case.json "probe" -> probe
    check_converted: PostCheck | None = None         # fvconvert's post-conversion check (C0 on converted weights);
                                                     # fvconvert exits 2 for a family without one (--skip-parity)
    supports_world_size: bool = False                # `--world-size` (a sequence-parallel plan) applies
    component_post_checks: Mapping[str, PostCheck] = field(default_factory=dict)  # "<family>.<component>" -> check
    # (level, plan) runs `fvparity mutate` adds to the levels (`run:C1@cfgp2`): the parallel code paths run only
    # under a plan, so a sweep without them can never catch a bug there
    mutate_plans: tuple[tuple[str, str], ...] = ()
    # the variants those plan runs use (empty: the default ones): one variant that holds every plan case keeps a
    # sweep affordable, since every check runs on every mutation
    mutate_plan_variants: tuple[str, ...] = ()

    def run(self, level: str, progress: Callable[[str], None], **kw) -> Report:
        """Run an implemented level. Everything the runner executes is inside its checks: a level's own cases
        turn an exception into that case's failed check and go on (parity/report.py `exceptions_fail`); one that
        still escapes the runner fails a check named after where the level last said it was (its last progress
        line), kept after the checks it made, and ends the level (exit 1, not 3). SetupError (exit 2) passes."""
        last = [f"{self.name} {level}"]

        def tracked(msg: str) -> None:
            last[0] = msg.split("] ", 1)[-1] if msg.startswith("[") else msg  # without the "[family level] " tag
            progress(msg)

        with opened_reports() as opened:
            try:
                return self.levels[level](progress=tracked, **kw)
            except SetupError:
                raise
            except Exception as e:  # noqa: BLE001 - inside the level's checks: that check fails
                report = next((r for r in opened if (r.family, r.level) == (self.name, level)), None)
                report = report or Report(self.name, level, dict(kw))
                report.checks.append(raised_check(last[0], e))
                return report

    def fault(self, name: str) -> Fault | None:
        return next((f for f in self.faults if f.name == name), None)

    @property
    def fault_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.faults)

    def validate(self) -> ParityFamily:
        """Every declared part is present and well-formed; raises FamilyError naming the first problem."""
        where = f"parity family {self.name!r}"
        problems = []
        if not self.name or not isinstance(self.name, str):
            problems.append("name must be a non-empty string")
        if not self.description:
            problems.append("description is empty")
        if not self.levels:
            problems.append("declares no level")
        for level, runner in self.levels.items():
            if level not in LEVELS:
                problems.append(f"unknown level {level!r} (levels are {', '.join(LEVELS)})")
            if not callable(runner):
                problems.append(f"level {level} runner is not callable")
        if not callable(self.variants):
            problems.append("variants is not callable")
        else:
            known = set(self.variants())
            if not self.default_variants:
                problems.append("no default variant")
            missing = [v for v in self.default_variants if v not in known]
            if missing:
                problems.append(f"default variants {missing} are not among variants()")
        names = [f.name for f in self.faults]
        if len(set(names)) != len(names):
            problems.append(f"duplicate fault names in {names}")
        for f in self.faults:
            if not isinstance(f, Fault):
                problems.append(f"fault {f!r} is not a Fault")
            elif f.level not in self.levels:
                problems.append(f"fault {f.name!r} is caught at {f.level}, which the family does not implement")
            elif not f.breaks:
                problems.append(f"fault {f.name!r} does not say what it breaks")
        for probe, fn in self.golden_probes.items():
            if not probe or not callable(fn):
                problems.append(f"golden probe {probe!r} is not a callable with a name")
        if self.check_converted is not None and not callable(self.check_converted):
            problems.append("check_converted is not callable")
        for ep, fn in self.component_post_checks.items():
            if not ep.startswith(f"{self.name}.") or not callable(fn):
                problems.append(f"component post-check {ep!r} must be named '{self.name}.<component>' and callable")
        for level, plan in self.mutate_plans:
            runner = self.levels.get(level)
            if runner is None or "plan" not in inspect.signature(runner).parameters or not plan:
                problems.append(f"mutate plan ({level!r}, {plan!r}): the level must be implemented and take --plan")
        known = set(self.variants()) if self.mutate_plan_variants else set()
        problems += [f"mutate plan variant {v!r} is not a variant of {self.name}"
                     for v in self.mutate_plan_variants if v not in known]
        if problems:
            raise FamilyError(f"{where}: " + "; ".join(problems))
        return self
