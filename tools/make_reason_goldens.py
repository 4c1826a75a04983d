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


# --------------------------------------------------------------------------------------------------------------
# probe `cosmos3.sampling`: the sampling filters (temperature, top-k, top-p) exactly as transformers' generate
# builds and applies them for do_sample=True


V_SAMPLING = 24
SAMPLING_SEED = 8103
# one filter setting per row of the output: which logits row, and the request's temperature / top_k / top_p
SAMPLING_SETTINGS = (
    dict(row=0, temperature=1.0, top_k=5, top_p=1.0),    # top-k alone: the k-th token survives
    dict(row=1, temperature=0.7, top_k=3, top_p=1.0),    # a tie AT the k-th value: every tied token survives
    dict(row=1, temperature=1.0, top_k=4, top_p=1.0),    # k-th value tied with the (k-1)-th and (k+1)-th
    dict(row=2, temperature=0.5, top_k=0, top_p=0.8),    # temperature then top-p: sharper -> fewer kept
    dict(row=2, temperature=2.0, top_k=0, top_p=0.6),    # temperature then top-p: flatter -> more kept
    dict(row=0, temperature=0.6, top_k=8, top_p=0.7),    # all three, upstream's order
    dict(row=3, temperature=1.7, top_k=10, top_p=0.75),  # all three, temperature > 1
    dict(row=3, temperature=0.4, top_k=6, top_p=0.9),    # all three, temperature < 1
    # the two top-p edges (`edge` names what the maker proves about the setting; the probe ignores it)
    dict(row=4, temperature=0.7, top_k=0, top_p=0.7, edge="tie_at_cut"),    # cut inside the tie 9 = 20
    dict(row=4, temperature=1.5, top_k=6, top_p=0.82, edge="tie_order"),    # cut inside the tie 3 = 15
    dict(row=5, temperature=0.5, top_k=0, top_p=0.75, edge="exact_mass"),   # top_p = p(4) + p(17) exactly
)
LN2 = 0.6931471805599453


def sampling_logits() -> torch.Tensor:
    """Rows: 0 and 3 random (std 2); 1 with ties (values 4, 3, 2, 2, 2 at the top, the k-th of k=3 and k=4 tied);
    2 a slowly decaying ladder (temperature moves many tokens across a top-p cut); 4 two tied pairs below the top
    (2: 2.0, 9 = 20: 1.0, 3 = 15: 0.0, the rest ~ -3) for top-p cuts inside a tie; 5 dyadic (after temperature 0.5:
    probabilities 1/2, 1/4, 1/8, 1/16, 1/16 at 4, 17, 10, 1, 22, exactly 0 elsewhere) for top_p on a mass."""
    g = torch.Generator().manual_seed(SAMPLING_SEED)
    r0 = 2.0 * torch.randn(V_SAMPLING, generator=g)
    tied = torch.randn(V_SAMPLING, generator=g) * 0.5 - 1.0
    top = torch.tensor([4.0, 3.0, 2.0, 2.0, 2.0])
    r1 = tied.clone()
    r1[torch.randperm(V_SAMPLING, generator=g)[:5]] = top  # the tied tokens spread over the vocabulary
    r2 = (3.0 - 0.35 * torch.arange(V_SAMPLING, dtype=torch.float32))[torch.randperm(V_SAMPLING, generator=g)]
    r3 = 2.0 * torch.randn(V_SAMPLING, generator=g)
    r4 = torch.randn(V_SAMPLING, generator=g) * 0.5 - 3.0
    r4[2], r4[[9, 20]], r4[[3, 15]] = 2.0, 1.0, 0.0
    r5 = torch.full((V_SAMPLING,), -200.0)  # exp underflows to exactly 0 in fp32
    r5[[4, 17, 10, 1, 22]] = torch.tensor([0.0, -0.5, -1.0, -1.5, -1.5]) * LN2  # / 0.5: -j ln2, exact halving
    return torch.stack([r0, r1, r2, r3, r4, r5]).contiguous()


def _support(x: torch.Tensor) -> frozenset:
    return frozenset(torch.isfinite(x).nonzero().flatten().tolist())


