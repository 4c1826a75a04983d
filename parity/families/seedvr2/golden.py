"""Upstream golden probes for seedvr2 (golden/seedvr2/, made by the official SeedVR code; golden/seedvr2/README.md):
seedvr2.nadit (3B / 7B forward, stored intermediates, and the bf16 conversion's dtypes), seedvr2.vae,
seedvr2.restore (the one-step restoration end to end) and seedvr2.windows (upstream's window listings)."""

from __future__ import annotations

import re

import torch

from parity.errors import SetupError, UpstreamConversionFailed
from parity.family import golden_probe
from parity.families.seedvr2.c0 import Recorder, compare_check
from parity.report import CheckResult

import optimized.models.seedvr2 as opt
import reference.seedvr2 as ref

# Upstream keeps the rotary math in fp32 by hand (models/dit_v2/rope.py and models/dit/rope.py:
# `apply_rotary_emb(freqs, q.float())` with the fp32 `rope.rope.freqs` buffer, even under bf16 autocast): a bf16
# conversion must keep those buffers fp32 (canonical name `blocks.<i>.attn.rope.freqs`).
UPSTREAM_FP32 = re.compile(r"^blocks\.\d+\.attn\.rope\.freqs$")
BLOCK_TXT = re.compile(r"^block_(\d+)_txt_3b_(\d+)$")


def _golden_weights(case, name: str, variant: str | None = None, dtype: str | None = None):
    """(config, canonical state) of upstream/<name> through fvconvert's official_pth manifest (the DiT), or the
    VAE state as stored (its upstream names are the canonical names)."""
    from converters import ConversionError, convert_to_state_dict
    path = case.path / "upstream" / name
    if not path.is_file():
        raise SetupError(f"golden case {case.path}: missing upstream/{name}")
    if variant is None:
        return None, torch.load(path, weights_only=True, map_location="cpu")
    try:
        return convert_to_state_dict("seedvr2", case.meta["upstream_format"], path, variant=variant, dtype=dtype)
    except ConversionError as e:
        raise UpstreamConversionFailed(f"golden case {case.path}: {e}") from None


def _nadit_call(model, case, k: int | list[int], **kw) -> torch.Tensor:
    ks = [k] if isinstance(k, int) else k
    a = [torch.cat([case.inputs[f"{n}_{j}"] for j in ks]) for n in ("vid", "vid_shape", "txt", "txt_shape", "timestep")]
    with torch.no_grad():
        return model(*a, **kw).float()


