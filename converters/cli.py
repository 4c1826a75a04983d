"""`fvconvert`: upstream checkpoint -> canonical checkpoint directory, plus `inspect` and `formats`.

Exit codes (one convention for every CLI of the kit): 0 success; 1 the parity post-check failed; 2 bad input,
usage or setup (one `fvconvert: error: ...` line on stderr, nothing left in OUT); 3 internal error (a bug; set
FVCONVERT_DEBUG=1 for the traceback); 130 / 143 interrupted by SIGINT / SIGTERM (partial output removed).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import click

from converters.engine import DEFAULT_MAX_SHARD_BYTES, DTYPE_ALIASES, convert
from converters.errors import ConversionError, ParityCheckFailed
from converters.families import family_formats, family_names, get_family
from converters.hooks import MissingPostCheck, get_post_check
from converters.inspect import human_bytes, human_count, inspect_source
from converters.lora import lora_cmd
from converters.manifest import load_manifest
from converters.pipeline import PIPELINE, detect_format
from converters.staging import Interrupted
from manifests.errors import ManifestError
from manifests.layouts import bare_variant

PROG = "fvconvert"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    m = _SIZE.match(text or "")
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size (examples: 5GB, 500MiB, 1000000)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise click.BadParameter("must be > 0")
    return n


def _progress(quiet: bool):
    if quiet:
        return None
    return lambda msg: click.echo(f"{PROG}: {msg}", err=True)


def render_bar(u: dict, width: int = 28) -> str:
    """One progress-bar line: `[########......] 57% 120/210 tensors 3.10/5.40 GiB 1.23 GB/s ETA 2s`."""
    frac = u["done_bytes"] / u["total_bytes"] if u["total_bytes"] else u["done"] / max(1, u["total"])
    fill = int(round(frac * width))
    rate = u["done_bytes"] / u["elapsed_s"] if u["elapsed_s"] > 0 else 0.0
    eta = (u["total_bytes"] - u["done_bytes"]) / rate if rate > 0 else 0.0
    return (f"[{'#' * fill}{'.' * (width - fill)}] {frac * 100:3.0f}% {u['done']}/{u['total']} tensors "
            f"{u['done_bytes'] / 2**30:.2f}/{u['total_bytes'] / 2**30:.2f} GiB {rate / 1e9:.2f} GB/s ETA {eta:.0f}s")


class _Bar:
    """A progress bar redrawn in place on a terminal, at most ~10 times a second."""

    def __init__(self, stream):
        self.stream = stream
        self.last = 0.0
        self.shown = False

    def __call__(self, u: dict) -> None:
        import time

        now = time.time()
        if u["done"] < u["total"] and now - self.last < 0.1:
            return
        self.last = now
        self.stream.write("\r" + render_bar(u) + "\x1b[K")
        if u["done"] == u["total"]:
            self.stream.write("\n")
        self.stream.flush()
        self.shown = True


def _progress_bar(quiet: bool):
    stream = sys.stderr
    if quiet or not stream.isatty():
        return None
    return _Bar(stream)


MAIN_HELP = f"""Convert upstream model checkpoints into the canonical layout that the reference and
optimized engines load, and inspect checkpoints.

\b
Examples:
  {PROG} cosmos3 --from diffusers ckpt/transformer out/cosmos3-nano
  {PROG} cosmos3 --from diffusers ckpt/transformer out/nano --dtype bfloat16 --variant nano
  {PROG} cosmos3 --from framework model.safetensors out/nano --variant nano
  {PROG} cosmos3 --from transformers reasoner/ out/nano-reasoner   # partial: the und part
  {PROG} inspect ckpt/transformer          # what is this? format guess, keys, dtypes, shapes
  {PROG} formats                           # families, formats and their manifests

