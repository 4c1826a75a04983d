"""wan LoRA golden probe `wan.generate_lora` (golden/wan/lora_*, tools/make_lora_goldens.py): diffusers 0.42.1
WanPipeline with a diffusers-format LoRA (`load_lora_weights`, then `set_adapters` or `fuse_lora`) on the weights
and request of a base `wan.generate` case (case.json `base_case`), against
    reference   the LoRA merged into the base weights (reference/wan/lora.py), then the reference pipeline
    optimized   the engine with the LoRA file loaded as it is: per request (`lora` refs on the request, applied per
                row at run time) or merged (`engine.loras.merge`: a new weights version), as the case's `fused` says
Rows per side: the final latents; plus, once, `base_differs`: the LoRA must move the base case's latents by far more
than the tolerance (else the case pins nothing)."""

from __future__ import annotations

import dataclasses
import json

from safetensors import SafetensorError
from safetensors.torch import load_file

from manifests import ManifestError
from manifests.lora import LoraRef
from manifests.wan.model import WanModelConfig
from manifests.wan.sampling import WanGenerateRequest
from parity.errors import SetupError
from parity.family import golden_probe
from parity.metrics import compare
from parity.report import CheckResult, tensor_check as check

from optimized.engine import Engine
from reference.wan.lora import merge_lora
from reference.wan.pipeline import WanReferencePipeline


def base_case(case):
    """(config, weights by component, request, base latents) of the case's `base_case` (a wan.generate case)."""
    base = case.path.parent / str(case.meta.get("base_case", ""))
    try:
        P = json.loads((base / "case.json").read_text())["params"]
        cfg = WanModelConfig.from_dict(P["model_config"])
        weights = {}
        for comp in ("transformer", "text_encoder", "vae"):
            state = load_file(str(sorted((base / "upstream" / comp).glob("*.safetensors"))[0]))
            state.pop("encoder.embed_tokens.weight", None)   # transformers' tied duplicate of shared.weight
            weights[comp] = state
        inp = load_file(str(base / "inputs.safetensors"))
        request = WanGenerateRequest(
            text_ids=inp["text_ids"], negative_text_ids=inp["negative_text_ids"], num_frames=P["num_frames"],
            height=P["height"], width=P["width"], num_steps=P["num_inference_steps"],
            guidance_scale=P["guidance_scale"], seed=P["seed"], solver=P["solver"], flow_shift=P["flow_shift"])
        base_latents = load_file(str(base / "outputs.safetensors"))["latents"]
    except (OSError, KeyError, IndexError, ValueError, SafetensorError, ManifestError) as e:
        raise SetupError(f"golden case {case.path}: cannot read its base case {base.name!r} ({e})") from None
    return cfg, weights, request, base_latents


@golden_probe(("latents",))
def golden_lora_probe(case, sides) -> list[CheckResult]:
    from manifests.lora_files import load_adapter

    cfg, weights, request, base_latents = base_case(case)
    P = case.params
    try:
        name, scale, fused, lora_file = P["adapter_name"], float(P["scale"]), bool(P["fused"]), P["lora_file"]
    except KeyError as e:
        raise SetupError(f"golden case {case.path}: params lacks {e}") from None
    want, tol = case.outputs["latents"], case.tolerance
    results = []
    moved = compare(base_latents, want)
    results.append(CheckResult(f"{case.name}/base_differs", (moved.rel_l2 or 0) > 100 * (tol.rel_l2 or 0), moved,
                               detail=f"the LoRA moves the base case's latents by rel_l2 {moved.rel_l2:.3g} (must "
                                      f"exceed 100 x the tolerance)"))
    for side in sides:
        if side == "reference":
            adapter = load_adapter(case.path / lora_file, "wan", cfg)
            got = WanReferencePipeline(cfg, merge_lora(weights, [(adapter, scale)])).generate(request).latents
        else:
            engine = Engine.from_weights(cfg, weights)
            engine.loras.load(name, case.path / lora_file)
            if fused:
                engine.loras.merge(name, scale)
                got = engine.generate(request)["latents"]["vision"]
            else:
                got = engine.generate(dataclasses.replace(request, lora=(LoraRef(name, scale),)))["latents"]["vision"]
        results.append(check(f"{case.name}/{side}:latents", got, want, tol,
                             "lora" + (" (merged)" if fused and side == "optimized" else "")))
    return results


PROBES = {"wan.generate_lora": golden_lora_probe}
