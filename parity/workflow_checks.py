"""C1 / C4 through the workflow path: a compiled ComfyUI workflow's output equals the direct request with the same
settings, bitwise on CPU fp32.

For each example workflow (examples/workflows/: the tiny wan 2.1 t2v model, API prompt and UI export; the tiny
wan 2.2 ti2v model as text-to-video, API prompt) the check
  1. compiles it and compares the request fields it means with the settings the case states by hand
     (`CASES`: never read from the compiler) -> `<case>/settings` names the first field that differs;
  2. runs it (bind -> the engine's video program) and the direct request (the processor's request from the stated
     settings) on one engine -> `<case>/C1_latents` (denoised latents) and `<case>/C4_frames` (decoded uint8 frames),
     both exact.
Negative controls (`FAULTS`, planted in the compiler): "widget-shifted-by-one" (a UI export's widgets_values read
without the KSampler's control_after_generate slot, the classic off-by-one) and "cfg-read-as-steps" (the KSampler's
steps taken from its cfg widget); each must fail.

This is a standalone check module (no family registry edit): run by tests/test_workflows.py and by

  python -m parity.workflow_checks --models-dir ROOT [--make-models] [--fault NAME] [--json PATH]

(exit 0 pass, 1 a check failed, 2 setup error). `--make-models` writes the tiny model directories the examples name
(seeded random weights converted by fvconvert, plus a tiny word-level tokenizer) under ROOT first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from parity.errors import SetupError
from parity.report import CheckResult, Report, exceptions_fail

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "workflows"
TINY_MODEL = "tiny-wan-2.1-t2v"
TINY_WORDS = ("a", "cat", "dog", "walks", "runs", "on", "the", "grass", "beach", "in", "snow", "blurry", "static",
              "low", "quality", "bright", "red", "blue", "sky", "video")


@dataclass(frozen=True)
class WorkflowCase:
    name: str
    file: str                        # under examples/workflows/
    settings: dict                   # the generation the workflow means, stated by hand


_TINY_SETTINGS = dict(prompt="a cat walks on the grass", negative_prompt="blurry static", num_frames=5, height=32,
                      width=32, num_steps=3, guidance_scale=5.0, seed=42, solver="unipc", flow_shift=3.0)
_TI2V_SETTINGS = dict(prompt="a cat walks on the grass", negative_prompt="blurry static", num_frames=9, height=32,
                      width=32, num_steps=3, guidance_scale=4.0, seed=7, solver="euler", flow_shift=5.0)
CASES = (WorkflowCase("api", "wan_t2v_tiny_api.json", _TINY_SETTINGS),
         WorkflowCase("ui", "wan_t2v_tiny_ui.json", _TINY_SETTINGS),
         WorkflowCase("ti2v-api", "wan22_ti2v_tiny_api.json", _TI2V_SETTINGS))
TINY_MODELS = {TINY_MODEL: "tiny-2.1-t2v", "tiny-wan-2.2-ti2v": "tiny-2.2-ti2v"}   # model dir name -> variant


# ------------------------------------------------------------------------------------------------------ faults
@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _widget_shifted_by_one() -> contextlib.AbstractContextManager:
    from optimized.workflows import nodes
    original = nodes.NodeSpec.widget_names
    return _patched(nodes.NodeSpec, "widget_names",
                    lambda self: [n for n in original(self) if n != "control_after_generate"])


def _cfg_read_as_steps() -> contextlib.AbstractContextManager:
    from optimized.workflows import compiler
    original = compiler.widget_value
    return _patched(compiler, "widget_value", lambda node, name: original(
        node, "cfg" if node.class_type == "KSampler" and name == "steps" else name))


FAULTS = {"widget-shifted-by-one": _widget_shifted_by_one, "cfg-read-as-steps": _cfg_read_as_steps}


# ------------------------------------------------------------------------------------------------------ the subject
def write_tiny_tokenizer(folder: Path) -> None:
    """A word-level tokenizer.json over TINY_WORDS (ids below the tiny UMT5 vocabulary of 128): "<pad>" 0, "</s>" 1
    appended to every prompt, "<unk>" 2, as the Wan processor reads a T5 tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(TINY_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>", "eos_token": "</s>",
                                                              "model_max_length": 512}))


