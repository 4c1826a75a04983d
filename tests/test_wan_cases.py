"""wan cases by rule (parity/families/wan/cases.py): the matrices cover every rule of the request contract, are
reproducible from the seed, and the generated cases catch the bugs they target (planted here by module patching,
the same edits as the catalogued mutations) while passing on clean code."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from manifests.solvers import UniPCConfig
from manifests.wan import WanDiTConfig, load_model_variant
from parity.families.wan import c0, c1
from parity.families.wan import cases as C
from reference.solvers import flow_schedule

VARIANTS = ("tiny-2.2-t2v-a14b", "tiny-2.1-t2v", "tiny-2.1-i2v", "tiny-2.2-ti2v")
A14B = "tiny-2.2-t2v-a14b"


def quiet(msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def cfgs():
    return {v: load_model_variant(v) for v in VARIANTS}


def _reqs(cases):
    return [r for c in cases for r in c.requests]


def test_c0_matrix_covers_each_rule(cfgs):
    i2v, t2v = cfgs["tiny-2.1-i2v"].dit, cfgs["tiny-2.1-t2v"].dit
    ci = C.dit_cases(i2v, 512, "ci")
    assert C.rules_covered(ci) == set(C.C0_RULES)
    assert C.rules_covered(C.dit_cases(t2v, 16, "ci")) == set(C.C0_RULES) - {"flat_image_embeds"}
    assert {c.text_len for c in ci if "text_length" in c.rules} == {1, 512}
    flat = next(c for c in ci if "flat_image_embeds" in c.rules)
    assert flat.image_std ** 2 < 1e-5      # per-token variance below the eps: 1e-5 vs 1e-6 changes the output
    full = C.dit_cases(i2v, 512, "full")
    assert len(full) > len(ci) and {c.timestep for c in full} == {"int", "float", "per_token"}


def test_c1_matrix_covers_each_rule(cfgs):
    ci = [c for v in VARIANTS for c in C.c1_cases(cfgs[v], "ci")]
    full = [c for v in VARIANTS for c in C.c1_cases(cfgs[v], "full")]
    assert C.rules_covered(ci) == set(C.C1_RULES) == C.rules_covered(full)
    g = [r.guidance_scale for r in _reqs(ci)]
    assert 1.0 in g and any(0 < x < 1 for x in g) and any(x > 1 for x in g)
    assert {cfgs[v].task for v in VARIANTS} == {"t2v", "i2v", "ti2v"}
    ti2v = C.c1_cases(cfgs["tiny-2.2-ti2v"], "ci")
    assert any(r.image is None for r in _reqs(ti2v)) and any(r.image is not None for r in _reqs(ti2v))
    # an unguided request at every position of a same-tick batch (full), with Euler and UniPC rows in one batch
    batches = [c for c in C.c1_cases(cfgs["tiny-2.1-t2v"], "full") if "batch_position" in c.rules]
    assert {[r.uses_cfg for r in c.requests].index(False) for c in batches} == {0, 1, 2}
    assert all(c.start_ticks == (0, 0, 0) and sum(not r.uses_cfg for r in c.requests) == 1 for c in batches)
    assert all({r.solver for r in c.requests} == {"unipc", "euler"} for c in batches)
    # one-token prompt edit: same length, only the last token differs, submitted after the first finished
    edit = next(c for c in ci if "prompt_edit" in c.rules)
    a, b = (r.text_ids for r in edit.requests)
    assert a.shape == b.shape and torch.equal(a[:-1], b[:-1]) and a[-1] != b[-1] and 1 <= int(b[-1])
    assert edit.start_ticks[1] > C.STEPS and not edit.batched


def test_boundary_case_lands_on_the_boundary(cfgs):
    """The two-expert rule's step k has timestep == boundary exactly on the reference schedule (every draw)."""
    cfg = cfgs[A14B]
    cases = [c for c in C.c1_cases(cfg, "full") if c.boundary_step is not None]
    assert len(cases) >= 2
    for case in cases:
        (req,) = case.requests
        _, ts = flow_schedule(UniPCConfig(num_train_timesteps=cfg.num_train_timesteps, flow_shift=req.flow_shift),
                              req.num_steps)
        assert ts[case.boundary_step].item() == cfg.boundary_ratio * cfg.num_train_timesteps, (case.name, ts)
        assert req.guidance_scale_2 is not None and req.uses_cfg
    assert not [c for v in VARIANTS[1:] for c in C.c1_cases(cfgs[v], "full") if c.boundary_step is not None]


