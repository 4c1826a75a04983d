"""cosmos3 C1 for the AR (reasoning) loop: reference `reason` (full recompute per token) vs the engine's
ARDecodeLoop (block KV cache, batched decode): per-token logits and tokens, solo, batched with other reasoning
requests, and mixed with denoise requests in one scheduler; plus the reason_then_generate program.

How tokens are compared. Both sides draw every sampled token with torch.multinomial from one CPU generator seeded
with the request's seed, one draw per token; a draw consumes the generator the same way whatever the
probabilities, so at token i both sides sample with the same seeded draws. The reference is taken along the
ENGINE's tokens (teacher-forced: its logits for the engine's context at each step, by the same full recompute as
`reason`; the engine's path is the reference's own free run up to any flip), and at every step:
  logits   the engine's logits vs the reference's for the same context: rel_l2 / cosine (C0 tolerance of the dtype)
           and max |diff| <= AR_LOGIT_NOISE (the measured per-element logit noise of the dtype);
  sampler  the reference's sampling rule on the ENGINE's logits, with the same seeded draws, picks the engine's
           token (exact at any dtype: a sampler bug fails here whatever the logit noise);
  tokens   the reference's rule on the REFERENCE's logits picks the same token, or the step was a near tie that
           the engine's own sampling reproduces (the sampler check holds) and that logit noise explains: either
             - the reference rule, same draws, picks the engine's token once that token's logit is raised by at
               most 2 x AR_LOGIT_NOISE relative to every other (the most a per-element noise of AR_LOGIT_NOISE
               can move one logit against another; found by bisection: the pick of that token is monotone in its
               own raise), or
             - the engine's logits themselves lie within AR_LOGIT_NOISE of the reference's at every element: they
               are a perturbation inside the measured noise for which the rule picks the engine's token (needed
               for sampled steps: an inverse-CDF draw and a top-p cut move with several logits at once, so one
               logit's raise is not the worst case; seen at temperature 1.5 / top-p 0.7 in bf16, logits within
               0.094 of the reference's while one logit alone needed a raise of 1.04).
           A flip explained by neither is a failure. After an accepted near tie the comparison goes on along the
           engine's tokens and the check says where the paths parted.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, replace

import torch

from manifests import ManifestError
from manifests.cosmos3 import Cosmos3Config, canonical_key_shapes
from manifests.cosmos3.reasoning import ReasonRequest
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig
from manifests.parity import Tolerance
from parity.errors import SetupError
from parity.families.cosmos3 import cases as case_lib
from parity.families.cosmos3.common import load_reference
from parity.graph_checks import capture_interleave_checks, graph_kinds_check, recording_calls
from parity.metrics import Metrics, compare, within
from parity.report import CheckResult

import optimized
from reference.cosmos3 import generate
from reference.cosmos3.reasoner import ReasonResult, choose_token, reason, und_logits

NEW_TOKENS = case_lib.AR_TOKENS

# The AR logits of each step, engine vs reference on the same context, clean code, CPU, measured 2026-12-01 with
# measure_ar_noise over tiny and tiny-edge x seeds 0-3 (ci requests) and seeds 0-1 (full requests), 12 model runs
# and ~1,800 steps per dtype; the tiny variants' logits reach |15.5| (std 4). Each tolerance = measured max x the
# margin written beside it. Larger logits (a real checkpoint) or another device: measure again before trusting it.
AR_LOGIT_NOISE = {                 # per-element max |engine - reference| (logits); also the unit of a near tie
    torch.float32: 3e-5,           # measured 1.39e-5 (2.2x)
    torch.bfloat16: 0.3,           # measured 0.203 (1.48x): ~3 bf16 ulps of the largest logits
}
AR_LOGIT_REL_L2 = {                # per step; fp32 keeps the C0 contract's 1e-5 (measured 1.13e-6)
    torch.bfloat16: 0.03,          # measured 2.03e-2 (1.48x; the C0 contract's 2.5e-2 would leave 1.23x)
}
# near ties measured on clean code: bf16 flips needed a raise of <= 0.105 (2 x noise = 0.6); fp32: no flip
RAISE_SEARCH_LIMIT = 64.0    # logits; a flip needing more is reported as "> 64"


def ar_requests(cfg: Cosmos3Config, matrix: str = "ci", seed: int = 0) -> list[ReasonRequest]:
    """Short greedy / top-k / top-p requests and the long top-k / top-p ones of rule `sampling` (cases.py)."""
    return case_lib.ar_requests(cfg, matrix, seed)


def denoise_request(cfg: Cosmos3Config, seed: int) -> Cosmos3GenerateRequest:
    g = torch.Generator().manual_seed(seed)
    return Cosmos3GenerateRequest(
        text_ids=torch.randint(0, cfg.vocab_size, (6,), generator=g),
        negative_text_ids=torch.randint(0, cfg.vocab_size, (3,), generator=g), latent_frames=2, latent_height=4,
        latent_width=4, num_steps=3, guidance_scale=4.0, seed=seed, scheduler=UniPCConfig(flow_shift=10.0))


# ------------------------------------------------------------------------------------------------
# The reference along any token path, and the token-by-token comparison
# ------------------------------------------------------------------------------------------------

class ReferenceOracle:
    """The reference's next-token logits for any context, memoised by context. Seeded with `reason`'s own free
    runs, so along the reference's path the logits ARE the ones `reason` sampled from; any other context is
    computed the way `reason` computes each token (full recompute, last row, fp32)."""

    def __init__(self, model):
        self.model = model
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def free_run(self, req: ReasonRequest) -> ReasonResult:
        res = reason(self.model, req)
        prompt = req.prompt_ids.tolist()
        for t, logits in enumerate(res.logits):
            self.memo[tuple(prompt + res.tokens[:t])] = logits
        return res

    def logits(self, context: list[int]) -> torch.Tensor:
        key = tuple(context)
        if key not in self.memo:
            with torch.no_grad():
                self.memo[key] = und_logits(self.model, torch.tensor(context))[-1].float()
        return self.memo[key]


def _pick(logits: torch.Tensor, req: ReasonRequest, state: torch.Tensor) -> int:
    """The reference's sampling rule on `logits` with the seeded draw at generator state `state`."""
    return choose_token(logits, req, torch.Generator().set_state(state))