def write_tiny_models(root: str | Path, name: str = TINY_MODEL, seed: int = 0, variant: str = "tiny-2.1-t2v") -> Path:
    """ROOT/<name>: a tiny wan variant's (default the 2.1 t2v one) seeded random weights as a canonical model directory (fvconvert,
    through the wan parity family's writer) with a tiny tokenizer. Returns the directory."""
    from parity.families.wan.common import resolve_models
    from parity.families.wan.parallel import write_model_dir
    root = Path(root)
    target = root / name
    if target.exists():
        raise SetupError(f"{target} already exists")
    with tempfile.TemporaryDirectory(dir=root if root.is_dir() else None) as tmp:
        made = write_model_dir(resolve_models([variant], None, seed, kinds=("model",))[0], Path(tmp) / "m")
        write_tiny_tokenizer(Path(made) / "tokenizer")
        root.mkdir(parents=True, exist_ok=True)
        shutil.move(str(made), str(target))
    return target


# ------------------------------------------------------------------------------------------------------ the check
def direct_request(engine: Any, settings: dict) -> Any:
    """The request the settings mean, built without the workflow compiler (the processor's own request)."""
    from optimized.serving.requests import request_from_prompt
    s = dict(settings)
    request, _ = request_from_prompt(engine, s.pop("prompt"), **s)
    return request


def _settings_check(case: WorkflowCase, program: Any) -> CheckResult:
    got = program.request_fields()
    diff = [f"{k}: compiled {got.get(k)!r}, stated {v!r}" for k, v in case.settings.items() if got.get(k) != v]
    return CheckResult(f"{case.name}/settings", not diff, detail=diff[0] if diff else
                       f"{len(case.settings)} fields as stated")


def _exact(name: str, got: torch.Tensor, want: torch.Tensor, what: str) -> CheckResult:
    if got.shape != want.shape:
        return CheckResult(name, False, detail=f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
    same = bool(torch.equal(got, want))
    detail = f"{what} bitwise equal" if same else \
        f"{what} differ: max abs {float((got.double() - want.double()).abs().max()):.3e}"
    return CheckResult(name, same, detail=detail)


def run_checks(models_dir: str | Path, fault: str | None = None, cases: tuple[WorkflowCase, ...] = CASES,
               engines: dict | None = None) -> Report:
    """Every case's checks; `engines` (model directory -> Engine) is filled and reused across calls."""
    from optimized import Engine
    from optimized.workflows import bind, compile_file, resolve_model_dir
    if fault is not None and fault not in FAULTS:
        raise SetupError(f"unknown fault {fault!r}; faults: {', '.join(FAULTS)}")
    report = Report("wan", "C1+C4 (workflow)", {"models_dir": str(models_dir), "fault": fault,
                                                "cases": [c.file for c in cases]})
    direct: dict = {}
    engines = {} if engines is None else engines
    with (FAULTS[fault]() if fault else contextlib.nullcontext()):
        for case in cases:
            checks = report.checks
            with exceptions_fail(checks, f"{case.name}/compile"):
                program = compile_file(EXAMPLES / case.file)
                checks.append(_settings_check(case, program))
                model_dir = resolve_model_dir(program, models_dir)
                if model_dir not in engines:
                    engines[model_dir] = Engine.from_checkpoint(model_dir)
                engine = engines[model_dir]
                key = json.dumps([str(model_dir), case.settings], sort_keys=True)
                if key not in direct:
                    direct[key] = engine.generate_video(direct_request(engine, case.settings))
                want = direct[key]
                got = engine.generate_video(bind(program, engine).request)
                checks.append(_exact(f"{case.name}/C1_latents", got.latents["vision"], want.latents["vision"],
                                     "denoised latents"))
                checks.append(_exact(f"{case.name}/C4_frames", got.frames, want.frames, "decoded frames"))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parity.workflow_checks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", required=True)
    p.add_argument("--make-models", action="store_true", help=f"write ROOT/{', '.join(TINY_MODELS)} first")
    p.add_argument("--fault", choices=sorted(FAULTS), help="plant a negative control (the run must fail)")
    p.add_argument("--json", help="write the report as JSON")
    args = p.parse_args(argv)
    try:
        if args.make_models:
            for name, variant in TINY_MODELS.items():
                write_tiny_models(args.models_dir, name, variant=variant)
        report = run_checks(args.models_dir, args.fault)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.table())
    print(report.summary())
    if args.json:
        report.write_json(args.json)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
