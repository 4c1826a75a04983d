"""wan UMT5 C0: the reference `UMT5Encoder` + `encode_prompts` vs the optimized `UMT5Fast` (fused projections,
content-hash cache), and the upstream golden probe `wan.umt5`.

Rows per model, per dtype (prompts of 5, 11 and 1 tokens, one of exactly max_sequence_length and one longer, which
both sides truncate):
    hidden_states      the raw encoder on the padded batch + attention mask, every row (padded rows are computed
                       from masked attention: not zero)
    prompt_embeds      WanPipeline's trimmed, zero-padded embeddings, whole tensor
    real_rows          the same, each prompt's own rows only (what carries signal)
    padding_zeroed     rows after each prompt's length: ZERO BY CONSTRUCTION (WanPipeline zero-pads them); checked
                       exactly 0 on both sides, not by a metric
    cache              the same prompts again: served from the cache (no encoder call), bitwise equal; one prompt
                       alone bitwise equal to its row in the batch
"""

from __future__ import annotations

import torch

from manifests.parity import Tolerance
from manifests.wan import UMT5Config
from parity.errors import SetupError
from parity.families.wan.common import convert_upstream, ids as random_ids
from parity.family import golden_probe
from parity.metrics import compare, within
from parity.report import CheckResult, tensor_check as check

from reference.wan import encode_prompts

PADDING = "text_encoder.padding"


def prompt_lengths(L: int) -> tuple[int, ...]:
    return tuple(dict.fromkeys(n for n in (5, 11, 1, L, L + 3) if n >= 1))


def padded_batch(ids_list: list[torch.Tensor], L: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    ids = torch.zeros(len(ids_list), L, dtype=torch.long)
    mask = torch.zeros(len(ids_list), L, dtype=torch.long)
    lengths = []
    for i, t in enumerate(ids_list):
        t = t[:L]
        ids[i, :len(t)], mask[i, :len(t)] = t, 1
        lengths.append(len(t))
    return ids, mask, lengths


def padding_divergence(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, tol: Tolerance) -> str:
    if tuple(got.shape[:2]) != tuple(mask.shape):  # e.g. trimmed to the longest prompt instead of padded to L
        return f"{PADDING} (embeddings are {list(got.shape)}: not padded to {mask.shape[1]} rows)"
    real = mask.bool()
    if (got[~real] != 0).any():
        return f"{PADDING} (rows after each prompt's length are not zero: max |x| {got[~real].abs().max():.2e})"
    m = compare(got[real], want[real])
    return "text_encoder.forward" if not within(m, tol) else "text_encoder (trim / pad layout)"


def umt5_checks(prefix: str, cfg: UMT5Config, reference, fast, tol: Tolerance, device: str, seed: int, L: int,
                progress) -> list[CheckResult]:
    lengths = prompt_lengths(L)
    ids_list = [random_ids(n, seed + 40 + i, cfg.vocab_size) for i, n in enumerate(lengths)]
    ids, mask, kept = padded_batch(ids_list, L)
    checks: list[CheckResult] = []
    progress(f"[wan C0] {prefix}: UMT5, prompts of {list(lengths)} tokens padded to {L}")

    with torch.no_grad():
        want_h = reference(ids.to(device), mask.to(device))
    got_h = fast.forward(ids, mask)
    checks.append(check(f"{prefix}/hidden_states", got_h, want_h, tol, divergence="text_encoder.forward",
                        detail="raw encoder, padded rows included (computed, not zero)"))

    fast.clear_cache()
    want = encode_prompts(reference, ids_list, L)
    got = fast.encode(ids_list, L)
    c = check(f"{prefix}/prompt_embeds", got, want, tol,
              detail=f"{len(lengths)} prompts, kept {kept} of {L} rows (the others zero by construction: see "
                     f"padding_zeroed)")
    if not c.passed:
        c.divergence = padding_divergence(got, want, mask.to(got.device), tol)
    checks.append(c)
    real = mask.bool().to(got.device)
    checks.append(check(f"{prefix}/real_rows", got[real], want[real], tol, divergence="text_encoder.forward",
                        detail="each prompt's own rows only"))
    pad_got, pad_want = got[~real], want[~real]
    zero = bool((pad_got == 0).all()) and bool((pad_want == 0).all())
    checks.append(CheckResult(
        f"{prefix}/padding_zeroed", zero,
        detail=f"{pad_got.shape[0]} padded rows are zero by construction (WanPipeline): checked exactly 0 on both "
               f"sides" if zero else f"padded rows not zero: optimized max |x| {pad_got.abs().max():.2e}, "
                                     f"reference {pad_want.abs().max():.2e}",
        divergence=None if zero else f"{PADDING} (rows after each prompt's length)"))

    calls = fast.stats.forward_calls
    again = fast.encode(ids_list, L)
    alone = fast.encode([ids_list[1]], L)
    ok = torch.equal(again, got) and fast.stats.forward_calls == calls and torch.equal(alone[0], got[1])
    checks.append(CheckResult(f"{prefix}/cache", ok,
                              detail="second encode served from the cache (no encoder call) and bitwise equal; a "
                                     "prompt alone equals its row in the batch" if ok else
                                     f"cache / batch independence broken ({fast.stats.forward_calls - calls} encoder "
                                     f"calls on a repeat)"))
    return checks


# ------------------------------------------------------------------------------------------------
# Upstream golden probe `wan.umt5` (transformers UMT5EncoderModel + WanPipeline._get_t5_prompt_embeds)
# ------------------------------------------------------------------------------------------------

@golden_probe(required=("hidden_states", "prompt_embeds"))
def golden_umt5_probe(case, sides) -> list[CheckResult]:
    """inputs input_ids / attention_mask [B, Lmax] -> outputs hidden_states and prompt_embeds on each side; a
    documented input or output missing from the case fails the case."""
    from optimized.models.wan.text_encoder import UMT5Fast
    from reference.wan import load_umt5

    cfg, state = convert_upstream(case, case.path / "upstream")
    if not isinstance(cfg, UMT5Config):
        raise SetupError(f"golden case {case.path}: upstream/ is not a UMT5 encoder")
    L = case.meta.get("params", {}).get("max_sequence_length")
    if not isinstance(L, int) or L < 1:
        raise SetupError(f"golden case {case.path}: params.max_sequence_length must be a positive int")
    missing = [f"inputs {k}" for k in ("input_ids", "attention_mask") if k not in case.inputs]
    missing += [f"outputs {k}" for k in ("hidden_states", "prompt_embeds") if k not in case.outputs]
    if missing:
        return [CheckResult(f"{case.name}/{side}", False, detail=f"case lacks {', '.join(missing)}") for side in sides]
    ids, mask, tol = case.inputs["input_ids"], case.inputs["attention_mask"], case.tolerance
    prompts = [ids[b][mask[b] == 1] for b in range(ids.shape[0])]
    results = []
    for side in sides:
        if side == "reference":
            model = load_umt5(cfg, state)
            with torch.no_grad():
                hidden = model(ids, mask)
            embeds = encode_prompts(model, prompts, L)
        else:
            model = UMT5Fast(cfg, state)
            hidden, embeds = model.forward(ids, mask), model.encode(prompts, L)
        for name, got in (("hidden_states", hidden), ("prompt_embeds", embeds)):
            m = compare(got, case.outputs[name])
            results.append(CheckResult(f"{case.name}/{side}:{name}", within(m, tol), m, tol))
    return results


PROBES = {"wan.umt5": golden_umt5_probe}