def raise_needed(logits: torch.Tensor, token: int, req: ReasonRequest, state: torch.Tensor,
                 limit: float = RAISE_SEARCH_LIMIT) -> float:
    """The least raise of `token`'s logit (relative to every other) for which the reference rule, with the seeded
    draw at `state`, picks `token`; inf beyond `limit`. Bisection: the pick of `token` is monotone in the raise
    (its score against every other token, its top-k rank and its top-p admission only improve)."""
    def picks(delta: float) -> bool:
        x = logits.clone()
        x[token] += delta
        return _pick(x, req, state) == token
    if picks(0.0):
        return 0.0
    if not picks(limit):
        return float("inf")
    lo, hi = 0.0, limit
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if picks(mid) else (mid, hi)
    return hi


@dataclass
class ARStep:
    token: int                  # the engine's
    reference_token: int        # the reference rule on the reference's logits, same context, same draw
    rule_on_engine: int         # the reference rule on the engine's logits, same draw
    metrics: Metrics            # engine logits vs reference logits for the same context
    scale: float                # max |reference logit| of the step
    raise_needed: float = 0.0   # at a flip: the raise of the engine's token the reference needed (logits)


def trace_against_reference(got: dict, req: ReasonRequest, oracle: ReferenceOracle) -> list[ARStep]:
    """Every step of the engine's run beside the reference on the same context with the same seeded draw."""
    prompt = req.prompt_ids.tolist()
    gen = torch.Generator().manual_seed(req.seed)
    steps = []
    for t, (token, eng_logits) in enumerate(zip(got["tokens"], got["logits"])):
        ref_logits = oracle.logits(prompt + got["tokens"][:t])
        state = gen.get_state()
        ref_token = choose_token(ref_logits, req, gen)  # advances the draw exactly as `reason` does
        step = ARStep(token, ref_token, _pick(eng_logits.float().cpu(), req, state),
                      compare(eng_logits.float().cpu(), ref_logits), float(ref_logits.abs().max()))
        if ref_token != token:
            step.raise_needed = raise_needed(ref_logits, token, req, state)
        steps.append(step)
    return steps


