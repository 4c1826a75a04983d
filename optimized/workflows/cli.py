"""fvgen workflow: a ComfyUI workflow file (API prompt or UI export) -> its outputs, through the optimized engine.

  fvgen workflow examples/workflows/wan_t2v_tiny_api.json --models-dir models/ --out out/

The loaders' model names are looked up under --models-dir (see optimized/workflows/runner.py); every output node
writes OUT/<filename_prefix>_<node id>/ (PNG frames + video.json). OUT must not exist; it appears whole or not at all.

Exit codes: 0 written; 1 the generation failed or was interrupted (nothing written); 2 an invalid or uncompilable
workflow (one line per problem, each naming the node id and input), a missing model, a bad argument, an unusable
--out: all found before anything runs; 3 a bug in the tool.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class UsageError(Exception):
    """Exit 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fvgen workflow", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workflow", help="workflow JSON: an API prompt ({id: {class_type, inputs}}) or a UI export")
    p.add_argument("--models-dir", required=True, help="root holding canonical model directories (fvconvert)")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def run(argv: list[str]) -> int:
    import torch

    from optimized.programs import check_out_path
    from optimized.serving.loading import Progress, check_device
    from optimized.serving.loading import UsageError as FvgenUsage
    from optimized.workflows import WorkflowError, bind, compile_file, resolve_model_dir, write_outputs
    args = _parser().parse_args(argv)
    try:
        check_device(args.device)
    except FvgenUsage as e:
        raise UsageError(str(e)) from None
    if Path(args.out).suffix:
        raise UsageError(f"--out {args.out}: give a directory (one folder per output node)")
    try:
        check_out_path(args.out)
        program = compile_file(Path(args.workflow))
        model_dir = resolve_model_dir(program, args.models_dir)
    except WorkflowError as e:
        raise UsageError("invalid workflow:\n  " + "\n  ".join(x.text() for x in e.errors)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        check_out_path(args.out, not_inside=model_dir)
    except ValueError as e:
        raise UsageError(str(e)) from None
    from manifests.errors import ManifestError
    from optimized import Engine
    try:
        engine = Engine.from_checkpoint(model_dir, device=args.device, dtype=getattr(torch, DTYPES[args.dtype]))
    except ManifestError as e:
        raise UsageError(str(e)) from None
    try:
        bound = bind(program, engine)
        vp = engine.start_video(bound.request)
    except WorkflowError as e:
        raise UsageError("invalid workflow:\n  " + "\n  ".join(x.text() for x in e.errors)) from None
    vp.subscribe(Progress(quiet=args.quiet))
    try:
        result = vp.result()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    outputs = write_outputs(program, result, args.out)
    summary: dict[str, Any] = {"out": args.out, "model": str(model_dir), "outputs": outputs, "seed": result.seed,
                               "frames": list(result.frames.shape), "weights_version": result.weights_version,
                               "skipped_nodes": list(program.skipped), "timings": result.timings}
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str]) -> int:
    """Called by fvgen for `fvgen workflow ...`; the exit-code convention above."""
    try:
        return run(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
