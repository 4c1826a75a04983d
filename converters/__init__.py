"""Checkpoint conversion: upstream formats -> each family's canonical layout, driven by CheckpointManifests
(`manifests/<family>/checkpoints/<format>.json`). CLI: `fvconvert` (converters.cli:main).

    from converters import convert, load_canonical, convert_diffusers_dir_to_canonical_state_dict
    report = convert("cosmos3", "diffusers", "ckpt/transformer", "out/cosmos3-nano")
    cfg, sd = load_canonical("out/cosmos3-nano")
    convert("cosmos3", "framework", "dcp_export/model.safetensors", "out/nano", variant="nano")
    convert("cosmos3", "transformers", "Cosmos3-Nano-reasoner/", "out/nano-und")   # partial: the und part
    cfg, und = load_canonical("out/nano-und", parts=["und"])

Formats (one CheckpointManifest each): diffusers, diffusers-raw (diffusers @2aa39f7), framework (NVIDIA
cosmos-framework unified net state dict), transformers (the reasoner; fills only the `und` part).
"""

from converters.canonical import canonical_parts, load_canonical
from converters.engine import (ConversionReport, convert, convert_diffusers_dir_to_canonical_state_dict,
                               convert_to_state_dict)
from converters.errors import ConversionError
from converters.hooks import register_post_check
from converters.inspect import inspect_source
from converters.manifest import CheckpointManifest, load_manifest, load_manifest_file

__all__ = [
    "CheckpointManifest", "ConversionError", "ConversionReport", "canonical_parts", "convert", "convert_diffusers_dir_to_canonical_state_dict",
    "convert_to_state_dict", "inspect_source", "load_canonical", "load_manifest", "load_manifest_file",
    "register_post_check",
]
