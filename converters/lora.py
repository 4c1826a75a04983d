"""`fvconvert lora FAMILY SRC OUT`: any supported LoRA file (diffusers / PEFT / original / ComfyUI / kohya; the reader
is manifests/lora_files.py, shared with the engine) -> one canonical adapter file, written atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click
import torch

from manifests.lora import LoraAdapter
from manifests.lora_files import CANONICAL_META, LoraFormatError, load_adapter, model_config


def save_adapter(adapter: LoraAdapter, out: str | Path, force: bool = False) -> Path:
    """Write the canonical file atomically (a temp file in the same directory, then rename)."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.suffix != ".safetensors":
        raise LoraFormatError(f"{out}: the canonical LoRA file must end in .safetensors")
    if out.exists() and not force:
        raise LoraFormatError(f"{out} exists (use --force to replace it)")
    if not out.parent.is_dir():
        raise LoraFormatError(f"{out.parent}: no such directory")
    tensors = {}
    for comp, mods in adapter.targets.items():
        for mod, p in mods.items():
            tensors[f"{comp}.{mod}.lora_A.weight"] = p.down.contiguous()
            tensors[f"{comp}.{mod}.lora_B.weight"] = p.up.contiguous()
            tensors[f"{comp}.{mod}.alpha"] = torch.tensor(p.alpha, dtype=torch.float32)
    meta = {CANONICAL_META: json.dumps({"family": adapter.family, "source_format": adapter.source_format,
                                        "version": adapter.version, "format_version": 1}, sort_keys=True)}
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


# ------------------------------------------------------------------ fvconvert lora
@click.command("lora", short_help="Convert a LoRA file (diffusers / PEFT / original / ComfyUI / kohya).",
               context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("family")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--variant", default=None, help="The model variant the LoRA is for (checks every shape).")
@click.option("--model", "model_dir", default=None, type=click.Path(path_type=Path),
              help="A converted model directory the LoRA is for (instead of --variant).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def lora_cmd(family: str, src: Path, out: Path, variant: str | None, model_dir: Path | None, force: bool) -> int:
    """Convert the LoRA at SRC into one canonical adapter file OUT (.safetensors) for FAMILY, refusing unknown keys,
    missing halves and shapes that do not fit the model."""
    cfg = model_config(family, variant, model_dir)
    adapter = load_adapter(src, family, cfg)
    save_adapter(adapter, out, force)
    click.echo(f"{adapter.source_format} LoRA -> {out}: {len(adapter.modules())} layers, rank "
               f"{'/'.join(map(str, adapter.ranks()))}, version {adapter.version}")
    return 0
