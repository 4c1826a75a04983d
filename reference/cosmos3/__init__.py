"""Readable single-device cosmos3: the generator transformer, its packed-sequence builder, UniPC and the
generation loop."""

from reference.cosmos3.model import Cosmos3Transformer, load_transformer, run_layer
from reference.cosmos3.packing import PackedSample, pack_sample
from reference.cosmos3.sampler import GenerateResult, generate
from reference.solvers.unipc import UniPCFlow, flow_schedule

__all__ = ["Cosmos3Transformer", "GenerateResult", "PackedSample", "UniPCFlow", "flow_schedule", "generate",
           "load_transformer", "pack_sample", "run_layer"]
