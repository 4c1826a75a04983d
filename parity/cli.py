"""`fvparity`: run the parity ladder for a model family, list what exists, check upstream goldens.

Exit codes (one convention for every CLI of the kit): 0 every check passed; 1 a parity check failed (an engine
or probe exception is a failed check of that case, the run goes on); 2 usage, setup or bad input (an unknown
--device, an unwritable --json, a level not implemented for the family: never a silent pass), found before the
run; 3 an internal error of the harness itself.
"""

from __future__ import annotations

import sys
import inspect
from pathlib import Path

import click

from parity.errors import SetupError
from parity.families import families, get_family
from parity.family import LEVELS
from parity.report import Report


def _fail_setup(msg: str) -> None:
    click.echo(f"fvparity: error: {msg}", err=True)
    sys.exit(2)


EXIT_CODES = ("\b\nExit codes: 0 every check passed; 1 a parity check failed; 2 usage, setup or bad input (checked "
              "before the run); 3 internal error of the harness (FVPARITY_DEBUG=1 for the traceback).")


def check_json_path(json_path: str | None) -> None:
    """--json must be writable before minutes of checks run: create (or open) it now, remove it if it was new."""
    if not json_path:
        return
    p = Path(json_path)
    existed = p.exists()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)  # as Report.write_json will
        with open(p, "a"):
            pass
    except OSError as e:
        raise SetupError(f"--json {json_path}: cannot write there ({e.strerror or e})") from None
    if not existed:
        p.unlink(missing_ok=True)


