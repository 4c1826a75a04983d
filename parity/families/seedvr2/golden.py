"""Upstream golden probes for seedvr2 (golden/seedvr2/, made by the official SeedVR code; golden/seedvr2/README.md):
seedvr2.nadit (3B / 7B forward, stored intermediates, and the bf16 conversion's dtypes), seedvr2.vae,
seedvr2.restore (the one-step restoration end to end) and seedvr2.windows (upstream's window listings)."""

from __future__ import annotations

import re

import torch

from manifests import ManifestError
from parity.errors import SetupError, UpstreamConversionFailed
from parity.family import GoldenOutputs, golden_probe
from parity.golden import case_config, config_file
from parity.families.seedvr2.c0 import Recorder, compare_check
from parity.report import CheckResult

import optimized.models.seedvr2 as opt
import reference.seedvr2 as ref

# Upstream keeps the rotary math in fp32 by hand (models/dit_v2/rope.py and models/dit/rope.py:
# `apply_rotary_emb(freqs, q.float())` with the fp32 `rope.rope.freqs` buffer, even under bf16 autocast): a bf16
# conversion must keep those buffers fp32 (canonical name `blocks.<i>.attn.rope.freqs`).
UPSTREAM_FP32 = re.compile(r"^blocks\.\d+\.attn\.rope\.freqs$")
BLOCK_TRACED = re.compile(r"^block_(\d+)_(txt|vid)_(.+)$")  # block_<i>_<txt|vid>_<tag>[_<k>]


def _nadit_config(case, spec: dict):
    """A model's architecture: its upstream constructor config (`spec["config"]`, SeedVR's `dit.model`), mapped
    as fvconvert maps `--config`; `spec["variant"]` only for cases made before configs were carried."""
    from manifests.seedvr2.config import load_variant, nadit_from_upstream_config
    try:
        if spec.get("config") is not None:
            return nadit_from_upstream_config(spec["config"])
        if spec.get("variant") is not None:
            return load_variant(spec["variant"])
    except (ManifestError, KeyError, TypeError, ValueError) as e:
        raise SetupError(f"golden case {case.path}: bad NaDiT config ({type(e).__name__}: {e})") from None
    raise SetupError(f"golden case {case.path}: a NaDiT model needs its upstream config (\"config\": dit.model)")


def _vae_config(case, upstream: dict | None, legacy_variant: str | None):
    from manifests.seedvr2.config import load_vae_variant, vae_from_upstream_config
    try:
        if upstream is not None:
            return vae_from_upstream_config(upstream)
        if legacy_variant is not None:
            return load_vae_variant(legacy_variant)
    except (ManifestError, KeyError, TypeError, ValueError) as e:
        raise SetupError(f"golden case {case.path}: bad VAE config ({type(e).__name__}: {e})") from None
    raise SetupError(f"golden case {case.path}: the VAE needs its upstream config (vae.model)")


def _upstream_file(case, name: str):
    path = case.path / "upstream" / name
    if not path.is_file():
        raise SetupError(f"golden case {case.path}: missing upstream/{name}")
    return path


def _golden_weights(case, name: str, spec: dict | str | None = None, dtype: str | None = None):
    """(config, canonical state) of upstream/<name>: a NaDiT (spec = its model entry) through fvconvert's
    official_pth manifest with the case's own config as `--config`, or the VAE state as stored (its upstream
    names are the canonical names; config None)."""
    from converters import ConversionError, convert_to_state_dict
    path = _upstream_file(case, name)
    if isinstance(spec, str):  # a variant name (callers from before cases carried configs)
        spec = {"variant": spec, "weights": name}
    if spec is None:
        return None, torch.load(path, weights_only=True, map_location="cpu")
    _nadit_config(case, spec)  # a bad or missing config is the case's own fault (malformed), not the converter's
    own = spec.get("config")
    try:  # the upstream config goes in as `fvconvert --config` does (official_pth maps SeedVR's dit.model)
        with config_file(own) as conf:
            return convert_to_state_dict("seedvr2", case.meta["upstream_format"], path, config=conf, dtype=dtype,
                                         variant=None if own is not None else spec.get("variant"))
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
    cfg, state = _golden_weights(case, spec["weights"], spec, dtype="bfloat16")
    wrong, n_fp32 = bf16_dtype_errors(cfg, state)
    return CheckResult(f"{case.name}/conversion:{tag}:bf16_dtypes", not wrong and n_fp32 > 0,
                       detail=f"{len(state)} tensors, {n_fp32} kept fp32" if not wrong else
                       f"{len(wrong)} tensors with the wrong dtype, e.g. {'; '.join(wrong[:3])}")


