"""Readable single-device cosmos3: the generator transformer and its packed-sequence builder."""

from reference.cosmos3.model import Cosmos3Transformer, load_transformer, run_layer
from reference.cosmos3.packing import PackedSample, pack_sample

__all__ = ["Cosmos3Transformer", "PackedSample", "load_transformer", "pack_sample", "run_layer"]