def compare_reasoning(name: str, got: dict, req: ReasonRequest, oracle: ReferenceOracle, want: ReasonResult,
                      tol: Tolerance, noise: float) -> list[CheckResult]:
    """`tol`: the logits tolerance (its max_abs is `noise`); `want`: the reference's free run (for the detail)."""
    tokens = got["tokens"]
    if len(got["logits"]) != len(tokens):
        return [CheckResult(f"{name}:tokens", False, detail=f"{len(tokens)} tokens but {len(got['logits'])} logits "
                            f"recorded")]
    steps = trace_against_reference(got, req, oracle)
    phase = lambda i: "prefill" if i == 0 else "decode"
    margin = 2 * noise

    # the stop rule along this path: EOS ends it (kept), else exactly max_new_tokens
    eos = req.eos_token_id
    stop_ok = (len(tokens) == req.max_new_tokens and eos not in tokens[:-1]) or \
        (0 < len(tokens) <= req.max_new_tokens and tokens[-1] == eos and eos not in tokens[:-1])
    flips = [i for i, s in enumerate(steps) if s.token != s.reference_token]
    bad = [i for i in flips if _unexplained(steps[i], noise)]
    if not stop_ok:
        tok = CheckResult(f"{name}:tokens", False, detail=f"engine stopped after {len(tokens)} tokens {tokens}; "
                          f"reference rule: EOS {eos} or {req.max_new_tokens} tokens",
                          divergence=f"token {len(tokens)} (stop rule)")
    elif bad:
        i = bad[0]
        s = steps[i]
        why = (f"not a near tie: the reference picks {s.token} only with its logit raised by "
               f"{_fmt(s.raise_needed)} > 2 x noise {margin:.3g}, and the engine's logits differ by "
               f"{s.metrics.max_abs:.3g} > noise {noise:.3g}") if s.rule_on_engine == s.token else \
            (f"the rule on the engine's own logits picks {s.rule_on_engine}, not {s.token} (see :sampler; the "
             f"reference would need a raise of {_fmt(s.raise_needed)})")
        tok = CheckResult(f"{name}:tokens", False, detail=f"token {i}: engine {s.token} vs reference "
                          f"{s.reference_token}, {why}; engine {tokens} vs reference {want.tokens}",
                          divergence=f"token {i} ({phase(i)})")
    elif flips:
        ties = ", ".join(f"token {i} (raise {_fmt(steps[i].raise_needed)}, logits within "
                         f"{steps[i].metrics.max_abs:.3g})" for i in flips)
        tok = CheckResult(f"{name}:tokens", True, detail=f"{len(tokens)} tokens; near ties at {ties} (raise <= 2 x "
                          f"noise {margin:.3g} or logits within noise {noise:.3g}); compared along the engine's "
                          f"tokens after: engine {tokens} vs reference free run {want.tokens}")
    else:
        tok = CheckResult(f"{name}:tokens", True, detail=f"{len(tokens)} tokens identical")
    tok.extra = {"flips": {i: steps[i].raise_needed for i in flips}, "noise": noise}  # token -> raise needed

    off = [i for i, s in enumerate(steps) if s.rule_on_engine != s.token]
    smp = CheckResult(f"{name}:sampler", not off, detail="at every step the reference's rule on the engine's "
                      "logits, same seeded draw, picks the engine's token" if not off else f"token {off[0]}: "
                      f"engine picked {steps[off[0]].token}, the reference's rule on the engine's own logits picks "
                      f"{steps[off[0]].rule_on_engine}", divergence=f"token {off[0]} (sampling)" if off else None)

    per_token = [s.metrics for s in steps]
    out_of_tol = [i for i, m in enumerate(per_token) if not within(m, tol)]
    worst = max(per_token, key=lambda m: m.max_abs) if per_token else None
    lg = CheckResult(f"{name}:logits", bool(per_token) and not out_of_tol, worst, tol,
                     detail=f"{len(per_token)} tokens, reference on the engine's context",
                     divergence=f"token {out_of_tol[0]} ({phase(out_of_tol[0])})" if out_of_tol else None)
    lg.extra = {"per_token_rel_l2": [m.rel_l2 for m in per_token], "per_token_max_abs": [m.max_abs for m in per_token]}
    return [tok, smp, lg]


