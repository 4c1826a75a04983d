"""ltx2's canonical layout (discovered by manifests/layouts.py): one component, the LTX2VideoTransformer3DModel."""

from __future__ import annotations

import re

from manifests.layouts import ComponentLayout, FamilyLayout
from manifests.ltx2 import config as cf
from manifests.ltx2 import keys as ks

LAYOUT = FamilyLayout(
    name="ltx2",
    components=(
        ComponentLayout("ltx2", "transformer", cf.Ltx2Config.from_dict, ks.key_shapes, ks.fp32_keys,
                        load_variant=cf.load_variant, list_variants=cf.list_variants,
                        config_mappings={"ltx2_diffusers_config": cf.Ltx2Config.from_diffusers_config},
                        layer_key=re.compile(r"^transformer_blocks\.(\d+)\."), num_layers_field="num_layers", gains=ks.GAINS),
    ),
)
