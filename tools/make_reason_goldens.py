"""Golden cases for probe `cosmos3.reason`: transformers' `Cosmos3OmniForConditionalGeneration` (the reasoner:
Qwen3-VL text model = cosmos3's und pathway + final norm + lm_head) on tiny configs with seeded random weights,
text-only input.

    python tools/make_reason_goldens.py --out golden/cosmos3      # needs the `upstream` extra (transformers)

Each case: case.json, upstream/ (save_pretrained, transformers layout incl. a tiny vision tower),
inputs.safetensors {input_ids int64 [L]}, outputs.safetensors {prompt_logits fp32 [L, V] (one forward over the
prompt), greedy_tokens int64 [N] (generate, do_sample=False), step_logits fp32 [N, V] (the logits that chose
each greedy token)}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

CASES = {
    "reason_silu": dict(text=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=96, vocab_size=128, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_theta": 5e6, "rope_type": "default",
                                                   "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
                        prompt_len=9, new_tokens=6, seed=8101),
    "reason_gqa3": dict(text=dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                                  head_dim=8, intermediate_size=64, vocab_size=96, rms_norm_eps=1e-5,
                                  rope_parameters={"rope_theta": 1e6, "rope_type": "default",
                                                   "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
                        prompt_len=13, new_tokens=5, seed=8102),
}
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, deepstack_visual_indexes=[0])


def build_case(name: str, spec: dict, out: Path) -> None:
    import transformers
    from safetensors.torch import save_file
    from transformers import Cosmos3OmniConfig, Cosmos3OmniForConditionalGeneration

    torch.manual_seed(spec["seed"])
    text = spec["text"]
    cfg = Cosmos3OmniConfig(text_config=text, vision_config={**VISION, "out_hidden_size": text["hidden_size"]})
    model = Cosmos3OmniForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():  # every weight random and non-trivial: zeros or ones would hide mapping bugs
        for pname, p in model.named_parameters():
            x = torch.randn(p.shape, generator=g)
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * x)
            elif p.ndim == 1:
                p.copy_(0.1 * x)
            else:
                p.copy_(x / max(p.shape[-1], 1) ** 0.5 * (0.5 if "embed" in pname or "lm_head" in pname else 1.0))
    ids = torch.randint(0, text["vocab_size"], (1, spec["prompt_len"]), generator=g)
    with torch.no_grad():
        prompt_logits = model(input_ids=ids).logits[0].float()
        gen = model.generate(input_ids=ids, max_new_tokens=spec["new_tokens"], do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = gen.sequences[0, ids.shape[1]:]
    step_logits = torch.stack([l[0].float() for l in gen.logits])
    case = out / name
    (case / "upstream").mkdir(parents=True, exist_ok=True)
    model.save_pretrained(case / "upstream", safe_serialization=True)
    save_file({"input_ids": ids[0].contiguous()}, str(case / "inputs.safetensors"))
    save_file({"prompt_logits": prompt_logits.contiguous(), "greedy_tokens": tokens.contiguous(),
               "step_logits": step_logits.contiguous()}, str(case / "outputs.safetensors"))
    meta = {"family": "cosmos3", "probe": "cosmos3.reason",
            "upstream": {"package": "transformers", "version": transformers.__version__,
                         "class": "Cosmos3OmniForConditionalGeneration", "torch": torch.__version__},
            "upstream_format": "transformers", "dtype": "float32", "seed": spec["seed"],
            "tolerance": {"rel_l2": 1e-5}, "params": {"max_new_tokens": spec["new_tokens"]},
            "description": f"text-only reasoning: {text['num_hidden_layers']} layers, hidden {text['hidden_size']}, "
                          f"{text['num_attention_heads']}/{text['num_key_value_heads']} heads, greedy "
                          f"{spec['new_tokens']} tokens"}
    (case / "case.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {case}: prompt {spec['prompt_len']} tokens, greedy {tokens.tolist()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("golden/cosmos3"))
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("make_reason_goldens: needs transformers (pip install -e '.[upstream]')")
    torch.set_num_threads(1)
    for name, spec in CASES.items():
        if args.only in (None, name):
            build_case(name, spec, args.out)


if __name__ == "__main__":
    main()
