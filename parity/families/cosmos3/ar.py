"""cosmos3 C1 for the AR (reasoning) loop: reference `reason` (full recompute per token) vs the engine's
ARDecodeLoop (block KV cache, batched decode): per-token logits and identical tokens, solo, batched with other
reasoning requests, and mixed with denoise requests in one scheduler; plus the reason_then_generate program."""

from __future__ import annotations

from dataclasses import replace

import torch

from manifests import ManifestError
from manifests.cosmos3 import Cosmos3Config, canonical_key_shapes
from manifests.cosmos3.reasoning import ReasonRequest
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig
from parity.errors import SetupError
from parity.families.cosmos3 import cases as case_lib
from parity.families.cosmos3.common import load_reference
from parity.metrics import compare, within
from parity.report import CheckResult

import optimized
from reference.cosmos3 import generate
from reference.cosmos3.reasoner import reason, und_logits

NEW_TOKENS = case_lib.AR_TOKENS


def ar_requests(cfg: Cosmos3Config, matrix: str = "ci", seed: int = 0) -> list[ReasonRequest]:
    """Short greedy / top-k / top-p requests and the long top-k / top-p ones of rule `sampling` (cases.py)."""
    return case_lib.ar_requests(cfg, matrix, seed)


def denoise_request(cfg: Cosmos3Config, seed: int) -> Cosmos3GenerateRequest:
    g = torch.Generator().manual_seed(seed)
    return Cosmos3GenerateRequest(
        text_ids=torch.randint(0, cfg.vocab_size, (6,), generator=g),
        negative_text_ids=torch.randint(0, cfg.vocab_size, (3,), generator=g), latent_frames=2, latent_height=4,
        latent_width=4, num_steps=3, guidance_scale=4.0, seed=seed, scheduler=UniPCConfig(flow_shift=10.0))


def compare_reasoning(name: str, got: dict, want, tol) -> list[CheckResult]:
    same = got["tokens"] == want.tokens
    checks = [CheckResult(f"{name}:tokens", same, detail=f"{len(want.tokens)} tokens identical" if same else
                          f"engine {got['tokens']} vs reference {want.tokens}")]
    n = min(len(got["logits"]), len(want.logits))
    per_token = [compare(got["logits"][i], want.logits[i]) for i in range(n)]
    bad = [i for i, m in enumerate(per_token) if not within(m, tol)]
    worst = max(per_token, key=lambda m: m.rel_l2)
    c = CheckResult(f"{name}:logits", not bad and n == len(want.logits), worst, tol,
                    detail=f"{n} tokens", divergence=f"token {bad[0]} ({'prefill' if bad[0] == 0 else 'decode'})"
                    if bad else None)
    c.extra = {"per_token_rel_l2": [m.rel_l2 for m in per_token], "per_token_max_abs": [m.max_abs for m in per_token]}
    return checks + [c]


