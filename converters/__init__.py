"""Checkpoint conversion: upstream formats -> each family's canonical layout, driven by CheckpointManifests
(`manifests/<family>/checkpoints/<format>.json`). CLI: `fvconvert` (converters.cli:main).

    from converters import convert, load_canonical, convert_diffusers_dir_to_canonical_state_dict
    report = convert("cosmos3", "diffusers", "ckpt/transformer", "out/cosmos3-nano")
    cfg, sd = load_canonical("out/cosmos3-nano")
"""

from converters.canonical import load_canonical
from converters.engine import (ConversionReport, convert, convert_diffusers_dir_to_canonical_state_dict,
                               convert_to_state_dict)
from converters.errors import ConversionError
from converters.hooks import register_post_check
from converters.inspect import inspect_source
from converters.manifest import CheckpointManifest, load_manifest, load_manifest_file

__all__ = [
    "CheckpointManifest", "ConversionError", "ConversionReport", "convert", "convert_diffusers_dir_to_canonical_state_dict",
    "convert_to_state_dict", "inspect_source", "load_canonical", "load_manifest", "load_manifest_file",
    "register_post_check",
]