def check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise SetupError(f"--device {device!r} is not a torch device ({' '.join(str(e).split())[:120]})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SetupError(f"--device {device!r}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SetupError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")


def _emit(report: Report, json_path: str | None) -> None:
    click.echo(report.table())
    click.echo(report.summary())
    if json_path:
        report.write_json(json_path)
        click.echo(f"wrote {json_path}")
    sys.exit(0 if report.passed else 1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Diff the readable reference against the optimized v2 runtime (and both against upstream goldens).

    \b
    fvparity list                              families, variants, implemented levels, planted faults
    fvparity run cosmos3 --level C0            built-in tiny variants, seeded random weights, CPU
    fvparity run cosmos3 --level C0 --checkpoint OUT   weights converted with fvconvert
    fvparity golden golden/cosmos3/*           compare both sides with upstream-produced cases

    \b
    Exit codes (every fvparity / fvconvert command): 0 ok; 1 a parity check failed;
    2 usage, setup or bad input (found before the run); 3 internal error of the harness.
    """


@cli.command("list")
@click.option("--probes", is_flag=True, help="List the upstream golden probes instead (probe, family).")
def list_cmd(probes: bool) -> None:
    """Show families, their variants, which parity levels are implemented and the planted faults."""
    from tabulate import tabulate

    if probes:
        rows = [[p, name] for name, fam in families().items() for p in fam.golden_probes]
        click.echo(tabulate(rows, headers=["golden probe (case.json)", "family"]))
        return
    rows = []
    for name, fam in families().items():
        levels = " ".join(f"{lv}{'' if lv in fam.levels else '(-)'}" for lv in LEVELS)
        rows.append([name, ", ".join(fam.variants()), ", ".join(fam.default_variants), levels,
                     ", ".join(f.name for f in fam.faults)])
    click.echo(tabulate(rows, headers=["family", "variants", "default (run)", "levels ((-) = not yet)",
                                       "planted faults (--plant-fault)"]))


def qualified_variants(fam, variants) -> list[str]:
    """--variant takes a family's own names, bare or qualified ('wan:tiny-2.1-t2v'); another family's is refused."""
    from manifests.layouts import LayoutError, bare_variant
    try:
        return [bare_variant(fam.name, v) for v in variants]
    except LayoutError as e:
        raise SetupError(f"--variant: {e}") from None


@cli.command("run")
@click.argument("family")
@click.option("--level", required=True, type=click.Choice(list(LEVELS)),
              help="Parity level to run: " + "; ".join(f"{k} {v}" for k, v in LEVELS.items()))
@click.option("--variant", "variants", multiple=True,
              help="Variant(s) to check (repeatable). Default: the family's tiny variants. Released sizes "
                   "(e.g. nano) are only sensible on a GPU.")
@click.option("--checkpoint", type=click.Path(file_okay=False), default=None,
              help="A canonical checkpoint directory written by fvconvert, used instead of random weights.")
@click.option("--device", default="cpu", show_default=True, help="torch device, e.g. cpu or cuda.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "all"]), default=None,
              help="Precision(s) to check; each uses the ParityContract tolerance for that dtype. "
                   "Default: all for C0, fp32 for C1 (bf16 trajectories compound rounding; ask for them).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for random weights and inputs.")
@click.option("--plant-fault", "fault", default=None,
              help="Negative control: plant a named fault (on the optimized side, the reference side or in shared "
                   "manifest logic); the run must FAIL and name the divergent layer / step. See `fvparity list`.")
@click.option("--world-size", "world_sizes", type=click.IntRange(1, 64), multiple=True,
              help="Sequence-parallel world size(s) to check against world size 1 (repeatable; families with a "
                   "parallel plan only, e.g. seedvr2; CPU ranks use gloo).")
@click.option("--cases", type=click.Choice(["ci", "full"]), default="ci", show_default=True,
              help="Case matrix of families that generate their cases by rule (cosmos3, wan C0/C1): ci = every rule "
                   "once (the CI main job); full = every draw, batch position and config permutation.")
@click.option("--graph", type=click.Choice(["eager", "compile", "cuda"]), default="eager", show_default=True,
              help="How the optimized step bodies run: eager, torch.compile per shape bucket, or captured CUDA "
                   "graphs (levels that take it only, e.g. cosmos3 / wan C1; cosmos3 C1 runs its AR decode steps "
                   "the same way). Under --plan: eager or compile (collectives run eagerly between compiled "
                   "regions); cuda needs CUDA ranks and is refused.")
@click.option("--plan", default=None,
              help="A parallel plan, e.g. ulysses2, ring2, cfgp2 or cfgp2,ulysses2: its ranks are spawned on CPU "
                   "(gloo) and every rank is compared with the reference (levels that take it only, e.g. wan C1); "
                   "a plan the model cannot run is refused (exit 2).")
@click.option("--accel", default=None, metavar="NAME[:knob=value,...]",
              help="C1 under an acceleration (wan): the engine and the reference loop run the same request under it; "
                   "decisions (step, CFG branch, block range) then latents are compared step by step. With "
                   "--plant-fault never_refresh | wrong_branch the engine's residual store is faulted.")
@click.option("--topology", type=click.Choice(["disagg", "replicas", "inprocess"]), default=None,
              help="C1 / C4 of a fleet of role workers (encoder, denoiser, decoder; replicas: two denoisers) against "
                   "the co-located engine, bitwise on CPU fp32. With --plant-fault drop_last_chunk | "
                   "cast_in_transit | stale_cache a transfer fault is planted and must be caught naming the "
                   "manifest field.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the full report (every metric) as JSON to this path.")
def run_cmd(family, level, variants, checkpoint, device, dtype, seed, fault, world_sizes, cases, graph, plan,
            accel, topology, json_path) -> None:
    """Run parity level LEVEL for FAMILY and print a table of checks.

    Exit code 0 when every check passes, 1 when any fails, 2 on a usage/setup error (unknown --device,
    unwritable --json: before the run) or when the level is not implemented for the family, 3 internal error.
    """
    try:
        check_device(device)
        check_json_path(json_path)
        fam = get_family(family)
        variants = qualified_variants(fam, variants)
        if accel is not None:
            if level != "C1":
                raise SetupError(f"--accel runs C1 only (got --level {level}); `fvparity certify` measures quality")
            from parity.accel_checks import accel_report
            _emit(accel_report(family, accel, seed=seed, fault=fault, variant=variants[0] if variants else None),
                  json_path)
            return
        if topology is not None:
            if level not in ("C1", "C4"):
                raise SetupError(f"--topology runs C1 or C4 (got --level {level})")
            from parity.topology_checks import topology_report
            _emit(topology_report(family, level, topology, fault=fault), json_path)
            return
        if level not in fam.levels:
            raise SetupError(f"level {level} is not implemented for {family} yet "
                             f"(implemented: {', '.join(fam.levels) or 'none'})")
        dtype = dtype or ("all" if level == "C0" else "fp32")
        extra = {}
        if world_sizes:
            if not fam.supports_world_size:
                raise SetupError(f"{family} has no sequence-parallel plan; --world-size does not apply")
            extra["world_sizes"] = sorted(set(world_sizes))
        if cases != "ci":
            params = inspect.signature(fam.levels[level]).parameters
            if "cases" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                raise SetupError(f"{family} {level} has one fixed case list; --cases {cases} does not apply")
            extra["cases"] = cases
        if graph != "eager":
            if "graph" not in inspect.signature(fam.levels[level]).parameters:
                raise SetupError(f"{family} {level} has no graph modes; --graph {graph} does not apply")
            if graph == "cuda" and not device.startswith("cuda") and plan is None:
                raise SetupError(f"--graph cuda captures CUDA graphs and needs --device cuda, got --device {device} "
                                 f"(on CPU: --graph eager or compile)")
            extra["graph"] = graph
        if plan is not None:
            if "plan" not in inspect.signature(fam.levels[level]).parameters:
                raise SetupError(f"{family} {level} has no parallel plans; --plan {plan} does not apply")
            extra["plan"] = plan
        report = fam.run(level, variants=list(variants), checkpoint=checkpoint, device=device,
                         dtypes=["fp32", "bf16"] if dtype == "all" else [dtype], seed=seed, fault=fault,
                         progress=lambda msg: click.echo(msg, err=True), **extra)
    except SetupError as e:
        _fail_setup(str(e))
    _emit(report, json_path)


@cli.command("golden")
@click.argument("case_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--side", type=click.Choice(["both", "reference", "optimized"]), default="both", show_default=True,
              help="Which implementation(s) to compare with the upstream outputs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the full report as JSON to this path.")
def golden_cmd(case_dirs, side, json_path) -> None:
    """Check upstream golden cases: convert each case's upstream/ checkpoint into the canonical layout,
    run its probe on the reference and the optimized side, compare with the upstream outputs.

    A case directory holds case.json, upstream/, inputs.safetensors and outputs.safetensors
    (see golden/README.md). A missing required output, an undeclared output or a probe exception is a
    failed check of that case (exit 1); so is a malformed case, and the other cases still run (exit 2 only when
    no case at all is readable). Among several paths (a glob such as golden/seedvr2/*), files and folders without
    case.json are skipped and named; a path given alone must be a case (exit 2 otherwise).
    """
    from parity.golden import run_golden_cases

    try:
        check_json_path(json_path)
        report = run_golden_cases([Path(p) for p in case_dirs], sides=("reference", "optimized") if side == "both"
                                  else (side,), progress=lambda msg: click.echo(msg, err=True))
    except SetupError as e:
        _fail_setup(str(e))
    _emit(report, json_path)


@cli.command("mutate")
@click.argument("family")
@click.option("--jobs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Mutations run in parallel (one scratch copy and one check subprocess each).")
@click.option("--only", "only", multiple=True, help="Run only this mutation (repeatable; names from --list).")
@click.option("--category", "categories", multiple=True, help="Run only mutations of this category (repeatable).")
@click.option("--check", "check_names", multiple=True,
              help="Run only this check (repeatable): run:C0 .. run:C4, a plan the family declares (e.g. "
                   "run:C1@cfgp2) or golden. Default: every implemented level, those plans and the golden cases.")
@click.option("--min-score", type=click.FloatRange(0, 100), default=None,
              help="Exit 1 when the mutation score (percent) is below this. Default: report only (exit 0).")
@click.option("--timeout", type=click.IntRange(10, 24 * 3600), default=1800, show_default=True,
              help="Seconds one check may run on one mutation (a hang counts as crashed).")
@click.option("--stop-at-first", is_flag=True,
              help="Stop each mutation at its first failing check (faster; the redundancy report then counts only "
                   "the checks that ran). Default: every check on every mutation.")
@click.option("--no-baseline", is_flag=True, help="Skip checking the clean tree first (checks then run in "
                                                  "declaration order and none is left out).")
@click.option("--list", "list_only", is_flag=True, help="Print the catalogue and exit.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write every outcome (checks, baseline, score) as JSON to this path.")
def mutate_cmd(family, jobs, only, categories, check_names, min_score, timeout, stop_at_first, no_baseline,
               list_only, json_path) -> None:
    """Plant each catalogued porting bug of FAMILY (parity/mutations/FAMILY.json) in a scratch copy, run the
    family's `fvparity run` levels and goldens against it, and report the mutation score = caught / valid.

    \b
    caught   a check failed (crashed: it exited 2/3 or timed out; counted as caught, shown apart)
    survived every check passed        invalid  the edit did not apply or broke import (not counted)
    The redundancy report says, per caught mutation, how many checks and levels caught it, and lists the
    mutations caught by one check only (--json: "redundancy").
    The working tree is never modified. Exit 0, or 1 when --min-score is given and not met; 2 usage / setup.
    """
    from parity import mutate

    try:
        check_json_path(json_path)
        mutations = mutate.load_catalogue(family)
        if list_only:
            from tabulate import tabulate
            click.echo(tabulate([[m.name, m.side, m.category, m.why] for m in mutations],
                                headers=["mutation", "side", "category", "why a porter could make it"]))
            return
        from parity.families import get_family
        get_family(family)
        selected = mutate.select(mutations, tuple(only), tuple(categories))
        run = mutate.run_mutations(family, selected, jobs=jobs, timeout=timeout, check_names=tuple(check_names),
                                   baseline=not no_baseline, stop_at_first=stop_at_first,
                                   progress=lambda msg: click.echo(msg, err=True))
    except SetupError as e:
        _fail_setup(str(e))
    click.echo(run.table())
    if run.dropped_checks:
        click.echo(f"left out (failing on the clean tree): {', '.join(run.dropped_checks)}")
    click.echo(run.summary())
    click.echo(run.redundancy_summary())
    if json_path:
        mutate.write_json(run, json_path)
        click.echo(f"wrote {json_path}")
    sys.exit(1 if min_score is not None and (run.score is None or 100 * run.score < min_score) else 0)


@cli.group("port")
def port_group() -> None:
    """Start a port: write a new family's skeleton from an upstream class."""


@port_group.command("new")
@click.argument("family")
@click.option("--from", "spec", required=True, metavar="diffusers:CLASS",
              help="The upstream model class, e.g. diffusers:DiTTransformer2DModel.")
@click.option("--tiny", "tiny", multiple=True, metavar="NAME=VALUE",
              help="Override a field of the derived tiny config (repeatable; JSON values).")
@click.option("--dry-run", is_flag=True, help="Print the files it would write and write nothing.")
def port_new_cmd(family, spec, tiny, dry_run) -> None:
    """Write FAMILY's folders (manifests/, reference/, optimized/models/, parity/families/, golden/, a test) from
    the upstream class: config + tiny variant, canonical keys and a diffusers CheckpointManifest from its state-dict
    names, both sides' modules and family entries, C0 with one planted fault, a golden maker. Nothing outside those
    folders changes; `fvparity list` shows the family at once and C0 fails "not implemented: reference.forward"
    until the two forwards are written. Exit 2 when the family exists or the class cannot be scaffolded."""
    import json as _json
    from parity.port import scaffold

    try:
        overrides = {}
        for item in tiny:
            key, sep, raw = item.partition("=")
            if not sep:
                raise SetupError(f"--tiny {item!r}: expected NAME=VALUE")
            try:
                overrides[key] = _json.loads(raw)
            except ValueError:
                overrides[key] = raw
        plan = scaffold.build(family, spec, overrides)
        paths = sorted(plan.files) if dry_run else [str(p.relative_to(scaffold.ROOT)) for p in scaffold.write(plan)]
    except SetupError as e:
        _fail_setup(str(e))
    for p in paths:
        click.echo(("would write " if dry_run else "wrote ") + p)
    for note in plan.notes:
        click.echo(note)


@cli.command("align")
@click.argument("family")
@click.option("--upstream", "spec", required=True, metavar="diffusers:CLASS", help="The upstream class to align with.")
@click.option("--checkpoint", type=click.Path(file_okay=False), default=None,
              help="An upstream (diffusers) model folder; default: the variant with seeded random weights.")
@click.option("--variant", default=None, help="The family variant (default: its first default variant).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the weights and the inputs.")
@click.option("--plant-upstream", "plant", default=None, metavar="MODULE",
              help="Negative control: scale this upstream module's output by 1.01; align must name it.")
@click.option("--save", "save", type=click.Path(file_okay=False), default=None,
              help="Freeze the inputs, upstream weights, output and module outputs into this golden case folder.")
@click.option("--force", is_flag=True, help="With --save: replace an existing case.")
def align_cmd(family, spec, checkpoint, variant, seed, plant, save, force) -> None:
    """Run upstream and both sides of FAMILY on the same seeded inputs and weights, pair modules through the
    family's CheckpointManifest key map, and print the first module whose output diverges (both names, both
    shapes, the metrics). Exit 0 aligned, 1 a divergence (or a side that does not run), 2 setup."""
    from parity import align as A

    try:
        if save and plant:
            raise SetupError("--save with --plant-upstream would freeze a planted difference into a golden")
        result, run, inputs, traces = A.align(family, spec, variant, checkpoint, seed, plant,
                                              progress=lambda m: click.echo(m, err=True))
        kept = A.save_case(Path(save), result, run, inputs, traces, seed, force) if save else None
    except SetupError as e:
        _fail_setup(str(e))
    click.echo(A.table(result))
    click.echo(f"{family} align vs {spec}: {'ALIGNED' if result.passed else 'DIVERGED'} "
               f"({result.paired} upstream modules paired; tolerance rel_l2 <= {result.tolerance.rel_l2})")
    if kept is not None:
        click.echo(f"wrote {save} ({len(kept)} intermediates)")
    sys.exit(0 if result.passed else 1)


from parity.certify import certify_cmd  # noqa: E402  fvparity certify FAMILY --accel NAME[:knobs] (issue 21)

cli.add_command(certify_cmd)


def main() -> None:
    import os

    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("fvparity: aborted", err=True)
        sys.exit(2)
    except click.ClickException as e:  # usage errors: one line, exit 2
        click.echo(f"fvparity: error: {e.format_message()}", err=True)
        sys.exit(2)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        click.echo("fvparity: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # a harness bug: one line unless asked for the traceback
        if os.environ.get("FVPARITY_DEBUG"):
            raise
        click.echo(f"fvparity: internal error: {type(e).__name__}: {e} (set FVPARITY_DEBUG=1 for the traceback)",
                   err=True)
        sys.exit(3)
    sys.exit(0)


if __name__ == "__main__":
    main()