def _alternatives(row: torch.Tensor, t: float, k: int, p: float) -> dict[str, frozenset]:
    """Supports a port gets by the two slips the case must separate (computed here only to prove the case
    discriminates; never stored): top-k with `<=` at the k-th value, temperature after the filters."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    ids = torch.zeros(1, 1, dtype=torch.long)
    out = {}
    if k:
        x = row[None] / t
        kth = torch.topk(x, k).values[..., -1:]
        out["top_k_drops_kth"] = _support(x.masked_fill(x <= kth, float("-inf"))[0])
    if p < 1:
        x = row[None].clone()
        if k:
            x = TopKLogitsWarper(k)(ids, x)
        out["temperature_last"] = _support(TopPLogitsWarper(p)(ids, x)[0])
    return out


def _old_top_p(x: torch.Tensor, p: float) -> torch.Tensor:
    """The repo's rule before these edges were pinned: descending stable sort of the probabilities, drop a token
    whose preceding cumulative mass exceeds p."""
    probs, order = torch.sort(x.softmax(-1), descending=True, stable=True)
    return x.clone().index_fill(0, order[(probs.cumsum(-1) - probs) > p], float("-inf"))


def _ascending_top_p(x: torch.Tensor, p: float, stable: bool, strict: bool) -> torch.Tensor:
    """Upstream's arithmetic with one edge changed: a stable sort (ties in index order), or `<` at 1 - p."""
    values, order = torch.sort(x, stable=stable)
    cum = values.softmax(-1).cumsum(-1)
    drop = cum < 1 - p if strict else cum <= 1 - p
    drop[-1] = False
    return x.index_fill(0, order[drop], float("-inf"))


def _check_edge(i: int, edge: str, before: torch.Tensor, p: float, kept: frozenset) -> str:
    """Prove a top-p edge setting sits on its edge and that upstream's result there differs from the rule it
    replaces (and, per edge, from upstream's arithmetic with that one edge changed)."""
    old = _support(_old_top_p(before, p))
    values = before.sort().values
    cum = values.softmax(-1).cumsum(-1)
    if edge in ("tie_at_cut", "tie_order"):
        cut_ties = [v for v in values.unique() if torch.isfinite(v) and 0 < sum(int(before[j] == v) for j in kept)
                    < int((before == v).sum())]
        assert cut_ties, f"setting {i}: the top-p cut is not inside a group of tied values"
        stable = _support(_ascending_top_p(before, p, stable=True, strict=False))
        if edge == "tie_at_cut":
            assert old != kept, f"setting {i}: the old rule keeps upstream's tokens {sorted(kept)}"
        else:
            assert stable != kept, f"setting {i}: a stable ascending sort keeps upstream's tokens {sorted(kept)}"
        return f"tie at the cut: upstream {sorted(kept)}, old rule {sorted(old)}, stable sort {sorted(stable)}"
    assert edge == "exact_mass", edge
    probs = before.softmax(-1)
    assert set(probs[probs > 0].tolist()) <= {0.5, 0.25, 0.125, 0.0625}, f"setting {i}: not dyadic"
    assert bool((cum == torch.tensor(1 - p, dtype=cum.dtype)).any()), f"setting {i}: 1 - top_p is no cumulative mass"
    strict = _support(_ascending_top_p(before, p, stable=False, strict=True))
    assert old != kept and strict != kept, f"setting {i}: the exact mass does not separate the rules"
    return f"top_p on a mass: upstream {sorted(kept)}, old rule {sorted(old)}, `<` {sorted(strict)}"


def _top_p_margin(scores_before_top_p: torch.Tensor, p: float) -> float:
    """Distance of top_p from every cumulative mass of the distribution top-p sees (the cut must not sit on a
    rounding edge, where a cumulative sum in another order could round across it)."""
    probs = scores_before_top_p.softmax(-1).sort(descending=True).values
    cum = probs.cumsum(-1)
    return float((cum - p).abs().min())


