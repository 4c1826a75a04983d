"""LoRA in serving: `fvgen --lora FILE[:scale]` (repeatable). The HTTP `lora` field and `/v1/loras` endpoints are
not wired yet (see the helper report); the engine side they would call is `engine.loras` (optimized/adapters)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from manifests.lora import LoraRef, parse_lora_spec


def apply_cli_loras(engine: Any, request: Any, specs: list[str] | None) -> Any:
    """Load each `FILE[:scale]` into the engine (named after the file) and return the request using them; a bad
    file or spec raises ValueError (fvgen: exit 2, nothing ran)."""
    if not specs:
        return request
    if not any(f.name == "lora" for f in dataclasses.fields(request)):
        raise ValueError(f"--lora: {engine.family.name} requests take no LoRA adapters")
    refs = []
    for spec in specs:
        path, scale = parse_lora_spec(spec)
        adapter = engine.loras.load(_name(path, [r.name for r in refs]), path)
        refs.append(LoraRef(adapter.name, scale).validate())
    return dataclasses.replace(request, lora=tuple(refs))


def _name(path: str, taken: list[str]) -> str:
    base = "".join(c if c.isalnum() or c in "._-" else "-" for c in Path(path).stem)[:60].lstrip("._-") or "lora"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    return name
