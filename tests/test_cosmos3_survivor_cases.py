"""The cases added for the cosmos3 mutation survivors (issue 11): each passes on the clean tree and fails on the
bug it targets, planted at a seam by monkeypatching (the mutation runner proves the same on source edits).

  gen_t2v_karras_shift5, gen_t2v_default_schedule   Karras ignores flow_shift upstream; the request's defaults
  rule fps_pair (C0 / C1)                            same shapes, other fps, on a warm layout cache
  reason_sampling_warpers                            temperature -> top-k (ties kept) -> top-p, as transformers
  conv_bf16_keep_fp32                                bf16 conversion keeps in fp32 what diffusers keeps
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from manifests.cosmos3.sampling import UniPCConfig
from parity.families.cosmos3 import cases as C
from parity.golden import load_case, run_probe

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "cosmos3"


def _failed(checks) -> list[str]:
    return [c.name for c in checks if not c.passed]


# ------------------------------------------------------------------------------------------------
# AR sampling filters against transformers


def _ref_top_k_drops_kth(logits, req, generator):
    """The reference with `<=` at the k-th value (keeps k - 1 tokens)."""
    x = logits.float() / req.temperature
    if req.top_k > 0:
        kth = torch.topk(x, min(req.top_k, x.numel())).values[-1]
        x = torch.where(x <= kth, torch.full_like(x, float("-inf")), x)
    if req.top_p < 1:
        probs, order = torch.sort(torch.softmax(x, dim=-1), descending=True, stable=True)
        x = x.clone()
        x[order[(torch.cumsum(probs, dim=-1) - probs) > req.top_p]] = float("-inf")
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator))


def _opt_temperature_last(logits, req, generator):
    """The optimized side filtering the untempered logits and dividing by the temperature only at the draw."""
    x = logits.float()
    if req.top_k > 0:
        x = x.masked_fill(x < x.topk(min(req.top_k, x.numel())).values[-1], float("-inf"))
    if req.top_p < 1:
        p, idx = x.softmax(-1).sort(descending=True, stable=True)
        x = x.index_fill(0, idx[(p.cumsum(-1) - p) > req.top_p], float("-inf"))
    return int(torch.multinomial((x / req.temperature).softmax(-1), 1, generator=generator))


def test_sampling_golden_passes_and_catches_both_sides(monkeypatch):
    from parity.families.cosmos3.c1 import golden_sampling_probe

    case = load_case(GOLDEN / "reason_sampling_warpers")
    clean = run_probe(golden_sampling_probe, case, ("reference", "optimized"))
    assert len(clean) == 2 * len(case.meta["params"]["settings"]) and not _failed(clean)

    import optimized.models.cosmos3.reasoner as opt_reasoner
    import reference.cosmos3.reasoner as ref_reasoner

    with monkeypatch.context() as m:
        m.setattr(ref_reasoner, "choose_token", _ref_top_k_drops_kth)
        bad = _failed(run_probe(golden_sampling_probe, case, ("reference", "optimized")))
    assert bad and all("/reference:" in n for n in bad)
    assert "reason_sampling_warpers/reference:setting1" in bad  # the tie at the k-th value
    with monkeypatch.context() as m:
        m.setattr(opt_reasoner, "choose_token", _opt_temperature_last)
        bad = _failed(run_probe(golden_sampling_probe, case, ("reference", "optimized")))
    top_p = [i for i, s in enumerate(case.meta["params"]["settings"]) if s["top_p"] < 1]
    assert bad == [f"reason_sampling_warpers/optimized:setting{i}" for i in top_p]  # every top-p setting


@pytest.mark.slow
@pytest.mark.upstream
def test_sampling_golden_is_what_transformers_generate_applies(tmp_path):
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import make_reason_goldens

    make_reason_goldens.build_sampling_case(tmp_path)  # asserts generate's own scores = the processor chain's
    got = load_case(tmp_path / "reason_sampling_warpers")
    want = load_case(GOLDEN / "reason_sampling_warpers")
    assert torch.equal(got.inputs["logits"], want.inputs["logits"])
    assert torch.equal(got.outputs["probs"], want.outputs["probs"])



# ------------------------------------------------------------------------------------------------
# bf16 conversion keeps in fp32 what diffusers keeps


@contextlib.contextmanager
def _fp32_keys(rule):
    """The cosmos3 converter family with another fp32 key rule (the family's fp32_keys is the only statement of
    which tensors stay float32: the catalogue's conv-keep-fp32-dropped empties it)."""
    from converters import families

    families.get_family("cosmos3")  # built and cached: the converters read this cached entry
    key = next(k for k in families._CACHE if k[0] == "cosmos3")
    real = families._CACHE[key]
    families._CACHE[key] = replace(real, fp32_keys=rule)
    try:
        yield
    finally:
        families._CACHE[key] = real


def test_convert_dtypes_golden(tmp_path):
    from converters import ConversionError, convert_to_state_dict
    from manifests.cosmos3.keys import canonical_key_shapes
    from parity.families.cosmos3.c0 import golden_convert_dtypes_probe

    case = load_case(GOLDEN / "conv_bf16_keep_fp32")
    assert not _failed(run_probe(golden_convert_dtypes_probe, case, ("reference", "optimized")))
    with _fp32_keys(lambda cfg: []):  # dropped: the time embedder goes to bf16, upstream keeps it fp32
        checks = run_probe(golden_convert_dtypes_probe, case, ("reference", "optimized"))
    assert _failed(checks) == ["conv_bf16_keep_fp32/converter:bf16_dtypes"]
    assert "time_embed.linear_1.weight bfloat16 (upstream float32)" in checks[0].detail
    def too_much(cfg):  # keeping too much in fp32 is caught too
        return [k for k in canonical_key_shapes(cfg) if k.startswith(("time_embed.", "embed_tokens."))]

    with _fp32_keys(too_much):
        assert _failed(run_probe(golden_convert_dtypes_probe, case, ("reference", "optimized")))
    # a format manifest can no longer restate (or contradict) the rule: one still carrying keep_fp32 is refused
    d = json.loads((Path(__file__).resolve().parents[1] / "manifests/cosmos3/checkpoints/diffusers.json").read_text())
    d["dtype_policy"]["keep_fp32"] = ["^time_embed\\."]
    (tmp_path / "old.json").write_text(json.dumps(d))
    with pytest.raises(ConversionError, match="keep_fp32 is no longer read.*manifests/cosmos3/keys.py fp32_keys"):
        convert_to_state_dict("cosmos3", str(tmp_path / "old.json"), case.path / "upstream", dtype="bfloat16")


# ------------------------------------------------------------------------------------------------
# same shapes, other fps, on one model / engine


def test_fps_pair_rule_cases():
    c0 = [c for c in C.c0_cases("ci") if "fps_pair" in c.rules]
    assert len(c0) == 2 and c0[0].vision == c0[1].vision and c0[0].text_len == c0[1].text_len
    assert c0[0].fps != c0[1].fps and c0[0].vision[0] > 1  # T > 1: fps-modulated
    from manifests.cosmos3 import load_variant

    cfg = load_variant("tiny")
    c1 = [c for c in C.c1_cases(cfg, "ci") if "fps_pair" in c.rules]
    assert len(c1) == 1
    a, b = c1[0].requests
    assert a.latent_frames == b.latent_frames > 1 and a.text_ids.numel() == b.text_ids.numel()
    assert a.fps != b.fps and c1[0].start_ticks == (0, C.STEPS + 1)  # the second on a warm engine


@contextlib.contextmanager
def _signature_without_fps():
    import optimized.models.cosmos3.packing as packing

    real = packing.sample_signature
    packing.sample_signature = lambda x: real(x)[:3] + (0.0,) + real(x)[4:]
    try:
        yield
    finally:
        packing.sample_signature = real


@pytest.mark.parametrize("level", ["C0", "C1"])
def test_fps_pair_catches_a_layout_cache_keyed_without_fps(level):
    from parity.families.cosmos3 import c0, c1

    def run():
        if level == "C0":
            return c0.run_c0(None, None, "cpu", ["fp32"], 0, None, lambda m: None, "ci", ("fps_pair",)).checks
        return c1.run_c1(None, None, "cpu", ["fp32"], 0, None, lambda m: None, "eager", "ci", ("fps_pair",)).checks

    assert not _failed(run())
    with _signature_without_fps():
        bad = _failed(run())
    assert any("fps_pair" in n for n in bad)


# ------------------------------------------------------------------------------------------------
# schedule defaults, Karras with a shift


def test_default_schedule_case_leaves_the_request_schedule_at_defaults():
    from parity.families.cosmos3.c1 import golden_request

    case = load_case(GOLDEN / "gen_t2v_default_schedule")
    assert case.meta["params"]["scheduler"] == {}
    assert case.meta["upstream_run"]["scheduler"]["kwargs"] == {"flow_shift": 10.0}  # the docs' t2v setting
    assert golden_request(case).scheduler == UniPCConfig()
    karras = json.loads((GOLDEN / "gen_t2v_karras_shift5" / "case.json").read_text())["params"]["scheduler"]
    assert karras["use_karras_sigmas"] and karras["flow_shift"] != 1.0


def test_default_schedule_golden_catches_another_default(monkeypatch):
    from parity.families.cosmos3 import c1

    case = load_case(GOLDEN / "gen_t2v_default_schedule")
    assert not _failed(run_probe(c1.golden_generate_probe, case, ("reference",)))
    monkeypatch.setattr(c1, "UniPCConfig", functools.partial(UniPCConfig, flow_shift=5.0))  # the model card's 5
    assert "gen_t2v_default_schedule/reference:model_timesteps" in _failed(
        run_probe(c1.golden_generate_probe, case, ("reference",)))
