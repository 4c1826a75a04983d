"""cosmos3 processors: prompt -> token ids and conditioning pixels, each side's own processor.

Golden probe `cosmos3.processor` (cases golden/cosmos3/proc_*: ids and pixels recorded from diffusers'
Cosmos3OmniPipeline with a locally built tokenizer in `upstream/`): every id list equal, every pixel tensor equal
(bitwise: max_abs 0). C0 rows (`processor_checks`): reference vs optimized on the same inputs, exact. Token rows
need the `tokenizers` package (the `text` extra); without it they are left out and the progress line says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from parity.processor_checks import (ProcessorSide, c0_sides, golden_prompts, golden_sides, image_from, on_both_sides,
                                     sha256_check, with_processor_rows)
from parity.report import CheckResult

GOLDEN_TOKENIZER = Path(__file__).resolve().parents[3] / "golden" / "cosmos3" / "proc_wordlevel_tiny" / "upstream"


def exact_check(name: str, got: Any, want: Any) -> CheckResult:
    """Equal ids / bitwise-equal pixels; the detail says where the first difference is."""
    if isinstance(want, torch.Tensor):
        got = torch.as_tensor(got)
        if got.shape != want.shape or got.dtype != want.dtype:
            return CheckResult(name, False, detail=f"shape/dtype {tuple(got.shape)} {got.dtype} != "
                                                   f"{tuple(want.shape)} {want.dtype}")
        diff = (got != want) if not want.is_floating_point() else (got.view(torch.int32) != want.view(torch.int32))
        if bool(diff.any()):
            first = [int(i) for i in diff.nonzero()[0]]
            extra = f", max_abs {float((got - want).abs().max()):.3g}" if want.is_floating_point() else ""
            return CheckResult(name, False, detail=f"{int(diff.sum())} of {want.numel()} differ, first at {first}{extra}")
        return CheckResult(name, True, detail=f"exact ({want.numel()} values)")
    ok = got == want
    return CheckResult(name, ok, detail="exact" if ok else f"{got!r} != {want!r}")


# ------------------------------------------------------------------------------------------------
# the two sides behind one small adapter (they share no code; the adapter only renames)
# ------------------------------------------------------------------------------------------------

class Side(ProcessorSide):
    """One side's processor behind the names the probe uses (the sides share no code; the adapter only renames)."""
    MODULES = {"reference": "reference.cosmos3.processor", "optimized": "optimized.models.cosmos3.processor"}
    PROCESSOR = "Cosmos3Processor"

    def tokenize(self, **kw) -> tuple[list[int], list[int]]:
        return self.proc.tokenize_prompt(**kw)

    def i2v(self, image, height: int, width: int) -> torch.Tensor:
        if self.side == "reference":
            return self.mod.conditioning_image(image, height, width)
        return self.proc.conditioning_image(image, height, width)

    def action(self, clip, tier: int, num_frames: int) -> tuple[torch.Tensor, list[int]]:
        """(pixels [1, 3, F, H, W], [canvas_h, canvas_w, content_h, content_w])."""
        if self.side == "reference":
            a = self.mod.action_conditioning(clip, tier, num_frames)
            return a.frames, [*a.canvas, *a.content]
        a = self.proc.action_canvas(clip, tier, num_frames)
        return a.pixels, [*a.canvas_hw, *a.content_hw]


def clip_from(stored: torch.Tensor, kind: str):
    return [image_from(f, kind) for f in stored] if kind == "pil" else stored


# ------------------------------------------------------------------------------------------------
# golden probe
# ------------------------------------------------------------------------------------------------

def _prompt_kwargs(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "name"}


