"""seedvr2's canonical layout (discovered by manifests/layouts.py): the NaDiT (3B dit_v2 / 7B dit)."""

from __future__ import annotations

import re

from manifests.layouts import ComponentLayout, FamilyLayout
from manifests.seedvr2 import config as sc
from manifests.seedvr2 import keys as sk

LAYOUT = FamilyLayout(
    name="seedvr2",
    components=(
        ComponentLayout("seedvr2", "transformer", sc.NaDiTConfig.from_dict, sk.nadit_key_shapes, sk.nadit_fp32_keys,
                        load_variant=sc.load_variant, list_variants=sc.list_variants,
                        config_mappings={"seedvr2_upstream_nadit_config": sc.nadit_from_upstream_config},
                        layer_key=re.compile(r"^blocks\.(\d+)\."), num_layers_field="num_layers"),
    ),
)