NADIT_TRACED = ("emb", "txt_in", "vid_in")   # stored intermediates: the Recorder's names (reference/seedvr2/nadit.py)


def nadit_models(case) -> dict[str, dict]:
    """params.models {tag: {"config" | "variant", "weights", "batch"}}, each model optional (one alone is a case);
    `batch` "per_call" (one call per stored input set k; the 3B default: upstream's 3B mixes text q/k across a
    batch) or "joint" (every call as one batch, as upstream ran its 7B)."""
    models = case.params.get("models")
    n = case.params.get("num_calls")
    if not isinstance(models, dict) or not models or not isinstance(n, int) or n < 1:
        raise SetupError(f"golden case {case.path}: seedvr2.nadit needs params.models {{tag: model}} and "
                         f"params.num_calls (a positive int)")
    out = {}
    for tag, spec in models.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("weights"), str):
            raise SetupError(f"golden case {case.path}: params.models.{tag} needs weights (a file in upstream/)")
        batch = spec.get("batch", "per_call" if _nadit_config(case, spec).is_3b else "joint")
        if batch not in ("per_call", "joint"):
            raise SetupError(f"golden case {case.path}: params.models.{tag}.batch must be per_call or joint")
        out[tag] = {**spec, "batch": batch}
    return out


def nadit_outputs_for(case) -> GoldenOutputs:
    """Per model of params.models: its prediction(s) required, its intermediates optional; any other output
    (e.g. a model the case does not list) is undeclared."""
    n, required, optional = int(case.params.get("num_calls", 0) or 0), [], []
    for tag, spec in nadit_models(case).items():
        if spec["batch"] == "per_call":
            required += [f"vid_sample_{tag}_{k}" for k in range(n)]
        else:
            required.append(f"vid_sample_{tag}")
        optional += [f"{t}_{tag}*" for t in NADIT_TRACED] + [f"block_*_txt_{tag}*", f"block_*_vid_{tag}*"]
    return GoldenOutputs(tuple(required), tuple(optional))


def _traced_checks(case, name: str, rec: Recorder, tag: str, k: int | None, tol) -> list[CheckResult]:
    """Every stored intermediate of model `tag`'s call k (None: its joint call): emb / txt_in / vid_in and the
    blocks' text / video outputs (block_<i>_<txt|vid>_<tag>[_<k>]), against the side's trace of the same names.
    Rows are named without the tag (`name` holds it): `<name>/emb_<k>`, `<name>/block_<i>_txt_<k>`."""
    suffix, row_suffix = (f"{tag}_{k}", f"_{k}") if k is not None else (tag, "")
    checks = []
    for inter in NADIT_TRACED:
        key, row = f"{inter}_{suffix}", f"{name}/{inter}{row_suffix}"
        if key in case.outputs:
            want = case.outputs[key]
            got = rec.records.get(inter)
            checks.append(compare_check(row, got.reshape(want.shape), want, tol) if got is not None
                          and got.numel() == want.numel() else
                          CheckResult(row, False, detail=f"{inter} not traced (or its size differs)"))
    for out_name in sorted(case.outputs):  # names only: reading the tensor is what counts as checking it
        m = BLOCK_TRACED.match(out_name)
        if m and m.group(3) == suffix:
            row, traced = f"{name}/block_{m.group(1)}_{m.group(2)}{row_suffix}", f"blocks.{m.group(1)}.{m.group(2)}"
            got = rec.records.get(traced)
            checks.append(compare_check(row, got, case.outputs[out_name], tol) if got is not None
                          else CheckResult(row, False, detail=f"{traced} not traced"))
    return checks


def _per_call_traces(model, case, n: int) -> Recorder:
    """A joint model's stored intermediates hold one row block per call, in batch order (upstream's batched call);
    the sides trace the first sample of a batch only, so each call runs alone traced and the traces are
    concatenated: exact for the 7B, whose samples do not interact (its batch output equals the per-call ones)."""
    recs = []
    for k in range(n):
        rec = Recorder()
        _nadit_call(model, case, k, trace=rec)
        recs.append(rec.records)
    joint = Recorder()
    joint.records = {name: torch.cat([r[name].reshape(-1, r[name].shape[-1]) for r in recs])
                     for name in recs[0] if all(name in r for r in recs)}
    return joint


