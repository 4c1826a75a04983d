"""Wan processors: prompt -> UMT5 token ids, image -> VAE pixels and CLIP pixels, each side's own processor.

Golden probe `wan.processor` (case golden/wan/proc_umt5: ids / masks / pixels recorded from diffusers'
WanImageToVideoPipeline with a locally built Unigram tokenizer loaded as transformers' T5Tokenizer, and the default
CLIPImageProcessor): ids and masks equal, pixels bitwise equal (CLIP pixels pinned by their sha256 plus stored rows).
C0 rows (`processor_checks`): reference vs optimized, exact. Token rows need `tokenizers` (the `text` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from parity.processor_checks import (ProcessorSide, c0_sides, golden_prompts, golden_sides, image_from, on_both_sides,
                                     sha256_check, with_processor_rows)
from parity.report import CheckResult

GOLDEN_TOKENIZER = Path(__file__).resolve().parents[3] / "golden" / "wan" / "proc_umt5" / "upstream"


def exact_check(name: str, got: Any, want: torch.Tensor) -> CheckResult:
    got = torch.as_tensor(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        return CheckResult(name, False, detail=f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} "
                                               f"{want.dtype}")
    same = torch.equal(got.view(torch.int32), want.view(torch.int32)) if want.is_floating_point() \
        else torch.equal(got, want)
    if same:
        return CheckResult(name, True, detail=f"exact ({want.numel()} values)")
    diff = got != want
    first = [int(i) for i in diff.nonzero()[0]] if bool(diff.any()) else "bit pattern (-0.0 / NaN)"
    return CheckResult(name, False, detail=f"{int(diff.sum())} of {want.numel()} differ, first at {first}")


class Side(ProcessorSide):
    """One side's processor behind the names the probe uses (the sides share no code; the adapter only renames)."""
    MODULES = {"reference": "reference.wan.processor", "optimized": "optimized.models.wan.processor"}
    PROCESSOR = "WanProcessor"

    def tokens(self, prompt: str, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [L], padded ids [n], mask [n])."""
        if self.side == "reference":
            t = self.proc.tokenize(prompt, n)
            return t.ids, t.padded, t.mask
        padded, mask = self.proc.padded(prompt, n)
        return self.proc.encode([prompt], n)[0], padded, mask

    def vae(self, image, height: int, width: int) -> torch.Tensor:
        return self.mod.vae_pixels(image, height, width) if self.side == "reference" \
            else self.proc.vae_image(image, height, width)

    def clip(self, image) -> torch.Tensor:
        return self.mod.clip_pixels(image) if self.side == "reference" else self.proc.clip_image(image)


def golden_probe(case, sides: tuple[str, ...]) -> list[CheckResult]:
    params = case.meta.get("params", {})
    results: list[CheckResult] = []
    for side, s in golden_sides(case, sides, Side):
        tokens = lambda p: s.tokens(p["prompt"], p["max_sequence_length"])
        for name, (ids, padded, mask) in golden_prompts(case, side, tokens, results):
            for key, got in (("ids", ids), ("padded_ids", padded), ("mask", mask)):
                results.append(exact_check(f"{case.name}/{side}:{key}_{name}", got, case.outputs[f"{key}_{name}"]))
        for im in params.get("vae_images", []):
            name = im["name"]
            got = s.vae(image_from(case.inputs[f"image_{name}"], im["kind"]), im["height"], im["width"])
            results.append(exact_check(f"{case.name}/{side}:pixels_{name}", got, case.outputs[f"pixels_{name}"]))
        for im in params.get("clip_images", []):
            name = im["name"]
            got = s.clip(image_from(case.inputs[f"image_{name}"], im["kind"]))
            want_rows = case.outputs[f"rows_{name}"]
            results.append(exact_check(f"{case.name}/{side}:rows_{name}", got[:, :, :want_rows.shape[2]], want_rows))
            results.append(sha256_check(f"{case.name}/{side}:pixels_{name}", got, im["shape"], im["sha256"]))
    return results


PROBES = {"wan.processor": golden_probe}


C0_PROMPTS = [("plain", "a cat walks on the beach at sunset", 512), ("messy", "  Tom &amp;amp; Jerry\n\n  ", 512),
              ("empty", "", 512), ("truncated", "the robot arm picks up a red cube " * 6, 12)]


def processor_checks(progress: Callable[[str], None] = lambda m: None,
                     tokenizer_dir: Path | None = None) -> list[CheckResult]:
    """C0: reference vs optimized processors on the same prompts and images, compared exactly."""
    from PIL import Image

    checks: list[CheckResult] = []
    tok_dir, ref, opt = c0_sides(Side, tokenizer_dir, GOLDEN_TOKENIZER, "wan", progress)
    if tok_dir is not None:
        for name, prompt, n in C0_PROMPTS:
            both = on_both_sides(f"processor/{name}", lambda side: side.tokens(prompt, n), ref, opt, checks)
            if both is None:
                continue
            r, o = both
            for key, rv, ov in zip(("ids", "padded_ids", "mask"), r, o):
                checks.append(exact_check(f"processor/{name}:{key}", ov, rv))
    g = torch.Generator().manual_seed(11)
    pil = Image.fromarray(torch.randint(0, 256, (50, 70, 3), generator=g, dtype=torch.uint8).numpy())
    f01 = torch.rand(3, 24, 40, generator=g)
    # the CLIP long edge 224 * 70 / 50 = 313.6 is truncated upstream: a wide and a tall image, one per resize branch
    tall = Image.fromarray(torch.randint(0, 256, (70, 50, 3), generator=g, dtype=torch.uint8).numpy())
    for name, run in (("vae_pil", lambda s: s.vae(pil, 32, 48)), ("vae_float01", lambda s: s.vae(f01, 32, 48)),
                      ("clip_pil", lambda s: s.clip(pil)), ("clip_pil_tall", lambda s: s.clip(tall))):
        try:
            checks.append(exact_check(f"processor/{name}:pixels", run(opt), run(ref)))
        except Exception as e:
            checks.append(CheckResult(f"processor/{name}", False, detail=f"{type(e).__name__}: {e}"))
    return checks


def with_processor_checks(run_c0: Callable) -> Callable:
    """The family's C0 runner plus the processor rows (on a plain run: no checkpoint, no planted fault)."""
    return with_processor_rows(run_c0, lambda progress: processor_checks(progress))