\b
OUT receives model.safetensors (sharded above --max-shard-size, with
model.safetensors.index.json), config.json, manifest.json (the resolved
CheckpointManifest) and conversion_report.json (renames, drops, dtypes, shapes,
sha256 of inputs and outputs, parity status). It is written in a temporary
directory beside OUT (.OUT.fvconvert-tmp-PID-*, with your umask's permissions)
and put in place at the end: a failed or interrupted run leaves nothing, and a
run removes what killed runs left. --force swaps OUT atomically; it never
replaces OUT when OUT is, holds or lies inside the source or its files.

\b
Exit codes (all fvconvert / fvparity commands):
  0 ok; 1 parity failure (the post-check on the converted weights failed);
  2 usage, setup or bad input (one line on stderr, nothing written);
  3 internal error, a bug (FVCONVERT_DEBUG=1 shows the traceback);
  130 / 143 interrupted by SIGINT / SIGTERM (the partial output is removed).
"""


@click.group(help=MAIN_HELP, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name=None, version="engine 1", prog_name=PROG, message="%(prog)s %(version)s")
def cli() -> None:
    pass


def _family_help(fam_name: str) -> str:
    fam = get_family(fam_name)
    lines = [f"Convert a {fam_name} checkpoint at SRC into a canonical {fam_name} checkpoint directory OUT.", "",
             "SRC is the upstream model folder (config + weights), or a weights file",
             "(.safetensors, *.safetensors.index.json, .pt/.pth/.bin weights_only pickle)",
             "with its config beside it or given with --config.", "", "\b", "Formats (--from):"]
    for fmt in family_formats(fam_name):
        try:
            m = load_manifest(fam_name, fmt)
            lines.append(f"  {fmt:<13} {m.upstream.get('source', '')}")
            lines.append(f"  {'':<13} files: {m.config_file or '(no config: --variant or --config)'} + one of "
                         + ", ".join(w.path for w in m.weight_files)
                         + (f"; fills only: {', '.join(m.fills)}" if m.fills else ""))
        except ConversionError as e:
            lines.append(f"  {fmt:<13} (manifest invalid: {e})")
    lines += ["", "\b", f"Variants (--variant): {', '.join(fam.list_variants())}",
              f"Canonical parts: {', '.join(fam.part_names)} (a format filling fewer gives a partial checkpoint)", "",
              "Checks, all strict: every source key must match a manifest rule (or a drop/sidecar rule, with",
              "its reason in the report); every canonical key of the parts the format fills must be produced",
              "exactly once with the shape the config implies; NaN/Inf values are refused.",
              "", "\b", "Example:", f"  {PROG} {fam_name} --from {(fam.formats() or ['FORMAT'])[0]} SRC OUT --dtype bfloat16"]
    return "\n".join(lines)


def _make_family_command(fam_name: str) -> click.Command:
    @click.command(name=fam_name, help=_family_help(fam_name), short_help=f"Convert a {fam_name} checkpoint.",
                   context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
    @click.option("--from", "fmt", required=True, metavar="FORMAT",
                  help="Upstream checkpoint format (see the list above; `fvconvert formats`), or a path to a "
                       "CheckpointManifest JSON for a custom format.")
    @click.argument("src", type=click.Path(path_type=Path))
    @click.argument("out", type=click.Path(path_type=Path))
    @click.option("--config", "config", type=click.Path(path_type=Path), default=None,
                  help="Upstream config file, when SRC is a bare weights file without one beside it.")
    @click.option("--variant", metavar="NAME", default=None,
                  help="Check that the converted config equals this named variant (e.g. nano); error if not. For a "
                       "format without a config (framework) it gives the architecture; for a partial config "
                       "(transformers) it supplies the fields the source does not determine.")
    @click.option("--dtype", metavar="DTYPE", default=None,
                  help="Output dtype: float32, bfloat16 or float16 (aliases fp32, bf16, fp16). Default: keep the "
                       "source dtype. Keys the family keeps in float32 (cosmos3: time_embed.*) stay float32.")
    @click.option("--force", is_flag=True, help="Replace OUT if it exists (only after the new one is complete).")
    @click.option("--allow-truncate", is_flag=True,
                  help="Accept a checkpoint holding only the first k complete layers of the N its config declares; "
                       "the converted config then says k layers.")
    @click.option("--allow-nonfinite", is_flag=True,
                  help="Keep NaN/Inf values (and float16 overflow) instead of refusing; listed in the report.")
    @click.option("--keep-sidecars", is_flag=True,
                  help="Write tensors that manifests route to a sidecar (e.g. the Qwen3-VL vision encoder) to "
                       "OUT/<sidecar>/ instead of dropping them.")
    @click.option("--skip-parity", is_flag=True,
                  help="Do not run the parity post-check on the converted weights (report: parity skipped).")
    @click.option("--max-shard-size", default=None, metavar="SIZE",
                  help=f"Split model.safetensors into shards of at most SIZE (e.g. 5GB, 500MiB). "
                       f"Default {DEFAULT_MAX_SHARD_BYTES // 2**30}GiB.")
    @click.option("-q", "--quiet", is_flag=True, help="No progress messages on stderr.")
    def command(fmt, src, out, config, variant, dtype, force, allow_truncate, allow_nonfinite, keep_sidecars,
                skip_parity, max_shard_size, quiet) -> int:
        if dtype is not None and dtype.lower() not in DTYPE_ALIASES:
            raise click.BadParameter(f"{dtype!r}; use float32, bfloat16 or float16", param_hint="'--dtype'")
        if variant is not None:                          # variants are per family: 'wan:tiny-2.1' is wan's tiny-2.1
            variant = bare_variant(fam_name, variant)
        target = detect_format(fam_name, fmt, src)     # `--from diffusers DIR`: which component / a pipeline root
        if target == PIPELINE:
            return _convert_pipeline(fam_name, src, out, variant, dtype, force, allow_nonfinite, skip_parity,
                                     max_shard_size, quiet)
        manifest = load_manifest(fam_name, target)     # unknown format / invalid manifest: one clear error
        fam = get_family(fam_name, manifest.component)
        if variant is not None and variant not in fam.list_variants():
            raise ConversionError(f"unknown variant {variant!r} for {fam_name}; known: {', '.join(fam.list_variants())}")
        shard_bytes = parse_size(max_shard_size) if max_shard_size else DEFAULT_MAX_SHARD_BYTES
        # the family's parity entry names its post-check (converters/hooks.py); none declared: exit 2, never "not run"
        post = None if skip_parity else get_post_check(manifest.post_check_name)
        if post is None and not skip_parity:    # an override that gives nothing is as missing as none declared
            raise MissingPostCheck(f"manifest {manifest.id} requires {manifest.parity.level} parity after conversion, "
                                   f"but no post-check {manifest.post_check_name!r} is declared (parity.families."
                                   f"{fam_name}.FAMILY); pass --skip-parity to convert without it")
        bar = _progress_bar(quiet)
        report = convert(fam_name, manifest, src, out, config=config, variant=variant, dtype=dtype, force=force,
                         allow_truncate=allow_truncate, allow_nonfinite=allow_nonfinite, keep_sidecars=keep_sidecars,
                         post_check=post, skip_parity=skip_parity, max_shard_bytes=shard_bytes,
                         progress=_progress(quiet), progress_update=bar)
        d = report.dtypes
        click.echo(f"converted {fam_name}/{manifest.format} {src} -> {out}")
        click.echo(f"  tensors: {report.num_output_keys} written from {report.num_source_keys} source keys "
                   f"({len(report.dropped)} dropped), {human_count(report.shapes['num_params'])} params, "
                   f"{human_bytes(report.shapes['output_bytes'])}")
        click.echo("  dtypes:  " + ", ".join(f"{k} {v}" for k, v in sorted(d["output"].items()))
                   + (f" ({d['cast']} cast)" if d["cast"] else ""))
        if report.truncated:
            t = report.truncated
            click.echo(f"  layers:  truncated to {t['converted_num_layers']} of {t['config_num_layers']}")
        if report.nonfinite:
            click.echo(f"  WARNING: {len(report.nonfinite)} tensors hold NaN/Inf (kept by --allow-nonfinite)")
        if report.variant:
            click.echo(f"  variant: {report.variant['name']} ({report.variant['status']})")
        pt = report.parts
        if pt["unfilled"]:
            click.echo(f"  parts:   PARTIAL checkpoint: holds {', '.join(pt['filled'])}; not filled by this format: "
                       f"{', '.join(pt['unfilled'])} (load with load_canonical(OUT, parts={pt['filled']!r}))")
        else:
            click.echo(f"  parts:   complete ({', '.join(pt['filled'])})")
        if report.config_source.get("undetermined_fields"):
            u = report.config_source["undetermined_fields"]
            src_of = report.config_source.get("completed_from_variant")
            click.echo(f"  config:  {len(u)} fields not determined by the source, taken from "
                       + (f"variant {src_of}" if src_of else "the family defaults (pass --variant to pin them)"))
        for name, sc in report.sidecars.items():
            click.echo(f"  sidecar: {name}: {sc['keys']} tensors " + ("written to " + ", ".join(sc["files"]) if sc["kept"]
                                                                       else "dropped (--keep-sidecars keeps them)"))
        p = report.parity
        click.echo(f"  parity:  {p.get('status')}" + (f" ({p['reason']})" if p.get("reason") else ""))
        names = [o["path"] for o in report.outputs] + ["conversion_report.json"]
        shards = [n for n in names if n.startswith("model-")]
        if len(shards) > 2:
            names = [f"{len(shards)} shards ({shards[0]} .. {shards[-1]})"] + [n for n in names if n not in shards]
        click.echo("  files:   " + ", ".join(names))
        return 0

    return command


def _convert_pipeline(fam_name, src, out, variant, dtype, force, allow_nonfinite, skip_parity, max_shard_size,
                      quiet) -> int:
    """A diffusers pipeline root -> one canonical model directory (converters/pipeline.py)."""
    from converters.pipeline import convert_pipeline, pipeline_families

    if variant is not None and fam_name in pipeline_families():
        known = pipeline_families()[fam_name].variants()
        if variant not in known:
            raise ConversionError(f"unknown model variant {variant!r} for {fam_name}; known: {', '.join(known)}")
    shard_bytes = parse_size(max_shard_size) if max_shard_size else DEFAULT_MAX_SHARD_BYTES
    report = convert_pipeline(fam_name, src, out, variant=variant, dtype=dtype, force=force,
                              allow_nonfinite=allow_nonfinite, skip_parity=skip_parity, post_check_for=get_post_check,
                              max_shard_bytes=shard_bytes, progress=_progress(quiet))
    task = f", task {report.config['task']}" if "task" in report.config else ""
    click.echo(f"converted {fam_name} pipeline ({report.pipeline_class}{task}) {src} -> {out}")
    for name, c in report.components.items():
        p = c["parity"]
        click.echo(f"  {name + ':':<14} {c['format']}, {c['num_output_keys']} tensors, parity {p.get('status')}"
                   + (f" ({p['reason']})" if p.get("reason") else ""))
    for name, files in report.assets.items():
        click.echo(f"  {name + ':':<14} {len(files)} file(s) copied")
    for name, why in report.not_converted.items():
        click.echo(f"  {name + ':':<14} not converted: {why}")
    click.echo(f"  weights_version: {report.weights_version}")
    return 0


for _name in family_names():
    cli.add_command(_make_family_command(_name))


@cli.command("inspect", short_help="Summarise a checkpoint: format guess, keys, dtypes, shapes.", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--config", type=click.Path(path_type=Path), default=None,
              help="Config file to judge the format against (default: config.json beside the weights).")
@click.option("--keys", "list_keys", is_flag=True, help="Also list every key with dtype and shape.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of tables.")
def inspect_cmd(src: Path, config: Path | None, list_keys: bool, as_json: bool) -> int:
    """Summarise a checkpoint without converting it: which format it looks like (the share of its keys
    each known manifest's rules match, and whether a strict conversion would pass), key count, dtypes,
    parameter count and shapes grouped by module (repeated layers folded into `layers.*`).

    SRC: a model folder, a .safetensors file, a *.safetensors.index.json, or a .pt/.pth/.bin pickle.
    Only headers are read for safetensors."""
    from tabulate import tabulate

    info = inspect_source(src, config=config, list_keys=list_keys)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return 0
    click.echo(f"source:  {info['src']}  ({info['description']}: {len(info['files'])} file(s))")
    if info["config"]:
        click.echo(f"config:  {info['config']}" + (f"  (_class_name {info['config_class']})" if info["config_class"] else ""))
    if info["best"]:
        best = next(g for g in info["guesses"] if g["format"] == info["best"])
        verdict = "strict conversion would pass" if best["strict"] == "ok" else (
            f"strict check: {best['strict']}" if best["strict"] else "no config to check against")
        if best["strict"] == "ok" and best.get("variant"):
            verdict += f" as variant {best['variant']} (--variant {best['variant']})"
        click.echo(f"format:  {info['best']}  ({best['matched']}/{best['total']} keys matched; {verdict})")
        parts = best.get("parts")
        if parts:
            click.echo("parts:   " + (f"complete ({', '.join(parts['filled'])})" if not parts["unfilled"] else
                                      f"PARTIAL: fills {', '.join(parts['filled'])}; lacks {', '.join(parts['unfilled'])}"))
        extra = [f"{best[k]} {k}" for k in ("dropped", "sidecar", "normalized") if best.get(k)]
        if extra:
            click.echo("rules:   " + ", ".join(extra) + " keys (the manifest's drop/sidecar/normalize entries)")
    else:
        click.echo("format:  unknown (no manifest rule matches any key)")
    click.echo(f"keys:    {info['num_keys']}, {human_count(info['num_params'])} params, {human_bytes(info['bytes'])}"
               + (f", {info['num_layers_seen']} layers" if info["num_layers_seen"] else ""))
    click.echo("dtypes:  " + ", ".join(f"{k} {v}" for k, v in sorted(info["dtypes"].items())))
    for n in info["notes"]:
        click.echo(f"note:    {n}")
    click.echo("")
    click.echo(tabulate([[g["group"], g["keys"], human_count(g["params"]),
                          ", ".join(f"{k}:{v}" for k, v in g["dtypes"].items()),
                          " ".join(str(s) for s in g["shapes"])] for g in info["groups"]],
                        headers=["group", "keys", "params", "dtypes", "shapes (most common)"]))
    others = [g for g in info["guesses"] if g["format"] != info["best"] and g["matched"]]
    if others:
        click.echo("\nother format candidates: " + ", ".join(f"{g['format']} {g['matched']}/{g['total']}" for g in others))
    if list_keys:
        click.echo("")
        click.echo(tabulate([[k["key"], k["dtype"], k["shape"]] for k in info["keys"]], headers=["key", "dtype", "shape"]))
    return 0


@cli.command("formats", short_help="List known families, formats and manifests.", context_settings={"help_option_names": ["-h", "--help"]})
def formats_cmd() -> int:
    """List every family and upstream format fvconvert knows, with the manifest file that defines it."""
    from tabulate import tabulate

    rows = []
    for fam_name in family_names():
        fam = get_family(fam_name)
        for fmt in family_formats(fam_name):
            m = load_manifest(fam_name, fmt)
            rows.append([fam_name, fmt, m.upstream.get("source", ""), m.conversion_version, len(m.rules), m.origin])
    click.echo(tabulate(rows, headers=["family", "format", "upstream", "version", "rules", "manifest"]))
    return 0


cli.add_command(lora_cmd)   # fvconvert lora FAMILY SRC OUT (converters/lora.py)


@cli.command("export", short_help="Canonical model directory -> an upstream pipeline root (diffusers).",
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--to", "target", required=True, type=click.Choice(["diffusers"]), help="Upstream layout to write.")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace OUT if it exists (only after the new one is complete).")
def export_cmd(target: str, model_dir: Path, out: Path, force: bool) -> int:
    """Write the diffusers pipeline root of a canonical wan model directory (the inverse of
    `fvconvert wan --from diffusers ROOT OUT`; tensors bit for bit). See converters/export.py."""
    from converters.export import export_diffusers

    rep = export_diffusers(model_dir, out, force=force)
    click.echo(f"exported {rep.family} {model_dir} -> {out} ({rep.pipeline_class})")
    for name, c in rep.components.items():
        click.echo(f"  {name + ':':<14} {c['num_keys']} tensors -> {c['weights_file']}"
                   + (f" (tied copies: {', '.join(c['tied'])})" if c["tied"] else ""))
    click.echo(f"  assets:        {', '.join(rep.assets)}")
    return 0


def _usage_line(e: click.UsageError) -> str:
    msg = " ".join(e.format_message().split())
    path = e.ctx.command_path if e.ctx is not None else PROG
    return f"{msg} (see: {path} --help)"


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        click.echo(cli.get_help(click.Context(cli, info_name=PROG)))
        return 2
    try:
        rv = cli.main(args=args, prog_name=PROG, standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except click.UsageError as e:
        click.echo(f"{PROG}: error: {_usage_line(e)}", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo(f"{PROG}: interrupted", err=True)
        return 130
    except Interrupted as e:
        click.echo(f"{PROG}: interrupted by {e}; the partial output was removed", err=True)
        return e.exit_code
    except click.ClickException as e:
        click.echo(f"{PROG}: error: {' '.join(e.format_message().split())}", err=True)
        return 2
    except ParityCheckFailed as e:
        click.echo(f"{PROG}: parity failure: {' '.join(str(e).split())}", err=True)
        return 1
    except (ConversionError, ManifestError) as e:
        click.echo(f"{PROG}: error: {' '.join(str(e).split())}", err=True)
        return 2
    except KeyboardInterrupt:
        click.echo(f"{PROG}: interrupted", err=True)
        return 130
    except OSError as e:
        click.echo(f"{PROG}: error: {getattr(e, 'filename', '') or ''}: {e.strerror or e}".replace(": : ", ": "), err=True)
        return 2
    except Exception as e:  # noqa: BLE001 - a bug; never a traceback unless asked for
        if os.environ.get("FVCONVERT_DEBUG"):
            raise
        click.echo(f"{PROG}: internal error: {type(e).__name__}: {' '.join(str(e).split())} "
                   f"(set FVCONVERT_DEBUG=1 for a traceback)", err=True)
        return 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
