"""What every family's processor checks share: the golden probe's per-side setup, the stored-input rebuild, the
sha256 pin of a pixel tensor, and the C0 processor rows' wiring (tokenizer choice, appended to a plain C0 run)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Iterator

import torch

from parity.errors import SetupError
from parity.report import CheckResult


def pixels_sha256(x: torch.Tensor) -> str:
    return hashlib.sha256(x.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def sha256_check(name: str, px: torch.Tensor, shape: list[int], sha256: str) -> CheckResult:
    """All pixels pinned by their shape and sha256 (the golden case stores a few rows, not the whole tensor)."""
    ok = list(px.shape) == shape and pixels_sha256(px) == sha256
    return CheckResult(name, ok, detail="sha256 of all pixels equal" if ok else "sha256 / shape differ")


def image_from(stored: torch.Tensor, kind: str):
    """The object a case's upstream call received, rebuilt from its stored tensor."""
    if kind == "pil":
        from PIL import Image
        return Image.fromarray(stored.numpy())
    if kind == "u8_hwc_np":
        return stored.numpy()
    return stored


def golden_sides(case, sides: tuple[str, ...], make_side: Callable) -> Iterator[tuple[str, object]]:
    """(side name, that side's processor adapter) built on the case's recorded tokenizer, per requested side."""
    for side in sides:
        try:
            s = make_side(side, case.path / "upstream")
        except ImportError as e:
            raise SetupError(f"golden case {case.path}: {e} (install the `text` extra)") from None
        yield side, s


def tokenizer_dir_for_rows(tokenizer_dir: Path | None, golden: Path, family: str,
                           progress: Callable[[str], None]) -> Path | None:
    """The tokenizer the C0 token rows use, or None (rows left out, said) without the `tokenizers` package."""
    try:
        import tokenizers  # noqa: F401
        return tokenizer_dir or golden
    except ImportError:
        progress(f"[{family} C0] processor token rows left out: `tokenizers` is not installed (the `text` extra)")
        return None


def with_processor_rows(run_c0: Callable, processor_checks: Callable) -> Callable:
    """The family's C0 runner plus the processor rows (on a plain run: no checkpoint, no planted fault)."""
    def run(variants, checkpoint, device, dtypes, seed, fault, progress, **kw):
        report = run_c0(variants, checkpoint, device, dtypes, seed, fault, progress, **kw)
        if checkpoint is None and fault is None:
            report.checks += processor_checks(progress)
        return report
    run.__doc__ = run_c0.__doc__
    return run


class ProcessorSide:
    """One side's processor module (`mod`) and instance (`proc`); a family's subclass names the two modules and the
    processor class, and adds the renaming methods its probe uses (the sides share no code)."""
    MODULES: dict[str, str] = {}   # side ("reference" / "optimized") -> processor module
    PROCESSOR = ""                 # the processor class in both modules

    def __init__(self, side: str, tokenizer_dir: Path | None):
        import importlib
        self.side = side
        if side not in self.MODULES:
            raise SetupError(f"unknown side {side!r}")
        mod = importlib.import_module(self.MODULES[side])
        self.mod, self.proc = mod, getattr(mod, self.PROCESSOR)(tokenizer_dir)


def golden_prompts(case, side: str, tokenize: Callable, results: list[CheckResult]) -> Iterator[tuple[str, object]]:
    """(name, tokenize(prompt entry)) per golden prompt of the case; a call that raises is that prompt's ids row
    failing (appended to `results`)."""
    for p in case.meta.get("params", {}).get("prompts", []):
        name = p["name"]
        try:
            out = tokenize(p)
        except Exception as e:  # an exception is that check failing
            results.append(CheckResult(f"{case.name}/{side}:ids_{name}", False, detail=f"{type(e).__name__}: {e}"))
            continue
        yield name, out


def on_both_sides(name: str, run: Callable, ref, opt, checks: list[CheckResult]) -> tuple | None:
    """(run(ref), run(opt)), or None when a call raises: that is the row `name` failing (appended to `checks`)."""
    try:
        return run(ref), run(opt)
    except Exception as e:
        checks.append(CheckResult(name, False, detail=f"{type(e).__name__}: {e}"))
        return None


def c0_sides(make_side: Callable, tokenizer_dir: Path | None, golden: Path, family: str,
             progress: Callable[[str], None]) -> tuple[Path | None, object, object]:
    """(tokenizer for the token rows or None, reference side, optimized side) for a family's C0 processor rows."""
    tok_dir = tokenizer_dir_for_rows(tokenizer_dir, golden, family, progress)
    return tok_dir, make_side("reference", tok_dir), make_side("optimized", tok_dir)
