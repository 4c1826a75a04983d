"""wan DiT C0: the reference `WanTransformer` vs the optimized `WanDiTFast` (fused projections, cached rope
tables, one batched call), and the upstream golden probe `wan.dit`.

Rows per DiT (each expert of a two-expert model), per dtype:
    forward/<case>        full forward on the anchor cases (int / float / per-token timesteps, odd grid) and the
                          rule-generated ones of the `--cases` matrix (cases.py: timestep kinds, odd grids, one-token
                          and full-length prompts, CLIP embeddings of tiny variance); with the image branch every
                          case carries CLIP embeddings and 512 text rows. On failure the first
                          divergent traced layer is named (patch_embedding, condition_embedder[.temb/.text/.image],
                          blocks.i, proj_out), both sides traced on the same inputs.
    batched/<a|b>         two requests (different timesteps, prompts, latents) in ONE optimized call vs each alone
                          on the reference
    block/blocks.i        each block alone, fed the reference's input to it (hidden states, context, modulation)
                          and each side's own rope tables: a block's own error, not the accumulated one
    trace/<name>          (fp32) every traced tensor of the first case, in forward order
Text rows after each prompt's length are zeros (as the pipeline pads); they still pass through the text projection,
so no compared output is zero by construction. The golden probe runs each case in its dtype (float32 or bfloat16).
"""

from __future__ import annotations

import torch

from manifests.parity import Tolerance
from manifests.wan import WanDiTConfig
from parity.errors import SetupError
from parity.families.wan.cases import DIT_ANCHORS, DiTCase, dit_cases
from parity.families.wan.common import (DIT_KEEP_FP32, DiTInputs, cast_state, convert_upstream, localise_dit,
                                        run_optimized_dit, run_reference_dit)
from parity.family import golden_probe
from parity.golden import intermediate_checks, stored_intermediates
from parity.metrics import compare, within
from parity.report import CheckResult, tensor_check as check


CASES = DIT_ANCHORS   # the hand-written cases (cases.py adds the rule-generated ones)


def text_length(cfg: WanDiTConfig, max_sequence_length: int | None) -> int:
    """The text rows the DiT sees: 512 with the image branch (upstream splits the context at L - 512)."""
    return 512 if cfg.has_image_branch else (max_sequence_length or 16)


def make_inputs(cfg: WanDiTConfig, case: DiTCase, L: int, seed: int) -> DiTInputs:
    g = torch.Generator().manual_seed(seed)
    T, H, W = case.grid
    pt, ph, pw = cfg.patch_size
    latents = torch.randn(1, cfg.in_channels, T, H, W, generator=g)
    text = torch.zeros(1, L, cfg.text_dim)
    n = min(case.text_len, L)
    text[:, :n] = torch.randn(1, n, cfg.text_dim, generator=g)
    if case.timestep == "int":
        t = torch.tensor([int(case.t)], dtype=torch.int64)
    elif case.timestep == "float":
        t = torch.tensor([case.t], dtype=torch.float32)
    else:
        f, h, w = T // pt, H // ph, W // pw
        t = torch.full((f, h, w), float(case.t))
        t[0] = 0.0
        t = t.flatten()[None]
    image = case.image_std * torch.randn(1, 3, cfg.image_dim, generator=g) if cfg.has_image_branch else None
    return DiTInputs(latents, t, text, image)


def dit_checks(prefix: str, cfg: WanDiTConfig, reference, fast, tol: Tolerance, dtype: torch.dtype, device: str,
               seed: int, max_sequence_length: int | None, traces: bool, progress, matrix: str = "ci"
               ) -> list[CheckResult]:
    L = text_length(cfg, max_sequence_length)
    text_rows = max_sequence_length or L   # rows a prompt may fill (512 with the image branch: only the first L_max)
    cases = [(c, make_inputs(cfg, c, L, seed + 10 + i).to(device, dtype))
             for i, c in enumerate(dit_cases(cfg, text_rows, matrix, seed))]
    checks: list[CheckResult] = []

    progress(f"[wan C0] {prefix}: full forward, {len(cases)} cases")
    for case, x in cases:
        want = run_reference_dit(reference, x)
        got = run_optimized_dit(fast, x)
        c = check(f"{prefix}/forward/{case.name}", got, want, tol,
                  detail=f"latents {list(x.latents.shape[1:])}, {case.timestep} timestep, text {L} rows "
                         f"({case.text_len} real)" + (", per-token t = 0 on frame 0" if case.timestep == "per_token"
                                                       else "") + (f", CLIP embeddings std {case.image_std:.1e}"
                                                                   if case.image_std != 1.0 and cfg.has_image_branch
                                                                   else ""))
        if not c.passed:
            c.divergence = localise_dit(reference, fast, x, tol)
        checks.append(c)

    progress(f"[wan C0] {prefix}: two requests batched in one optimized call")
    a = make_inputs(cfg, CASES[0], L, seed + 20).to(device, dtype)
    b = make_inputs(cfg, DiTCase("b", CASES[0].grid, "int", 4, 125), L, seed + 21).to(device, dtype)
    both = run_optimized_dit(fast, DiTInputs.cat([a, b]))
    for i, (name, x) in enumerate((("a", a), ("b", b))):
        want = run_reference_dit(reference, x)
        c = check(f"{prefix}/batched/{name}", both[i:i + 1], want, tol,
                  detail=f"row {i} of one B=2 call (t = {int(x.timestep)}), vs the reference alone")
        if not c.passed:
            solo = localise_dit(reference, fast, x, tol)
            c.divergence = "batching only (solo forward agrees)" if solo.startswith("outputs only") else solo
        checks.append(c)

    checks += block_checks(prefix, cfg, reference, fast, cases[0][1], tol)
    if traces:
        want, got = {}, {}
        run_reference_dit(reference, cases[0][1], want)
        run_optimized_dit(fast, cases[0][1], got)
        for name, w in want.items():
            if name not in got:
                checks.append(CheckResult(f"{prefix}/trace/{name}", False, detail="not traced by the optimized side"))
            else:
                checks.append(check(f"{prefix}/trace/{name}", got[name], w, tol, divergence=name,
                                    detail=f"case {cases[0][0].name}, forward order"))
    return checks