def golden_probe(case, sides: tuple[str, ...]) -> list[CheckResult]:
    params = case.meta.get("params", {})
    results: list[CheckResult] = []
    for side, s in golden_sides(case, sides, Side):
        for name, (cond, uncond) in golden_prompts(case, side, lambda p: s.tokenize(**_prompt_kwargs(p)), results):
            results.append(exact_check(f"{case.name}/{side}:cond_ids_{name}", torch.tensor(cond),
                                       case.outputs[f"cond_ids_{name}"]))
            results.append(exact_check(f"{case.name}/{side}:uncond_ids_{name}", torch.tensor(uncond),
                                       case.outputs[f"uncond_ids_{name}"]))
        for im in params.get("i2v", []):
            name = im["name"]
            got = s.i2v(image_from(case.inputs[f"image_{name}"], im["kind"]), im["height"], im["width"])
            results.append(exact_check(f"{case.name}/{side}:pixels_{name}", got, case.outputs[f"pixels_{name}"]))
        for a in params.get("action", []):
            name = a["name"]
            px, canvas = s.action(clip_from(case.inputs[f"clip_{name}"], a["kind"]), a["tier"], a["num_frames"])
            results.append(exact_check(f"{case.name}/{side}:canvas_{name}", torch.tensor(canvas),
                                       case.outputs[f"canvas_{name}"]))
            lo, hi = a["band_rows"]
            results.append(exact_check(f"{case.name}/{side}:band_{name}", px[..., lo:hi, :],
                                       case.outputs[f"band_{name}"]))
            results.append(sha256_check(f"{case.name}/{side}:pixels_{name}", px, a["shape"], a["sha256"]))
    return results


PROBES = {"cosmos3.processor": golden_probe}


# ------------------------------------------------------------------------------------------------
# C0 rows: reference vs optimized
# ------------------------------------------------------------------------------------------------

C0_PROMPTS = [
    dict(prompt="a cat walks on the beach at sunset", negative_prompt=None, num_frames=93, height=480, width=832),
    dict(prompt="", negative_prompt="", num_frames=1, height=256, width=256),
    dict(prompt="the robot arm picks up a red cube...", negative_prompt="blurry.", num_frames=17, height=32,
         width=48, fps=16.0, use_system_prompt=False),
    dict(prompt="pick up the cube", negative_prompt=None, num_frames=61, height=320, width=256, fps=2.0,
         action_mode="policy", action_view_point="wrist_view"),
]


def _c0_images() -> list[tuple[str, Callable[[Side], Any]]]:
    from PIL import Image

    g = torch.Generator().manual_seed(7)
    u8 = torch.randint(0, 256, (3, 45, 61), generator=g, dtype=torch.uint8)
    pil = Image.fromarray(torch.randint(0, 256, (70, 90, 3), generator=g, dtype=torch.uint8).numpy())
    f01 = torch.rand(3, 50, 140, generator=g)
    return [("i2v_uint8", lambda s: s.i2v(u8, 32, 48)),
            ("i2v_pil", lambda s: s.i2v(pil, 64, 64)),
            ("action_pil_tier256", lambda s: s.action([pil, pil], 256, 3)),
            ("action_tensor_tier256", lambda s: s.action(f01[None], 256, 2))]


def processor_checks(progress: Callable[[str], None] = lambda m: None,
                     tokenizer_dir: Path | None = None) -> list[CheckResult]:
    """C0: the two processors on the same prompts (ids) and images (pixels), compared exactly."""
    checks: list[CheckResult] = []
    tok_dir, ref, opt = c0_sides(Side, tokenizer_dir, GOLDEN_TOKENIZER, "cosmos3", progress)
    if tok_dir is not None:
        for i, kw in enumerate(C0_PROMPTS):
            name = f"processor/prompt{i}"
            both = on_both_sides(name, lambda side: side.tokenize(**kw), ref, opt, checks)
            if both is None:
                continue
            (rc, ru), (oc, ou) = both
            checks.append(exact_check(f"{name}:cond_ids", torch.tensor(oc), torch.tensor(rc)))
            checks.append(exact_check(f"{name}:uncond_ids", torch.tensor(ou), torch.tensor(ru)))
    for name, run in _c0_images():
        both = on_both_sides(f"processor/{name}", run, ref, opt, checks)
        if both is None:
            continue
        r, o = both
        if isinstance(r, tuple):
            checks.append(exact_check(f"processor/{name}:canvas", torch.tensor(o[1]), torch.tensor(r[1])))
            r, o = r[0], o[0]
        checks.append(exact_check(f"processor/{name}:pixels", o, r))
    return checks


def with_processor_checks(run_c0: Callable) -> Callable:
    """The family's C0 runner plus the processor rows (on a plain run: no checkpoint, no planted fault)."""
    return with_processor_rows(run_c0, lambda progress: processor_checks(progress))