def build_sampling_case(out: Path) -> None:
    import transformers
    from safetensors.torch import save_file
    from transformers import Cosmos3OmniConfig, Cosmos3OmniForConditionalGeneration, GenerationConfig
    from transformers.generation.logits_process import LogitsProcessorList

    # a tiny model only to ask transformers' own generate path which processors it applies, in which order
    text = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                intermediate_size=16, vocab_size=V_SAMPLING,
                rope_parameters={"rope_theta": 1e4, "rope_type": "default", "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True})
    torch.manual_seed(SAMPLING_SEED)
    cfg = Cosmos3OmniConfig(text_config=text, vision_config={**VISION, "out_hidden_size": 16})
    model = Cosmos3OmniForConditionalGeneration(cfg).eval()
    logits = sampling_logits()
    prompt = torch.tensor([[1, 2, 3]])
    probs, chains, notes = [], [], []
    for i, s in enumerate(SAMPLING_SETTINGS):
        gc = GenerationConfig(do_sample=True, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
                              max_new_tokens=1, eos_token_id=None, pad_token_id=0, output_logits=True,
                              output_scores=True, return_dict_in_generate=True)
        procs = model._get_logits_processor(generation_config=gc, input_ids_seq_length=prompt.shape[1],
                                            encoder_input_ids=prompt, logits_processor=LogitsProcessorList(),
                                            device="cpu")
        # the same list must be what generate applies: its raw logits through `procs` give its scores exactly
        with torch.no_grad():
            g = model.generate(input_ids=prompt, generation_config=gc)
        assert torch.equal(procs(prompt, g.logits[0].float()), g.scores[0].float()), f"setting {i}: generate differs"
        row = logits[s["row"]]
        scores = procs(prompt, row[None].clone())[0]
        chains.append([type(pr).__name__ for pr in procs])
        # every non-trivial setting must separate upstream from the slips it targets
        kept = _support(scores)
        for slip, alt in _alternatives(row, s["temperature"], s["top_k"], s["top_p"]).items():
            assert alt != kept or (slip == "temperature_last" and s["temperature"] == 1.0), (i, slip)
        if s["top_p"] < 1:
            before = LogitsProcessorList(procs[:-1])(prompt, row[None].clone())[0]  # what TopPLogitsWarper receives
            if s.get("edge"):
                notes.append(f"s{i} {_check_edge(i, s['edge'], before, s['top_p'], kept)}")
            if s.get("edge") != "exact_mass":
                margin = _top_p_margin(before, s["top_p"])
                assert margin > 1e-3, f"setting {i}: top_p {s['top_p']} within {margin:.1e} of a cumulative mass"
                notes.append(f"s{i} top-p margin {margin:.3f}")
        probs.append(scores.softmax(-1))
        notes.append(f"s{i} keeps {len(kept)}")
    case = out / "reason_sampling_warpers"
    (case / "upstream").mkdir(parents=True, exist_ok=True)
    (case / "upstream" / "logits_processors.json").write_text(json.dumps(
        [{"setting": i, "processors": c} for i, c in enumerate(chains)], indent=1) + "\n")
    save_file({"logits": logits}, str(case / "inputs.safetensors"))
    save_file({"probs": torch.stack(probs).contiguous()}, str(case / "outputs.safetensors"))
    meta = {"family": "cosmos3", "probe": "cosmos3.sampling",
            "upstream": {"package": "transformers", "version": transformers.__version__,
                         "class": "GenerationMixin._get_logits_processor (do_sample=True)",
                         "torch": torch.__version__},
            "upstream_format": "logits_processors", "dtype": "float32", "seed": SAMPLING_SEED,
            "tolerance": {"rel_l2": 1e-6}, "params": {"settings": list(SAMPLING_SETTINGS)},
            "description": "the AR sampling filters against transformers' generate: temperature, top-k (ties at "
                           "the k-th value), top-p, in upstream's order, and top-p's edges (a cut inside tied "
                           "probabilities, top_p equal to a cumulative mass); probs = softmax of the processed "
                           "scores"}
    (case / "case.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {case}: {'; '.join(notes)}")


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
    if args.only in (None, "reason_sampling_warpers"):
        build_sampling_case(args.out)


if __name__ == "__main__":
    main()