def block_checks(prefix: str, cfg: WanDiTConfig, reference, fast, x: DiTInputs, tol: Tolerance
                 ) -> list[CheckResult]:
    """Each block alone on the reference's input to it; each side builds its own rope tables for the grid."""
    from reference.wan.transformer import rope_cos_sin

    rec: dict[str, torch.Tensor] = {}
    run_reference_dit(reference, x, rec)
    pt, ph, pw = cfg.patch_size
    grid = (x.latents.shape[2] // pt, x.latents.shape[3] // ph, x.latents.shape[4] // pw)
    B = x.latents.shape[0]
    hidden = rec["patch_embedding"].flatten(2).transpose(1, 2).contiguous()
    modulation = rec["condition_embedder"].unflatten(-1, (6, -1))          # [B, 6, D] or [B, S, 6, D]
    text, image = rec["condition_embedder.text"], rec.get("condition_embedder.image")
    context = text if image is None else torch.cat([image, text], dim=1)   # the reference's own context layout
    ref_rope = rope_cos_sin(cfg, grid, x.latents.device)
    checks = []
    with torch.no_grad():
        for i, block in enumerate(reference.blocks):
            want = block(hidden, context, modulation, ref_rope)
            got = fast._block_forward(fast.blocks[i], hidden, text, image, modulation, fast.rope_tables(grid))
            checks.append(check(f"{prefix}/block/blocks.{i}", got, want, tol, divergence=f"blocks.{i}",
                                detail=f"alone on the reference's input ({B} x {hidden.shape[1]} tokens)"))
            hidden = rec[f"blocks.{i}"]
    return checks


# ------------------------------------------------------------------------------------------------
# Upstream golden probe `wan.dit` (diffusers WanTransformer3DModel; golden/README.md)
# ------------------------------------------------------------------------------------------------

GOLDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@golden_probe(optional=("pred_*",))
def golden_dit_probe(case, sides) -> list[CheckResult]:
    """Each stored call k: inputs latents_k, timestep_k, text_k (+ image_embeds_k) -> pred_k, on each side, in the
    case's dtype (float32, or bfloat16 with the upstream `_keep_in_fp32_modules` kept fp32). A documented output
    missing from the case fails the case. Stored intermediates `pred_k@<module>` (diffusers module names, as both
    sides' traces name them) are compared and the first diverging one is named (golden/README.md)."""
    from optimized.models.wan.transformer import WanDiTFast
    from reference.wan import load_wan_transformer

    cfg, state = convert_upstream(case, case.path / "upstream")
    if not isinstance(cfg, WanDiTConfig):
        raise SetupError(f"golden case {case.path}: upstream/ is not a WanTransformer3DModel")
    n = case.meta.get("params", {}).get("num_calls")
    if not isinstance(n, int) or n < 1:
        raise SetupError(f"golden case {case.path}: params.num_calls must be a positive int")
    tol, results = case.tolerance, []
    dtype = GOLDEN_DTYPES.get(case.meta.get("dtype", "float32"))
    if dtype is None:
        raise SetupError(f"golden case {case.path}: dtype must be one of {', '.join(GOLDEN_DTYPES)}")
    run_state = cast_state(state, dtype, DIT_KEEP_FP32)   # as upstream loads a half-precision model
    models = {"reference": lambda: load_wan_transformer(cfg, run_state),
              "optimized": lambda: WanDiTFast(cfg, run_state, "cpu", dtype)}
    for side in sides:
        model = models[side]()
        for k in range(n):
            name = f"{case.name}/{side}:pred_{k}"
            missing = [t for t in (f"latents_{k}", f"timestep_{k}", f"text_{k}") if t not in case.inputs]
            missing += [] if f"pred_{k}" in case.outputs else [f"outputs pred_{k}"]
            if cfg.has_image_branch and f"image_embeds_{k}" not in case.inputs:
                missing.append(f"image_embeds_{k}")
            if missing:
                results.append(CheckResult(name, False, detail=f"case lacks {', '.join(missing)}"))
                continue
            x = DiTInputs(case.inputs[f"latents_{k}"], case.inputs[f"timestep_{k}"], case.inputs[f"text_{k}"],
                          case.inputs.get(f"image_embeds_{k}")).to("cpu", dtype)
            traced: dict[str, torch.Tensor] | None = {} if stored_intermediates(case, f"pred_{k}") else None
            got = run_reference_dit(model, x, traced) if side == "reference" else run_optimized_dit(model, x, traced)
            m = compare(got.float(), case.outputs[f"pred_{k}"].float())
            pred = CheckResult(name, within(m, tol), m, tol,
                               detail=f"latents {list(x.latents.shape)}, timestep {list(x.timestep.shape)}"
                                      + ("" if dtype == torch.float32 else f", {case.meta['dtype']}"))
            results.append(pred)
            if traced is not None:  # intermediates (pred_k@<diffusers module>): where the side leaves upstream
                inter = intermediate_checks(case, side, f"pred_{k}", traced, tol)
                if inter and not inter[0].passed and not pred.passed:
                    pred.divergence = inter[0].divergence
                results += inter
    return results


PROBES = {"wan.dit": golden_dit_probe}
