"""wan model plane: the VAE, DiT and UMT5 components (canonical keys, load transforms), the text-embedding cache
contract, and the VAE loop ids.

Declared load-time transforms:
  * VAE: every canonical key cast to the run dtype under its canonical name (RMS-norm scales sqrt(C) * gamma are
    derived values, recomputed at load, never stored);
  * DiT: per block, attn1 to_q/to_k/to_v fused row-wise into `attn1.qkv` (weight and bias), attn2 to_k/to_v into
    `attn2.kv`, and with the image branch add_k_proj/add_v_proj into `attn2.add_kv`; upstream's
    `_keep_in_fp32_modules` keys pinned to fp32; every other key cast to the run dtype;
  * UMT5: per layer q/k/v fused into `SelfAttention.qkv`, wi_0/wi_1 into `DenseReluDense.wi`; `wo` pinned to fp32
    (upstream `_keep_in_fp32_modules=["wo"]`); every other key cast.
"""

from __future__ import annotations

from manifests.wan import WanVAEConfig, canonical_key_shapes
from manifests.wan.dit import UMT5Config, WanDiTConfig, dit_fp32_keys, dit_key_shapes, umt5_key_shapes

from optimized.runtime.spec import CacheContract, ComponentSpec, LoadTransform, ModelSpec

MODEL_ID = "wan.vae"
VAE = "vae"
DECODE_LOOP = "wan.vae_decode"
ENCODE_LOOP = "wan.vae_encode"


def vae_component(cfg: WanVAEConfig) -> ComponentSpec:
    shapes = canonical_key_shapes(cfg)
    return ComponentSpec(
        component_id=VAE,
        kind=f"wan{cfg.version}_vae",
        key_shapes=tuple(shapes.items()),
        transforms=tuple(LoadTransform(f"cast.{k}", (k,), k, "cast") for k in shapes),
    ).validate()


def wan_vae_model_spec(cfg: WanVAEConfig) -> ModelSpec:
    return ModelSpec(model_id=MODEL_ID, family="wan", components=(vae_component(cfg),)).validate()


# ---------------------------------------------------------------------------------------------------------------------
# DiT and UMT5 text encoder (the denoise runtime path)
# ---------------------------------------------------------------------------------------------------------------------
DIT = "transformer"
TEXT_ENCODER = "text_encoder"
TEXT_EMBED_CACHE = "wan.text_embeds"
TEXT_EMBED_CONTRACT_VERSION = "wan.text_embeds.v1"

# The DiT's fp32 keys are the canonical model's (manifests/wan/dit.py dit_fp32_keys, which fvconvert reads too).
# (upstream) transformers UMT5PreTrainedModel._keep_in_fp32_modules (the FFN output projection).
UMT5_KEEP_FP32_MODULES = ("wo",)


def _keep_fp32(key: str, modules: tuple[str, ...]) -> bool:
    return any(m in key.split(".") for m in modules)


def _dit_transforms(cfg: WanDiTConfig) -> tuple[LoadTransform, ...]:
    shapes = dit_key_shapes(cfg)
    fp32 = set(dit_fp32_keys(cfg))
    fused: set[str] = set()
    out: list[LoadTransform] = []
    for i in range(cfg.num_layers):
        b = f"blocks.{i}"
        groups = [(f"{b}.attn1", ("to_q", "to_k", "to_v"), "qkv"),     # self-attention: one [3D, D] projection
                  (f"{b}.attn2", ("to_k", "to_v"), "kv")]                # cross-attention: text K/V in one [2D, D]
        if cfg.has_image_branch:
            groups.append((f"{b}.attn2", ("add_k_proj", "add_v_proj"), "add_kv"))   # image K/V in one [2D, D]
        for prefix, parts, name in groups:
            for param in ("weight", "bias"):
                src = tuple(f"{prefix}.{p}.{param}" for p in parts)
                out.append(LoadTransform(f"fuse_{name}.{i}.{param}", src, f"{prefix}.{name}.{param}", "fuse_rows"))
                fused.update(src)
    for k in shapes:
        if k in fused:
            continue
        if k in fp32:
            out.append(LoadTransform(f"keep_fp32.{k}", (k,), k, "cast", dtype="float32"))
        else:
            out.append(LoadTransform(f"cast.{k}", (k,), k, "cast"))
    return tuple(out)


def dit_component(cfg: WanDiTConfig, component_id: str = DIT) -> ComponentSpec:
    """The DiT: attn1 q/k/v fused as `attn1.qkv`, attn2 k/v as `attn2.kv` (+ `attn2.add_kv` with the image branch),
    upstream's fp32 modules pinned to fp32, every other key cast to the run dtype under its canonical name."""
    cfg.validate()
    return ComponentSpec(
        component_id=component_id,
        kind="wan_dit",
        key_shapes=tuple(dit_key_shapes(cfg).items()),
        transforms=_dit_transforms(cfg),
    ).validate()


def _umt5_transforms(cfg: UMT5Config) -> tuple[LoadTransform, ...]:
    shapes = umt5_key_shapes(cfg)
    fused: set[str] = set()
    out: list[LoadTransform] = []
    for i in range(cfg.num_layers):
        a = f"encoder.block.{i}.layer.0.SelfAttention"
        src = tuple(f"{a}.{p}.weight" for p in "qkv")
        out.append(LoadTransform(f"fuse_qkv.{i}", src, f"{a}.qkv.weight", "fuse_rows"))   # one [3*inner, d] projection
        f = f"encoder.block.{i}.layer.1.DenseReluDense"
        src2 = (f"{f}.wi_0.weight", f"{f}.wi_1.weight")
        out.append(LoadTransform(f"fuse_wi.{i}", src2, f"{f}.wi.weight", "fuse_rows"))    # gate and linear in one GEMM
        fused.update(src + src2)
    for k in shapes:
        if k in fused:
            continue
        if _keep_fp32(k, UMT5_KEEP_FP32_MODULES):
            out.append(LoadTransform(f"keep_fp32.{k}", (k,), k, "cast", dtype="float32"))
        else:
            out.append(LoadTransform(f"cast.{k}", (k,), k, "cast"))
    return tuple(out)


def umt5_component(cfg: UMT5Config, component_id: str = TEXT_ENCODER) -> ComponentSpec:
    """The UMT5 encoder: q/k/v fused as `qkv`, wi_0/wi_1 fused as `wi`, `wo` kept fp32 (upstream), rest cast."""
    cfg.validate()
    return ComponentSpec(
        component_id=component_id,
        kind="umt5_encoder",
        key_shapes=tuple(umt5_key_shapes(cfg).items()),
        transforms=_umt5_transforms(cfg),
    ).validate()


TEXT_EMBED_CONTRACT = CacheContract(
    cache_id=TEXT_EMBED_CACHE,
    component_id=TEXT_ENCODER,
    key_fields=("model_id", "component_id", "weights_version", "precision", "shape_signature", "layout_signature",
                "input_hashes", "cache_contract_version"),
    invalidated_by=("weights_version", "precision", "text_ids", "config", "device"),
    version=TEXT_EMBED_CONTRACT_VERSION,
    description="one prompt's UMT5 output trimmed to its length, [len, d_model]; depends only on the ids, weights, "
                "precision, config and device, so an RL group of K samples of one prompt encodes once",
)