def bf16_dtype_errors(cfg, state: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """(wrong dtypes, number of tensors that must be fp32) of a checkpoint converted with target dtype bf16: the
    upstream fp32 rule's tensors (rope frequencies) and the loaders' fp32 keys (manifests nadit_fp32_keys) fp32,
    every other tensor bf16."""
    from manifests.seedvr2.keys import nadit_fp32_keys
    fp32 = {k for k in state if UPSTREAM_FP32.match(k)} | set(nadit_fp32_keys(cfg))
    wrong = [f"{k}: {str(v.dtype).removeprefix('torch.')} (want {'float32' if k in fp32 else 'bfloat16'})"
             for k, v in state.items() if v.dtype != (torch.float32 if k in fp32 else torch.bfloat16)]
    return wrong, sum(1 for k in state if k in fp32)


def bf16_conversion_check(case, tag: str, spec: dict) -> CheckResult:
    """The upstream checkpoint converted (fvconvert's manifest, in memory) with target dtype bf16."""
    cfg, state = _golden_weights(case, spec["weights"], spec["variant"], dtype="bfloat16")
    wrong, n_fp32 = bf16_dtype_errors(cfg, state)
    return CheckResult(f"{case.name}/conversion:{tag}:bf16_dtypes", not wrong and n_fp32 > 0,
                       detail=f"{len(state)} tensors, {n_fp32} kept fp32" if not wrong else
                       f"{len(wrong)} tensors with the wrong dtype, e.g. {'; '.join(wrong[:3])}")


@golden_probe(required=("vid_sample_3b_0", "vid_sample_3b_1", "vid_sample_7b"),
              optional=("emb_*", "txt_in_*", "vid_in_*", "block_*_txt_3b_*"))
def golden_nadit_probe(case, sides) -> list[CheckResult]:
    """Each model of params.models on each call (3B: one call each, then both calls as one batch, which must equal
    the per-call outputs; 7B: both calls as one batch, as upstream ran it), prediction and stored intermediates
    (the 3B last block's text output included: upstream returns it though nothing downstream reads it); then the
    checkpoint converted to bf16 keeps the right tensors fp32."""
    tol, n = case.tolerance, int(case.meta["params"]["num_calls"])
    checks: list[CheckResult] = []
    for tag, spec in case.meta["params"]["models"].items():
        cfg, state = _golden_weights(case, spec["weights"], spec["variant"])
        for side in sides:
            model = ref.load_nadit(cfg, state) if side == "reference" else opt.load_fast_nadit(cfg, state)
            name = f"{case.name}/{side}:{tag}"
            if tag == "3b":  # upstream 3B mixes text q/k across a batch: its goldens are single-sample calls
                for k in range(n):
                    rec = Recorder()
                    got = _nadit_call(model, case, k, trace=rec)
                    checks.append(compare_check(f"{name}/vid_sample_{k}", got, case.outputs[f"vid_sample_3b_{k}"], tol))
                    for inter in ("emb", "txt_in", "vid_in"):
                        want = case.outputs.get(f"{inter}_3b_{k}")
                        if want is not None:
                            checks.append(compare_check(f"{name}/{inter}_{k}", rec.records[inter].reshape(want.shape),
                                                        want, tol))
                    for out_name, want in sorted(case.outputs.items()):
                        m = BLOCK_TXT.match(out_name)
                        if m and int(m.group(2)) == k:
                            got_txt = rec.records.get(f"blocks.{m.group(1)}.txt")
                            checks.append(compare_check(f"{name}/block_{m.group(1)}_txt_{k}", got_txt, want, tol)
                                          if got_txt is not None else
                                          CheckResult(f"{name}/block_{m.group(1)}_txt_{k}", False,
                                                      detail=f"blocks.{m.group(1)}.txt not traced"))
                got = _nadit_call(model, case, list(range(n)))
                rows = [case.outputs[f"vid_sample_3b_{k}"] for k in range(n)]
                checks.append(compare_check(f"{name}/batched_per_sample", got, torch.cat(rows), tol))
            else:
                got = _nadit_call(model, case, list(range(n)))
                checks.append(compare_check(f"{name}/vid_sample", got, case.outputs[f"vid_sample_{tag}"], tol))
        checks.append(bf16_conversion_check(case, tag, spec))
    return checks


@golden_probe(required=("moments", "posterior_mean", "posterior_std", "decoded"),
              optional=("posterior_logvar",), required_with={"posterior_noise": ("posterior_sample",)})
def golden_vae_probe(case, sides) -> list[CheckResult]:
    """Encode (raw moments, posterior mean / std; the sample only when its noise draw is stored) and decode of the
    stored posterior mean."""
    from manifests.seedvr2 import load_vae_variant
    from optimized.models.seedvr2.vae import load_fast_vae
    from reference.seedvr2.vae import load_vae
    _, state = _golden_weights(case, "upstream_weights.pth")
    cfg = load_vae_variant(case.meta["params"]["variant"])
    tol, x, out = case.tolerance, case.inputs["x"], case.outputs
    checks = []
    for side in sides:
        vae = (load_vae if side == "reference" else load_fast_vae)(cfg, state)
        with torch.no_grad():
            checks.append(compare_check(f"{case.name}/{side}:moments", vae.encode_moments(x), out["moments"], tol))
            mean, std = vae.posterior(x)
            checks.append(compare_check(f"{case.name}/{side}:posterior_mean", mean, out["posterior_mean"], tol))
            checks.append(compare_check(f"{case.name}/{side}:posterior_std", std, out["posterior_std"], tol))
            if "posterior_noise" in case.inputs:
                checks.append(compare_check(f"{case.name}/{side}:posterior_sample",
                                            mean + std * case.inputs["posterior_noise"], out["posterior_sample"], tol))
            checks.append(compare_check(f"{case.name}/{side}:decoded", vae.decode(out["posterior_mean"]),
                                        out["decoded"], tol))
    return checks


@golden_probe(required=("cond_latent", "dit_vid_sample", "x0_latent", "decoded", "output_uint8"))
def golden_restore_probe(case, sides) -> list[CheckResult]:
    """The one-step restoration end to end; output_uint8 may differ by one where decoded sits on a rounding tie."""
    from manifests.seedvr2 import load_vae_variant
    from optimized.models.seedvr2.pipeline import RestorationLoop
    from optimized.models.seedvr2.vae import load_fast_vae
    from reference.seedvr2.sampler import restore
    from reference.seedvr2.vae import load_vae
    params, tol, i, o = case.meta["params"], case.tolerance, case.inputs, case.outputs
    cfg, dit_state = _golden_weights(case, "dit.pth", params["variant"])
    _, vae_state = _golden_weights(case, "vae.pth")
    vae_cfg = load_vae_variant(params["vae_variant"])
    args = (i["lq_video"], i["txt_pos"], i["noise"], i["vae_posterior_noise"])
    checks = []
    for side in sides:
        if side == "reference":
            r = restore(ref.load_nadit(cfg, dit_state), load_vae(vae_cfg, vae_state), *args)
        else:
            r = RestorationLoop(opt.load_fast_nadit(cfg, dit_state), load_fast_vae(vae_cfg, vae_state)).generate(*args)
        for name in ("cond_latent", "dit_vid_sample", "x0_latent", "decoded"):
            checks.append(compare_check(f"{case.name}/{side}:{name}", getattr(r, name), o[name], tol))
        diff = (r.output_uint8.int() - o["output_uint8"].int()).abs()
        ok = diff.shape == o["output_uint8"].shape and int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
        checks.append(CheckResult(f"{case.name}/{side}:output_uint8", ok,
                                  detail=f"max |diff| {int(diff.max())}, {int((diff > 0).sum())} values off by one"))
    return checks


def _listing(boxes) -> torch.Tensor:
    return torch.tensor([[a for ax in b for a in ax] for b in boxes], dtype=torch.int64).reshape(-1, 6)


@golden_probe(required=("regular", "shifted"))
def golden_windows_probe(case, sides) -> list[CheckResult]:
    """Upstream's window listings (models/dit_v2/window.py, regular and shifted) for token grids picked by rule:
    rows (grid index, t0, t1, h0, h1, w0, w1) in upstream order. Compared exactly with the reference's
    `windows` and the optimized `build_geometry` boxes, per grid."""
    from optimized.models.seedvr2.windows import build_geometry
    grids = [tuple(int(v) for v in g) for g in case.inputs["grids"].tolist()]
    nw = tuple(int(v) for v in case.inputs["num_windows"].tolist())
    checks = []
    for side in sides:
        for method in ("regular", "shifted"):
            want = case.outputs[method]
            bad = []
            for i, grid in enumerate(grids):
                boxes = ref.windows(grid, nw, method) if side == "reference" else \
                    [b for _, b in build_geometry((grid,), nw, method).boxes]
                if not torch.equal(_listing(boxes), want[want[:, 0] == i, 1:]):
                    bad.append(f"{grid}: {len(boxes)} windows vs upstream {int((want[:, 0] == i).sum())}")
            checks.append(CheckResult(f"{case.name}/{side}:{method}", not bad,
                                      detail=f"{len(grids)} grids, {want.shape[0]} windows as upstream" if not bad else
                                      f"{len(bad)} of {len(grids)} grids differ from upstream, e.g. {bad[0]}",
                                      divergence=None if not bad else f"blocks.{0 if method == 'regular' else 1}"))
    return checks


PROBES = {"seedvr2.nadit": golden_nadit_probe, "seedvr2.vae": golden_vae_probe, "seedvr2.restore": golden_restore_probe,
          "seedvr2.windows": golden_windows_probe}