def test_matrices_are_reproducible_from_the_seed(cfgs):
    def d(seed):
        return [C.describe(c) for v in VARIANTS for c in C.c1_cases(cfgs[v], "ci", seed)] + \
            [C.describe(c) for c in C.dit_cases(cfgs["tiny-2.1-i2v"].dit, 512, "full", seed)]
    assert d(0) == d(0)
    assert d(0) != d(1)
    with pytest.raises(ValueError):
        C.c1_cases(cfgs[A14B], "nope")


# ------------------------------------------------------------------------------------------------
# The generated cases pass on clean code and fail on the bug they target
# ------------------------------------------------------------------------------------------------

def _run_c1_only(monkeypatch, variant: str, rule: str):
    real = C.c1_cases
    monkeypatch.setattr(C, "c1_cases", lambda cfg, matrix="ci", seed=0: [c for c in real(cfg, matrix, seed)
                                                                         if rule in c.rules and "." in c.name])
    return c1.run_c1([variant], None, "cpu", ["fp32"], 0, None, quiet)


def test_boundary_case_catches_a_strict_boundary(monkeypatch):
    report = _run_c1_only(monkeypatch, A14B, "two_experts")
    assert report.passed and any(c.name.endswith("/boundary_step") and c.passed for c in report.checks)
    import optimized.models.wan.denoise as denoise

    def strict(cfg, timesteps):  # the catalogued mutation opt-expert-boundary-strict: `>` for `>=`
        b = cfg.boundary_ratio * cfg.num_train_timesteps
        return tuple(1 if bool(t > b) else 2 for t in timesteps)
    monkeypatch.setattr(denoise, "expert_schedule", strict)
    report = _run_c1_only(monkeypatch, A14B, "two_experts")
    bad = [c for c in report.checks if not c.passed]
    assert bad and bad[0].name.endswith("/experts") and "step" in bad[0].divergence


def test_prompt_edit_case_catches_a_cache_key_without_the_last_token(monkeypatch):
    report = _run_c1_only(monkeypatch, "tiny-2.1-t2v", "prompt_edit")
    assert report.passed
    from optimized.models.wan.text_encoder import UMT5Fast
    real_key = UMT5Fast.cache_key

    def key_without_last(self, ids):  # the catalogued mutation opt-umt5-cache-key-drops-last-token
        ids = ids.reshape(-1)
        k = real_key(self, ids)
        from optimized.runtime.cache import content_hash
        return dataclasses.replace(k, input_hashes={"text_ids": content_hash(ids[:-1].cpu())})
    monkeypatch.setattr(UMT5Fast, "cache_key", key_without_last)
    report = _run_c1_only(monkeypatch, "tiny-2.1-t2v", "prompt_edit")
    bad = [c.name for c in report.checks if not c.passed]
    assert bad and "/req1/" in bad[0], bad[:3]


def test_flat_image_case_catches_the_model_eps_in_the_image_embedder(monkeypatch):
    """C0's flat_image_embeds case: clean passes; the image embedder's norms with the model's eps 1e-6 instead of
    nn.LayerNorm's 1e-5 (mutation opt-image-embedder-eps-from-config) fails, localised to the image embedder."""
    import torch.nn.functional as F
    import optimized.models.wan.transformer as T

    cfg = load_model_variant("tiny-2.1-i2v")
    assert isinstance(cfg.dit, WanDiTConfig) and cfg.dit.eps != 1e-5
    real_cases = C.dit_cases
    monkeypatch.setattr(C, "dit_cases", lambda *a, **k: [c for c in real_cases(*a, **k)
                                                          if "flat_image_embeds" in c.rules])
    from parity.families.wan import dit
    monkeypatch.setattr(dit, "dit_cases", C.dit_cases)

    def run():
        m = c0.resolve_models(["tiny-2.1-i2v"], None, 0)[0]
        return c0.dit_rows("x", m, c0.contract_tolerance("C0", "dit", "fp32", "cpu"), torch.float32, "cpu", 0, None,
                           False, quiet)
    rows = [r for r in run() if "/forward/" in r.name]
    assert rows and all(r.passed for r in rows)
    real_ln = F.layer_norm

    class OptimizedF:  # torch.nn.functional as the optimized DiT module sees it (the reference keeps the real one)
        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def layer_norm(x, shape, w=None, b=None, eps=1e-5):  # the 1e-5 norms (image embedder only) get 1e-6
            return real_ln(x, shape, w, b, cfg.dit.eps if eps == 1e-5 else eps)
    monkeypatch.setattr(T, "F", OptimizedF())
    rows = [r for r in run() if "/forward/" in r.name]
    assert rows and not any(r.passed for r in rows)
    assert "condition_embedder.image" in rows[0].divergence