def _unexplained(step: ARStep, noise: float) -> bool:
    """A flip is accepted only as a near tie the engine's own sampling reproduces and logit noise explains: one
    logit's raise within 2 x noise, or the engine's logits as a witness within noise of the reference's."""
    explained = step.raise_needed <= 2 * noise or step.metrics.max_abs <= noise
    return not (step.rule_on_engine == step.token and explained)


def _fmt(x: float) -> str:
    return f"> {RAISE_SEARCH_LIMIT:g}" if x == float("inf") else f"{x:.3g}"


def ar_tolerance(tol: Tolerance, dtype: torch.dtype) -> tuple[Tolerance, float]:
    """The AR logits tolerance of the dtype (the C0 one, with the measured AR rel_l2 and max |diff|) and the
    measured per-element noise."""
    noise = AR_LOGIT_NOISE.get(dtype)
    if noise is None:
        raise SetupError(f"cosmos3 AR: no measured logit noise for {dtype}")
    return replace(tol, rel_l2=AR_LOGIT_REL_L2.get(dtype, tol.rel_l2), max_abs=noise), noise


def decode_graph_check(name: str, graph: str, steps: list[dict]) -> CheckResult:
    """Every AR decode step ran the asked graph kind (prefill is varlen and always eager), from trace.step."""
    kinds = [(d.get("graph"), d.get("bucket"), d.get("graph_cache")) for d in steps if d.get("phase") == "ar_token"]
    check = graph_kinds_check(name, graph, kinds)
    check.detail = f"{len(kinds)} decode steps: {check.detail}"
    return check