def ar_checks(prefix: str, cfg: Cosmos3Config, state, reference, dtype, device, tol, tol_c1,
              progress, reqs: list[ReasonRequest] | None = None) -> list[CheckResult]:
    checks: list[CheckResult] = []
    reqs = reqs if reqs is not None else ar_requests(cfg)
    wants = [reason(reference, r) for r in reqs]

    progress(f"[cosmos3 C1] {prefix}: reasoning solo and batched")
    for i, (r, want) in enumerate(zip(reqs, wants)):
        eng = optimized.Engine.from_state_dict(cfg, state, device, dtype, kv_block_size=4)
        try:
            got = eng.reason(r, record_logits=True)
        except RuntimeError as e:  # a failed engine request is a failed check, not a crash of the run
            checks.append(CheckResult(f"{prefix}/ar/solo{i}:tokens", False, detail=str(e)))
            continue
        checks += compare_reasoning(f"{prefix}/ar/solo{i}", got, want, tol)
    eng = optimized.Engine.from_state_dict(cfg, state, device, dtype, kv_block_size=4)
    handles = [eng.submit_reasoning(r, record_logits=True) for r in reqs]
    eng.run_until_idle()
    for i, (h, want) in enumerate(zip(handles, wants)):
        if h.status != "completed":
            checks.append(CheckResult(f"{prefix}/ar/batched{i}:tokens", False,
                                      detail=f"engine request {h.status}: {h.record.error}"))
            continue
        checks += compare_reasoning(f"{prefix}/ar/batched{i}", h.result(), want, tol)

    progress(f"[cosmos3 C1] {prefix}: reasoning mixed with denoising in one scheduler")
    eng = optimized.Engine.from_state_dict(cfg, state, device, dtype, kv_block_size=4)
    ticks: dict[str, set[int]] = {"ar": set(), "denoise": set()}
    eng.subscribe(lambda ev: ticks["ar" if ev.data.get("loop") == "cosmos3.ar_decode" else "denoise"].add(ev.tick),
                  prefix="trace.step")
    dn = [denoise_request(cfg, 40 + k) for k in range(2)]
    h_dn = [eng.submit(d, record_trajectory=True) for d in dn]
    h_ar = [eng.submit_reasoning(r, record_logits=True) for r in reqs]
    eng.run_until_idle()
    for i, (h, want) in enumerate(zip(h_ar, wants)):
        if h.status != "completed":
            checks.append(CheckResult(f"{prefix}/ar/mixed{i}", False, detail=f"engine request {h.status}"))
            continue
        checks += compare_reasoning(f"{prefix}/ar/mixed{i}", h.result(), want, tol)
    for k, (d, h) in enumerate(zip(dn, h_dn)):
        if h.status != "completed":  # an engine failure is a failed check, not a crash of the harness
            checks.append(CheckResult(f"{prefix}/ar/mixed_denoise{k}:vision", False,
                                      detail=f"engine request {h.status}: {h.record.error}"))
            continue
        want_v = generate(reference, d).vision
        m = compare(h.result()["latents"]["vision"], want_v)
        checks.append(CheckResult(f"{prefix}/ar/mixed_denoise{k}:vision", within(m, tol_c1), m, tol_c1))
    shared = ticks["ar"] & ticks["denoise"]
    checks.append(CheckResult(f"{prefix}/ar/interleaved", bool(shared) and all(h.status == "completed" for h in
                                                                                 h_ar + h_dn),
                              detail=f"{len(shared)} scheduler ticks ran AR tokens and denoise steps together; "
                                     f"all requests completed"))

    progress(f"[cosmos3 C1] {prefix}: reason_then_generate on one instance")
    eng = optimized.Engine.from_state_dict(cfg, state, device, dtype, kv_block_size=4)
    template = denoise_request(cfg, 50)
    prog = eng.reason_then_generate(reqs[0], template)
    try:
        out = prog.result()
    except RuntimeError as e:  # a failed engine request
        return checks + [CheckResult(f"{prefix}/ar/reason_then_generate", False, detail=str(e))]
    want_gen = generate(reference, replace(template, text_ids=out["reasoning"]["text_ids"])).vision
    m = compare(out["generation"]["latents"]["vision"], want_gen)
    checks.append(CheckResult(f"{prefix}/ar/reason_then_generate:vision", within(m, tol_c1), m, tol_c1,
                              detail="generation prompt = prompt + reasoned tokens"))
    misses = eng.model.stats.und_cache_misses  # the generator's only miss must be its negative prompt
    reused = out["reasoning"]["und_kv_exported"] and misses == 1
    checks.append(CheckResult(f"{prefix}/ar/reason_then_generate:und_cache_reused", reused,
                              detail="the reasoning's K/V served the generator's prompt from step 0" if reused else
                              f"exported={out['reasoning']['und_kv_exported']}, und cache misses={misses}"))
    return checks


# ------------------------------------------------------------------------------------------------
# Upstream golden probe `cosmos3.reason` (transformers Cosmos3OmniForConditionalGeneration, text only)
# ------------------------------------------------------------------------------------------------

def golden_reason_probe(case, sides) -> list[CheckResult]:
    from converters import ConversionError, convert_to_state_dict

    try:
        cfg, partial = convert_to_state_dict("cosmos3", case.meta["upstream_format"], case.path / "upstream")
        req = ReasonRequest(case.inputs["input_ids"], int(case.meta["params"]["max_new_tokens"])).validate(cfg)
    except (ConversionError, ManifestError, KeyError) as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    # a reasoner checkpoint fills the und pathway, embeddings, final norm and lm_head; the generator parts are
    # never read by reasoning, so they are zero-filled only to satisfy the loaders' strict key check
    state = {k: partial.get(k, torch.zeros(shape)) for k, shape in canonical_key_shapes(cfg).items()}
    out, tol = case.outputs, case.tolerance
    results = []
    for side in sides:
        name = f"{case.name}/{side}"
        if side == "reference":
            model = load_reference(cfg, state, "cpu", torch.float32)
            with torch.no_grad():
                prompt_logits = und_logits(model, req.prompt_ids).float()
            res = reason(model, req)
            tokens, step_logits = res.tokens, res.logits
        else:
            eng = optimized.Engine.from_state_dict(cfg, state, kv_block_size=4)
            got = eng.reason(req, record_logits=True)
            tokens, step_logits = got["tokens"], got["logits"]
            prompt_logits = None  # the engine exposes next-token logits only; prefill covers the last row
        if prompt_logits is not None:
            m = compare(prompt_logits, out["prompt_logits"])
            results.append(CheckResult(f"{name}:prompt_logits", within(m, tol), m, tol))
        m = compare(torch.stack(step_logits), out["step_logits"]) if len(step_logits) == len(out["step_logits"]) \
            else None
        results.append(CheckResult(f"{name}:step_logits", m is not None and within(m, tol), m, tol,
                                   detail="" if m is not None else f"{len(step_logits)} steps"))
        same = tokens == out["greedy_tokens"].tolist()
        results.append(CheckResult(f"{name}:greedy_tokens", same,
                                   detail="" if same else f"{tokens} vs upstream {out['greedy_tokens'].tolist()}"))
    return results


PROBES = {"cosmos3.reason": golden_reason_probe}