def golden_nadit_probe(case, sides) -> list[CheckResult]:
    """Each model of params.models on each side: per_call models once per stored call k (then every call as one
    batch, which must equal the per-call outputs), joint models on every call as one batch; prediction and every
    stored intermediate (the 3B last block's text output included: upstream returns it though nothing downstream
    reads it); then the checkpoint converted to bf16 keeps the right tensors fp32."""
    tol, n = case.tolerance, int(case.params["num_calls"])
    checks: list[CheckResult] = []
    for tag, spec in nadit_models(case).items():
        cfg, state = _golden_weights(case, spec["weights"], spec)
        for side in sides:
            model = ref.load_nadit(cfg, state) if side == "reference" else opt.load_fast_nadit(cfg, state)
            name = f"{case.name}/{side}:{tag}"
            if spec["batch"] == "per_call":
                for k in range(n):
                    rec = Recorder()
                    got = _nadit_call(model, case, k, trace=rec)
                    checks.append(compare_check(f"{name}/vid_sample_{k}", got, case.outputs[f"vid_sample_{tag}_{k}"],
                                                tol))
                    checks += _traced_checks(case, name, rec, tag, k, tol)
                got = _nadit_call(model, case, list(range(n)))
                rows = [case.outputs[f"vid_sample_{tag}_{k}"] for k in range(n)]
                checks.append(compare_check(f"{name}/batched_per_sample", got, torch.cat(rows), tol))
            else:
                got = _nadit_call(model, case, list(range(n)))
                checks.append(compare_check(f"{name}/vid_sample", got, case.outputs[f"vid_sample_{tag}"], tol))
                if any(o.endswith(f"_{tag}") and o != f"vid_sample_{tag}" for o in case.outputs):  # intermediates
                    checks += _traced_checks(case, name, _per_call_traces(model, case, n), tag, None, tol)
        checks.append(bf16_conversion_check(case, tag, spec))
    return checks


golden_nadit_probe.golden_outputs_for = nadit_outputs_for


@golden_probe(required=("moments", "posterior_mean", "posterior_std", "decoded"),
              optional=("posterior_logvar",), required_with={"posterior_noise": ("posterior_sample",)})
def golden_vae_probe(case, sides) -> list[CheckResult]:
    """Encode (raw moments, posterior mean / std; the sample only when its noise draw is stored) and decode of the
    stored posterior mean. The architecture: case.json config (SeedVR's vae.model)."""
    from optimized.models.seedvr2.vae import load_fast_vae
    from reference.seedvr2.vae import load_vae
    _, state = _golden_weights(case, "upstream_weights.pth")
    cfg = _vae_config(case, case_config(case), case.params.get("variant"))
    tol, x, out = case.tolerance, case.inputs["x"], case.outputs
    checks = []
    for side in sides:
        vae = (load_vae if side == "reference" else load_fast_vae)(cfg, state)
        with torch.no_grad():
            checks.append(compare_check(f"{case.name}/{side}:moments", vae.encode_moments(x), out["moments"], tol))
            mean, std = vae.posterior(x)
            checks.append(compare_check(f"{case.name}/{side}:posterior_mean", mean, out["posterior_mean"], tol))
            checks.append(compare_check(f"{case.name}/{side}:posterior_std", std, out["posterior_std"], tol))
            if "posterior_logvar" in out:  # upstream's clamped log-variance: log(std^2)
                checks.append(compare_check(f"{case.name}/{side}:posterior_logvar", torch.log(std.double() ** 2).float(),
                                            out["posterior_logvar"], tol))
            if "posterior_noise" in case.inputs:
                checks.append(compare_check(f"{case.name}/{side}:posterior_sample",
                                            mean + std * case.inputs["posterior_noise"], out["posterior_sample"], tol))
            checks.append(compare_check(f"{case.name}/{side}:decoded", vae.decode(out["posterior_mean"]),
                                        out["decoded"], tol))
    return checks


@golden_probe(required=("cond_latent", "dit_vid_sample", "x0_latent", "decoded", "output_uint8"))
def golden_restore_probe(case, sides) -> list[CheckResult]:
    """The one-step restoration end to end; output_uint8 may differ by one where decoded sits on a rounding tie.
    The architecture: case.json config {"dit": {"model": ...}, "vae": {"model": ...}} (SeedVR's main.yaml)."""
    from optimized.models.seedvr2.pipeline import RestorationLoop
    from optimized.models.seedvr2.vae import load_fast_vae
    from reference.seedvr2.sampler import restore
    from reference.seedvr2.vae import load_vae
    params, tol, i, o = case.params, case.tolerance, case.inputs, case.outputs
    own = case_config(case) or {}
    dit_spec = {"config": (own.get("dit") or {}).get("model"), "variant": params.get("variant")}
    cfg, dit_state = _golden_weights(case, "dit.pth", dit_spec)
    _, vae_state = _golden_weights(case, "vae.pth")
    vae_cfg = _vae_config(case, (own.get("vae") or {}).get("model"), params.get("vae_variant"))
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
