"""fvgen: prompt (or token ids) -> video file, through the optimized engine's video program.

  fvgen wan --variant tiny --prompt "a cat" --out clip.mp4                 random weights, no checkpoint (CPU, seconds)
  fvgen cosmos3 --model OUT --prompt "..." --frames 17 --size 640x480 --out clip.mp4   (WIDTHxHEIGHT)
  fvgen wan --variant tiny --prompt-ids 5,17,42 --steps 8 --out frames/     a directory: PNG frames + video.json
  fvgen card wan --variant tiny                                             the DeploymentCard as JSON
  fvgen serve wan --variant tiny --port 8000                                the HTTP server (`serve` extra)
  fvgen serve --fleet examples/fleet/deployment.yaml --port 8000            role pools on Ray (`fleet` extra)

Output: OUT.mp4 (needs the `video` extra, imageio-ffmpeg) + the sidecar OUT.json (request, seed, weights version,
timings) [+ OUT.wav when the model makes sound], or a directory (no .mp4 suffix) of frame_00000.png ... + video.json
[+ audio.wav]. Everything is written atomically (temp + rename); an existing OUT is never overwritten.

Prompts: the family's processor turns a prompt into token ids when the family has one. Without a processor,
`--prompt-ids 1,2,3` gives the ids directly, and with random weights (`--variant`) a `--prompt` falls back to
byte-level ids (each UTF-8 byte modulo the text vocabulary, truncated to the model's text length); with a converted
checkpoint and no processor a `--prompt` is refused (use --prompt-ids).

--size is WIDTHxHEIGHT in pixels (OpenAI's and ffmpeg's order, as the server's `size`); --frames is the pixel frame
count (4k + 1). Progress (per stage: encode chunks, denoise steps, decode chunks) goes to stderr, as a redrawn bar on
a terminal and as plain lines (every 10%) into a file or pipe; the result summary (JSON) to stdout.

Exit codes: 0 written; 1 the generation failed or was cancelled, SIGTERM / Ctrl-C included (nothing written, no
temp file left); 2 usage or setup error (bad argument, unknown variant or device, missing checkpoint or extra,
invalid request, an --out that exists, cannot be written or lies inside the model directory: all found before
anything runs); 3 a bug in the tool.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from optimized.serving.loading import (DEVICES, DTYPES, Progress, UsageError, _family_names, check_device,  # noqa: F401
                                       load_engine, resolve_variant)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so every temp file's cleanup (`except BaseException`) runs."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fvgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", help="model family: cosmos3 | wan (or `card`, `serve` as the first word)")
    src = p.add_argument_group("model (exactly one)")
    src.add_argument("--model", metavar="OUT", help="canonical model directory written by fvconvert")
    src.add_argument("--variant", help="random weights at a variant's shapes, no checkpoint: 'tiny' picks the "
                                       "family's tiny text-to-video variant (wan: tiny-2.1-t2v; cosmos3: tiny)")
    src.add_argument("--seed-weights", type=int, default=0, help="seed of the random weights (default 0)")
    g = p.add_argument_group("request")
    g.add_argument("--prompt", help="text prompt (see 'Prompts' above for families without a processor)")
    g.add_argument("--prompt-ids", help="token ids, comma separated (instead of --prompt)")
    g.add_argument("--negative-prompt", help="negative prompt (default: empty)")
    g.add_argument("--negative-prompt-ids", help="negative token ids, comma separated")
    g.add_argument("--frames", type=int, help="pixel frames, 4k + 1 (default: the family's small default, 5)")
    g.add_argument("--size", help="WIDTHxHEIGHT in pixels, e.g. 640x480 (default 32x32)")
    g.add_argument("--steps", type=int, help="denoising steps (default 4)")
    g.add_argument("--guidance", type=float, help="CFG scale; > 1 runs classifier-free guidance (default 5.0)")
    g.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    g.add_argument("--image", help="conditioning image (PNG/JPEG) for image-to-video models")
    g.add_argument("--lora", action="append", metavar="FILE[:SCALE]", help="a LoRA file (any format fvconvert lora "
                   "reads) applied to this request at SCALE (default 1.0); repeatable")
    g.add_argument("--accel", metavar="NAME[:KNOBS]", help="an acceleration for this request, e.g. "
                   "fbcache:threshold=0.05 (manifests/accel; certify it with fvparity certify); none: exact")
    r = p.add_argument_group("run")
    r.add_argument("--out", help="OUT.mp4 (+ OUT.json sidecar) or a directory for PNG frames (+ video.json)")
    r.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    r.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="model dtype (default fp32)")
    r.add_argument("--plan", default="none", help="parallel plan; only 'none' is supported for now")
    r.add_argument("--offload", default="none", choices=("none", "idle", "blockwise"),
                   help="weights offload (bitwise the same output): idle = one component on the device at a time; "
                        "blockwise = also the DiT by blocks with prefetch, for models larger than the device")
    r.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def _card_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fvgen card", description="Print the DeploymentCard (JSON) of a model: family, "
                                "variant, weights version, capabilities, dtypes, buckets captured, parallel plan, "
                                "memory reserved.")
    p.add_argument("family", nargs="?", help="cosmos3 | wan (needed with --variant)")
    p.add_argument("--model", metavar="OUT")
    p.add_argument("--variant")
    p.add_argument("--seed-weights", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--plan", default="none")
    return p


def _run_card(argv: list[str]) -> int:
    args = _card_parser().parse_args(argv)
    engine = load_engine(args.family, args.model, args.variant, args.device, args.dtype, args.plan, args.seed_weights)
    print(json.dumps(engine.deployment_card(), indent=2, sort_keys=True))
    return 0


def _read_image(path: str) -> Any:
    from optimized.serving.requests import decode_image
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"--image {path}: {e.strerror}") from None
    return decode_image(data, "--image")


def _run_generate(argv: list[str]) -> int:
    from optimized.serving.families import ServingError
    from optimized.serving.requests import build_request, parse_size
    args = _generate_parser().parse_args(argv)
    if args.out is None:
        raise UsageError("--out is required (OUT.mp4, or a directory for PNG frames)")
    if args.prompt is None and args.prompt_ids is None:
        raise UsageError("give --prompt or --prompt-ids")
    from optimized.programs import check_out_path
    check_device(args.device)
    try:   # before the engine loads: an unusable --out is found before anything runs
        check_out_path(args.out, not_inside=args.model if args.variant is None else None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    engine = load_engine(args.family, args.model, args.variant, args.device, args.dtype, args.plan, args.seed_weights)
    if args.offload != "none":   # the memory plane (optimized/runtime/memory.py)
        try:
            engine.memory.set_offload(args.offload)
        except ValueError as e:
            raise UsageError(f"--offload {args.offload}: {e}") from None
    try:
        height, width = parse_size(args.size, "--size") if args.size else (None, None)
        image = _read_image(args.image) if args.image else None
        request, program_image = build_request(
            engine, prompt=args.prompt, prompt_ids=args.prompt_ids, negative_prompt=args.negative_prompt,
            negative_prompt_ids=args.negative_prompt_ids, num_frames=args.frames, height=height, width=width,
            num_steps=args.steps, guidance_scale=args.guidance, seed=args.seed, image=image, accel=args.accel)
        from optimized.serving.loras import apply_cli_loras
        request = apply_cli_loras(engine, request, args.lora)   # --lora FILE[:scale] (optimized/serving/loras.py)
        program = engine.start_video(request, args.out, image=program_image)
    except (ServingError, ValueError) as e:  # invalid request / unusable --out / missing extra: nothing ran
        raise UsageError(str(e)) from None
    program.subscribe(Progress(quiet=args.quiet))
    try:
        result = program.result()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Terminated:   # the writers' cleanup ran on the way out: nothing written, no temp file left
        program.cancel()
        print("terminated: nothing written", file=sys.stderr)
        return 1
    summary = {"out": args.out, "paths": result.paths, "frames": list(result.frames.shape),
               "audio": None if result.audio is None else list(result.audio.shape), "seed": result.seed,
               "weights_version": result.weights_version, "timings": result.timings,
               "request_id": result.request_id}
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # a generation turns SIGTERM into an exception so its temp files are cleaned up (`serve` has its own handling)
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if argv[:1] != ["serve"] and _main_thread() \
        else None
    try:
        return _main(argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["serve"] and any(a == "--fleet" or a.startswith("--fleet=") for a in argv[1:]):
            try:   # role pools behind the fleet router (optimized/serving/fleet_server.py; `fleet` extra for Ray)
                from optimized.serving.fleet_server import main as fleet_main
            except ImportError as e:
                raise UsageError(f"fvgen serve --fleet needs the optional serve extra (pip install -e '.[fleet]'): "
                                 f"{e}") from None
            return fleet_main(argv[1:], prog="fvgen serve --fleet")
        if argv[:1] == ["serve"]:
            try:
                from optimized.serving.server import main as serve_main
            except ImportError as e:
                raise UsageError(f"fvgen serve needs the optional serve extra (pip install -e '.[serve]'): {e}") \
                    from None
            return serve_main(argv[1:], prog="fvgen serve")
        if argv[:1] == ["card"]:
            return _run_card(argv[1:])
        if argv[:1] == ["workflow"]:   # a ComfyUI workflow file (optimized/workflows/cli.py)
            from optimized.workflows.cli import main as workflow_main
            return workflow_main(argv[1:])
        return _run_generate(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0) if isinstance(e.code, int) else 2
    except BrokenPipeError:  # stdout closed early (e.g. piped into head)
        return 0
    except (KeyboardInterrupt, Terminated):
        print("interrupted: nothing written", file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - a bug in the tool
        traceback.print_exc()
        print("fvgen: internal error (exit 3); please report it with the command line above", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
