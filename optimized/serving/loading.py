"""What fvgen, the HTTP server and `fvgen workflow` share: the engine from `--model` / `--variant` (`load_engine`),
the device and variant checks, the usage error (exit 2) and the progress printer. Its own module so that none of
the three CLIs imports another to get them (fvgen starts the server and the workflow runner; they never import
fvgen back)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEVICES = ("cpu", "cuda")


class UsageError(Exception):
    """Exit 2."""


def _family_names() -> list[str]:
    from optimized.registry import families
    return sorted(families())


def resolve_variant(entry: Any, variant: str) -> str:
    names = entry.list_variants()
    if variant in names:
        return variant
    if variant == "tiny":  # the family's smallest text-to-video variant
        tiny = sorted(v for v in names if v.startswith("tiny"))
        for pick in ([v for v in tiny if "t2v" in v], tiny):
            if pick:
                return pick[0]
    raise UsageError(f"{entry.name} has no variant {variant!r}; variants: {', '.join(names)}")


def check_device(device: str) -> None:
    """cpu, cuda or cuda:N, and CUDA only where it is available (UsageError otherwise)."""
    import torch
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in DEVICES:
        raise UsageError(f"--device {device!r}: must be one of cpu, cuda, cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine")


def load_engine(family: str | None, model: str | None, variant: str | None, device: str = "cpu",
                dtype: str = "fp32", plan: str = "none", seed: int = 0) -> Any:
    import torch

    from optimized import Engine
    from optimized.registry import UnknownFamily
    from optimized.registry import family as family_entry
    if plan not in ("none", "", None):
        raise UsageError(f"--plan {plan!r}: only 'none' (one device, no parallel plan) is supported by fvgen yet")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_device(device)
    if (model is None) == (variant is None):
        raise UsageError("give exactly one of --model OUT (a converted checkpoint) or --variant NAME (random weights)")
    tdtype = getattr(torch, DTYPES[dtype])
    if variant is not None:
        from optimized.registry import split_variant   # 'wan:tiny' names its family (variants are per family)
        try:
            family, variant = split_variant(variant, family)
        except UnknownFamily as e:
            raise UsageError(f"--variant: {e}") from None
        if family is None:
            raise UsageError(f"--variant needs the family: fvgen {{{','.join(_family_names())}}} --variant ...")
        try:
            entry = family_entry(family)
        except UnknownFamily:
            raise UsageError(f"unknown family {family!r}; families: {', '.join(_family_names())}") from None
        name = resolve_variant(entry, variant)
        engine = Engine.from_variant(name, seed=seed, device=device, dtype=tdtype, family=entry.name)
        engine.__dict__["variant"] = name
        return engine
    if not Path(model).exists():
        raise UsageError(f"--model {model}: no such directory")
    from manifests.errors import ManifestError
    try:
        engine = Engine.from_checkpoint(model, device=device, dtype=tdtype)
    except ManifestError as e:
        raise UsageError(str(e)) from None
    if family is not None and engine.family.name != family:
        raise UsageError(f"--model {model} holds a {engine.family.name} model, not {family}")
    engine.__dict__["checkpoint_path"] = str(model)   # where the processor finds the tokenizer files
    return engine


class Progress:
    """Progress per stage on stderr. A terminal gets one redrawn bar per stage ('[denoise] ########------  6/8');
    anything else (a log file, a pipe) gets plain lines, one per stage start and at every 10% ('denoise: 6/8 steps'):
    no carriage returns in a file."""

    def __init__(self, stream=None, width: int = 24, quiet: bool = False, tty: bool | None = None):
        self.stream = sys.stderr if stream is None else stream
        self.width, self.quiet = width, quiet
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self.totals: dict[str, int | None] = {}
        self.current: str | None = None
        self.logged = -1                  # the last tenth logged (non-TTY)

    def __call__(self, ev: Any) -> None:
        if self.quiet:
            return
        if ev.kind == "request.stage":
            self._close()
            self.current = ev.data["stage"]
            self.totals[self.current] = ev.data.get("total")
            self.logged = -1
            self._draw(0)
        elif ev.kind == "progress":
            self._draw(ev.data["step"])
        elif ev.kind.startswith("request.") and ev.kind != "request.accepted":
            self._close()
            if ev.kind != "request.completed":
                print(f"{ev.kind.split('.')[1]}: {ev.data.get('error', '')}", file=self.stream)

    def _draw(self, done: int) -> None:
        total = self.totals.get(self.current) or max(done, 1)
        unit = "steps" if self.current == "denoise" else "chunks"
        if not self.tty:
            tenth = 10 * min(done, total) // total
            if tenth > self.logged:   # the stage's start, then each 10% reached (its end included)
                self.logged = tenth
                self.stream.write(f"{self.current}: {done}/{total} {unit}\n")
                self.stream.flush()
            return
        fill = int(self.width * min(done, total) / total)
        self.stream.write(f"\r[{self.current:>7}] {'#' * fill}{'-' * (self.width - fill)} {done:>3}/{total} {unit}")
        self.stream.flush()

    def _close(self) -> None:
        if self.current is not None:
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()
            self.current = None
