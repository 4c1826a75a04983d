"""The seedvr2 checks added to catch the mutation sweep's survivors, each shown passing on clean code and failing
on the bug it targets: grids picked by the window rules (size truncated instead of rounded, the temporal cap of
30 dropped) in the C0 geometry check and the upstream windows golden; the 3B last layer's passive text (golden
block output and the C0 block-output check); the bf16 conversion's fp32-kept tensors. And the one fault
mechanism: planted faults are module patches that leave production code flag-free and are undone on exit."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from pathlib import Path

import pytest

import optimized.models.seedvr2.windows as opt_windows
from manifests.seedvr2 import load_variant
from optimized.models.seedvr2 import load_fast_nadit
from optimized.models.seedvr2.model import FastNaDiT
from parity.families.seedvr2 import FAULTS, c0, cases, planted
from parity.families.seedvr2.golden import (_golden_weights, bf16_conversion_check, bf16_dtype_errors,
                                           golden_nadit_probe, golden_windows_probe)
from parity.golden import load_case

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "seedvr2"


def truncated_extent(grid, num_windows):   # the catalogue's opt-window-size-truncated, as a patch
    t, h, w = grid
    s = math.sqrt(45 * 80 / (h * w))
    return (-(-min(t, 30) // num_windows[0]), math.ceil(int(h * s) / num_windows[1]),
            math.ceil(round(w * s) / num_windows[2]))


def uncapped_extent(grid, num_windows):    # the catalogue's opt-window-t-cap-missing
    t, h, w = grid
    s = math.sqrt(45 * 80 / (h * w))
    return (-(-t // num_windows[0]), math.ceil(round(h * s) / num_windows[1]),
            math.ceil(round(w * s) / num_windows[2]))


def test_rule_grids_are_where_the_rules_matter():
    g, nw = cases.rule_token_grids(), (4, 3, 3)
    assert truncated_extent(g["size_rounding_h"], nw)[1] != opt_windows.window_extent(g["size_rounding_h"], nw)[1]
    h, w = g["size_rounding_w"][1:]
    assert cases._spatial_extent(h, w, int)[1] != cases._spatial_extent(h, w, round)[1]
    assert g["t_cap"][0] > 30 and uncapped_extent(g["t_cap"], nw) != opt_windows.window_extent(g["t_cap"], nw)
    assert {c.name for c in cases.CASES} >= {"size_rounding_h", "size_rounding_w", "t_cap"}


@pytest.mark.parametrize("bug", [truncated_extent, uncapped_extent])
def test_window_rule_bugs_fail_geometry_and_the_upstream_listing(bug, monkeypatch):
    fast = load_fast_nadit(load_variant("tiny-3b"), cases.nadit_state(load_variant("tiny-3b"), 0))
    case = load_case(GOLDEN / "windows")
    assert all(c.passed for c in c0.check_geometry(fast))
    assert all(c.passed for c in golden_windows_probe(case, ("optimized",)))
    monkeypatch.setattr(opt_windows, "window_extent", bug)
    fast.plan_cache.store.clear()
    failed = [c for c in c0.check_geometry(fast) if not c.passed]
    assert failed and all(c.divergence in ("blocks.0", "blocks.1") for c in failed)
    assert not any(c.passed for c in golden_windows_probe(case, ("optimized",)))


def _undoubled(original):
    def block(self, vid, txt, emb, req, layout, layer, group, text_rows):
        vid, txt = original(self, vid, txt, emb, req, layout, layer, group, text_rows)
        return vid, txt / 2 if self.cfg.text_passive(layer) else txt   # a port that 'fixes' upstream's doubling
    return block


def test_passive_text_is_compared_at_c0_and_against_upstream(monkeypatch):
    cfg = load_variant("tiny-3b")
    monkeypatch.setattr(cases, "CASES", cases.CASES[:1])
    monkeypatch.setattr(cases, "GEOMETRY_GRIDS", ())
    tol = c0.load_parity_contract("seedvr2").tolerance("C0", "float32", "cpu")
    state = cases.nadit_state(cfg, 0)
    run = lambda: c0.nadit_checks("tiny-3b", "fp32", cfg, state, tol, 0, [1], None, lambda m: None)  # noqa: E731
    case = load_case(GOLDEN / "nadit")
    only_3b = {**case.meta["params"], "models": {"3b": case.meta["params"]["models"]["3b"]}}
    case = dataclasses.replace(case, meta={**case.meta, "params": only_3b})
    assert all(c.passed for c in run())
    assert all(c.passed for c in golden_nadit_probe(case, ("optimized",)))
    monkeypatch.setattr(FastNaDiT, "block", _undoubled(FastNaDiT.block))
    checks = {c.name: c for c in run()}
    assert checks["tiny-3b/fp32/ragged/sp=1"].passed   # the video output cannot see it
    bad = checks["tiny-3b/fp32/ragged/sp=1/block_outputs"]
    assert not bad.passed and bad.divergence.startswith(f"blocks.{cfg.num_layers - 1}.txt")
    failed = [c.name for c in golden_nadit_probe(case, ("optimized",)) if not c.passed]
    assert failed == ["nadit/optimized:3b/block_3_txt_0", "nadit/optimized:3b/block_3_txt_1"]


def test_bf16_conversion_keeps_upstream_fp32_tensors(tmp_path, monkeypatch):
    from converters import families
    from manifests.seedvr2 import keys
    from parity.errors import UpstreamConversionFailed

    case = load_case(GOLDEN / "nadit")
    spec = case.meta["params"]["models"]["3b"]
    assert bf16_conversion_check(case, "3b", spec).passed
    # the catalogue's conv-keep-fp32-dropped: the family's nadit_fp32_keys (the one statement of the rule, read by
    # fvconvert and by the check's loader list) without the rope suffix; the check's own upstream rule catches it
    real = keys.nadit_fp32_keys
    no_rope = lambda cfg: [k for k in real(cfg) if not k.endswith(keys.CANONICAL_ROPE_SUFFIX)]  # noqa: E731
    monkeypatch.setattr(keys, "nadit_fp32_keys", no_rope)
    monkeypatch.setitem(families._CACHE, ("seedvr2", "transformer"),
                        dataclasses.replace(families.get_family("seedvr2"), fp32_keys=no_rope))
    dropped = bf16_conversion_check(case, "3b", spec)
    assert not dropped.passed and ".attn.rope.freqs: bfloat16 (want float32)" in dropped.detail
    monkeypatch.undo()
    # a manifest that still states the rule itself is refused, naming where the rule lives now
    manifest = json.loads((ROOT / "manifests/seedvr2/checkpoints/official_pth.json").read_text())
    manifest["dtype_policy"]["keep_fp32"] = []
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    old = dataclasses.replace(case, meta={**case.meta, "upstream_format": str(tmp_path / "m.json")})
    with pytest.raises(UpstreamConversionFailed, match="keep_fp32 is no longer read.*nadit_fp32_keys"):
        bf16_conversion_check(old, "3b", spec)
    cfg, state = _golden_weights(case, spec["weights"], spec, dtype="bfloat16")
    assert bf16_dtype_errors(cfg, state)[0] == []
    rope = next(k for k in state if k.endswith(".attn.rope.freqs"))
    wrong, _ = bf16_dtype_errors(cfg, {**state, rope: state[rope].bfloat16()})   # a conversion that casts rope
    assert wrong == [f"{rope}: bfloat16 (want float32)"]
    wrong, _ = bf16_dtype_errors(cfg, {**state, "txt_in.weight": state["txt_in.weight"].float()})  # one not cast
    assert wrong == ["txt_in.weight: float32 (want bfloat16)"]


def test_faults_are_patches_and_production_code_has_no_flags():
    fast = load_fast_nadit(load_variant("tiny-3b"), cases.nadit_state(load_variant("tiny-3b"), 0))
    assert not hasattr(fast, "faults") and not hasattr(fast.plan_cache, "ignore_world_size")
    assert list(inspect.signature(opt_windows.build_geometry).parameters) == ["grids", "num_windows", "method"]
    def seams():
        return (opt_windows.build_geometry, opt_windows.PlanCache.key, FastNaDiT.window_text_sum,
                FastNaDiT.ensure_layout)
    clean = seams()
    for fault in FAULTS:
        with planted(fault, fast):
            assert sum(a is not b for a, b in zip(seams(), clean)) == 1, fault   # exactly one seam patched
        assert seams() == clean
    with pytest.raises(RuntimeError), planted("cyclic-shift", fast):
        raise RuntimeError("the body fails")
    assert opt_windows.build_geometry is clean[0]   # restored on an exception too
