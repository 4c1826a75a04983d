"""cosmos3 model plane: which canonical keys feed the transformer and how they are rewritten at load.

Declared load-time transforms (and nothing else happens to the weights):
  * per layer and pathway, q/k/v projections fused row-wise into one `qkv` weight (and bias);
  * silu backbones: gate_proj and up_proj fused row-wise into one `gate_up` weight;
  * `time_embed.*` kept fp32 whatever the run dtype (upstream `_keep_in_fp32_modules=["time_embedder"]`);
  * every other key cast to the run dtype under its canonical name.
"""

from __future__ import annotations

from manifests.cosmos3.config import Cosmos3Config
from manifests.cosmos3.keys import canonical_key_shapes, fp32_keys

from optimized.runtime.spec import CacheContract, ComponentSpec, LoadTransform, ModelSpec

MODEL_ID = "cosmos3"
TRANSFORMER = "transformer"
UND_KV_CACHE = "und_kv"
UND_KV_CONTRACT_VERSION = "cosmos3.und_kv.v1"

PATHWAYS = ("und", "gen")


def _transformer_transforms(cfg: Cosmos3Config) -> tuple[LoadTransform, ...]:
    shapes = canonical_key_shapes(cfg)
    keep_fp32 = set(fp32_keys(cfg))
    fused: set[str] = set()
    transforms: list[LoadTransform] = []
    for i in range(cfg.num_layers):
        for path in PATHWAYS:
            p = f"layers.{i}.{path}."
            params = ("weight", "bias") if cfg.attention_bias else ("weight",)
            for param in params:
                src = tuple(f"{p}{x}_proj.{param}" for x in "qkv")
                transforms.append(LoadTransform(f"fuse_qkv.{i}.{path}.{param}", src, f"{p}qkv.{param}", "fuse_rows"))
                fused.update(src)
            if cfg.hidden_act == "silu":
                src = (f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight")
                transforms.append(LoadTransform(f"fuse_gate_up.{i}.{path}", src, f"{p}mlp.gate_up.weight",
                                                "fuse_rows"))
                fused.update(src)
    for k in shapes:
        if k in fused:
            continue
        if k in keep_fp32:
            transforms.append(LoadTransform(f"keep_fp32.{k}", (k,), k, "cast", dtype="float32"))
        else:
            transforms.append(LoadTransform(f"cast.{k}", (k,), k, "cast"))
    return tuple(transforms)


def transformer_component(cfg: Cosmos3Config) -> ComponentSpec:
    return ComponentSpec(
        component_id=TRANSFORMER,
        kind="omni_mot_transformer",
        key_shapes=tuple(canonical_key_shapes(cfg).items()),
        transforms=_transformer_transforms(cfg),
    ).validate()


UND_KV_CONTRACT = CacheContract(
    cache_id=UND_KV_CACHE,
    component_id=TRANSFORMER,
    key_fields=("model_id", "component_id", "weights_version", "precision", "parallel_plan_hash",
                "shape_signature", "layout_signature", "input_hashes", "cache_contract_version"),
    invalidated_by=("weights_version", "precision", "text_ids", "config", "mrope_layout", "device"),
    version=UND_KV_CONTRACT_VERSION,
    description="per-layer und keys-for-gen and values after RoPE, [num_layers, L_text, K, d] each; "
                "depends only on the text ids, weights, precision and config, so constant across denoise steps",
)


def cosmos3_model_spec(cfg: Cosmos3Config) -> ModelSpec:
    cfg.validate()
    return ModelSpec(
        model_id=MODEL_ID,
        family="cosmos3",
        components=(transformer_component(cfg),),
        caches=(UND_KV_CONTRACT,),
    ).validate()