def ar_checks(prefix: str, cfg: Cosmos3Config, state, reference, dtype, device, tol, tol_c1,
              progress, reqs: list[ReasonRequest] | None = None, graph: str = "eager",
              plant=None) -> list[CheckResult]:
    """`graph`: the engines' graph mode (their decode steps run it; checked from trace.step); `plant(engine)`: a
    context manager planting a C1 fault in each engine built here (negative controls), or None."""
    checks: list[CheckResult] = []
    reqs = reqs if reqs is not None else ar_requests(cfg)
    tol, noise = ar_tolerance(tol, dtype)
    oracle = ReferenceOracle(reference)
    wants = [oracle.free_run(r) for r in reqs]
    compare_one = lambda name, got, i: compare_reasoning(name, got, reqs[i], oracle, wants[i], tol, noise)
    steps: list[dict] = []

    def engine():
        eng = optimized.Engine.from_state_dict(cfg, state, device, dtype, kv_block_size=4, batching="greedy")
        eng.model.configure_graph(graph)
        eng.subscribe(lambda ev: steps.append(dict(ev.data)), prefix="trace.step")
        return eng

    planted = (lambda eng: contextlib.nullcontext()) if plant is None else plant
    progress(f"[cosmos3 C1] {prefix}: reasoning solo and batched ({graph} decode steps)")
    for i, r in enumerate(reqs):
        eng = engine()
        try:
            with planted(eng):
                got = eng.reason(r, record_logits=True)
        except RuntimeError as e:  # a failed engine request is a failed check, not a crash of the run
            checks.append(CheckResult(f"{prefix}/ar/solo{i}:tokens", False, detail=str(e)))
            continue
        checks += compare_one(f"{prefix}/ar/solo{i}", got, i)
    eng = engine()
    handles = [eng.submit_reasoning(r, record_logits=True) for r in reqs]
    with planted(eng), recording_calls([eng.model]) as calls:   # the decode body's calls, for the interleave check
        eng.run_until_idle()
        checks += capture_interleave_checks(f"{prefix}/ar", calls)
    for i, h in enumerate(handles):
        if h.status != "completed":
            checks.append(CheckResult(f"{prefix}/ar/batched{i}:tokens", False,
                                      detail=f"engine request {h.status}: {h.record.error}"))
            continue
        checks += compare_one(f"{prefix}/ar/batched{i}", h.result(), i)

    checks.append(decode_graph_check(f"{prefix}/ar/graph_{graph}", graph, steps))

    progress(f"[cosmos3 C1] {prefix}: reasoning mixed with denoising in one scheduler")
    eng = engine()
    ticks: dict[str, set[int]] = {"ar": set(), "denoise": set()}
    eng.subscribe(lambda ev: ticks["ar" if ev.data.get("loop") == "cosmos3.ar_decode" else "denoise"].add(ev.tick),
                  prefix="trace.step")
    dn = [denoise_request(cfg, 40 + k) for k in range(2)]
    h_dn = [eng.submit(d, record_trajectory=True) for d in dn]
    h_ar = [eng.submit_reasoning(r, record_logits=True) for r in reqs]
    with planted(eng):
        eng.run_until_idle()
    for i, h in enumerate(h_ar):
        if h.status != "completed":
            checks.append(CheckResult(f"{prefix}/ar/mixed{i}", False, detail=f"engine request {h.status}"))
            continue
        checks += compare_one(f"{prefix}/ar/mixed{i}", h.result(), i)
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
    eng = engine()
    template = denoise_request(cfg, 50)
    prog = eng.run_program("reason_then_generate", reqs[0], template)
    try:
        with planted(eng):
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
            eng = optimized.Engine.from_state_dict(cfg, state, kv_block_size=4, batching="greedy")
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


# ------------------------------------------------------------------------------------------------
# Measuring the noise AR_LOGIT_NOISE is set from
# ------------------------------------------------------------------------------------------------

def measure_ar_noise(cfg: Cosmos3Config, state, dtype: torch.dtype, reqs: list[ReasonRequest],
                     device: str = "cpu") -> dict:
    """Clean-code AR noise of one model at one dtype: the engine run solo and batched, the reference along its
    tokens. {max_abs, max_rel_l2, steps, flips: [least raise of each flip], sampler_mismatches}."""
    reference = load_reference(cfg, state, device, dtype)
    oracle = ReferenceOracle(reference)
    for r in reqs:
        oracle.free_run(r)
    runs = [optimized.Engine.from_state_dict(cfg, state, device, dtype, kv_block_size=4,
                                             batching="greedy").reason(r, record_logits=True)
            for r in reqs]
    eng = optimized.Engine.from_state_dict(cfg, state, device, dtype, kv_block_size=4, batching="greedy")
    handles = [eng.submit_reasoning(r, record_logits=True) for r in reqs]
    eng.run_until_idle()
    runs += [h.result() for h in handles]
    steps = [s for got, r in zip(runs, reqs + reqs) for s in trace_against_reference(got, r, oracle)]
    return {"max_abs": max(s.metrics.max_abs for s in steps), "max_rel_l2": max(s.metrics.rel_l2 for s in steps),
            "max_abs_over_scale": max(s.metrics.max_abs / s.scale for s in steps),
            "scale": [min(s.scale for s in steps), max(s.scale for s in steps)],
            "steps": len(steps), "flips": [s.raise_needed for s in steps if s.token != s.reference_token],
            "sampler_mismatches": sum(s.rule_on_engine != s.token for s in steps)}
