"""One golden format for any upstream case (issue 23, item 3): held-out-style cases built in tmp_path from the
committed ones, one per kind: the architecture in the case (an original-layout case with its config, no variant),
one seedvr2 model alone, intermediates with a planted divergence localised, an encode case without a posterior
sample, a malformed case failing alone, an undeclared / unchecked stored tensor failing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity.errors import SetupError
from parity.golden import run_golden_cases
from tests.conftest import ROOT

BOTH = ("reference", "optimized")


def copy_case(tmp_path: Path, src: str, name: str | None = None) -> Path:
    dst = tmp_path / (name or Path(src).name)
    shutil.copytree(ROOT / "golden" / src, dst, symlinks=False)
    return dst


def edit_meta(case: Path, fn) -> None:
    meta = json.loads((case / "case.json").read_text())
    fn(meta)
    (case / "case.json").write_text(json.dumps(meta))


def edit_tensors(case: Path, which: str, fn) -> None:
    f = case / f"{which}.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file({k: v.contiguous() for k, v in t.items()}, str(f))


def run(paths, sides=BOTH):
    return run_golden_cases(list(paths), sides, progress=lambda _m: None)


def rows(report, case: str) -> dict:
    return {c.name.split("/", 1)[1]: c for c in report.checks if c.name.split("/", 1)[0] == case}


# ------------------------------------------------------------------------------------------------
# The architecture travels with the case
# ------------------------------------------------------------------------------------------------

def test_original_layout_case_carries_its_config_and_needs_no_variant(tmp_path):
    case = copy_case(tmp_path, "wan/dit_t2v_original")
    edit_meta(case, lambda m: m["params"].pop("variant"))
    assert run([case]).passed

    shallow = copy_case(tmp_path, "wan/dit_t2v_original", "shallow")   # the config is what builds the model
    edit_meta(shallow, lambda m: (m["params"].pop("variant"), m["config"].update(num_layers=1)))
    bare = copy_case(tmp_path, "wan/dit_t2v_original", "bare")         # neither config nor variant
    edit_meta(bare, lambda m: (m["params"].pop("variant"), m.pop("config")))
    rep = run([shallow, bare, case], ("reference",))
    assert not rep.passed and all(c.passed for c in rows(rep, case.name).values())
    assert any(not c.passed and "blocks.1" in c.detail for c in rows(rep, "shallow").values())
    assert not rows(rep, "bare")["case"].passed and "config" in rows(rep, "bare")["case"].detail


def test_seedvr2_models_are_each_optional(tmp_path):
    """A case of the 7B alone (the 3B's outputs and entry gone) and one of the 3B alone both pass; a listed model
    whose prediction is missing fails its case only."""
    only7 = copy_case(tmp_path, "seedvr2/nadit", "only7b")
    edit_meta(only7, lambda m: m["params"]["models"].pop("3b"))
    edit_tensors(only7, "outputs", lambda t: [t.pop(k) for k in list(t) if "_3b" in k])
    only3 = copy_case(tmp_path, "seedvr2/nadit", "only3b")
    edit_meta(only3, lambda m: m["params"]["models"].pop("7b"))
    edit_tensors(only3, "outputs", lambda t: [t.pop(k) for k in list(t) if "_7b" in k])
    lacks = copy_case(tmp_path, "seedvr2/nadit", "lacks7b")
    edit_tensors(lacks, "outputs", lambda t: t.pop("vid_sample_7b"))
    rep = run([only7, only3, lacks])
    assert all(c.passed for c in rows(rep, "only7b").values()) and "optimized:7b/emb" in rows(rep, "only7b")
    assert all(c.passed for c in rows(rep, "only3b").values())
    assert [c.name for c in rep.checks if not c.passed] == ["lacks7b/outputs:required"]


# ------------------------------------------------------------------------------------------------
# Intermediates: upstream's own module outputs, the first divergent one named
# ------------------------------------------------------------------------------------------------

def upstream_intermediates(case: Path) -> list[str]:
    """Record diffusers' WanTransformer3DModel module outputs for call 0 as pred_0@<module> (what `fvparity align
    --save` stores) and list them in forward order in case.json."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(case / "upstream").eval()
    rec: dict[str, torch.Tensor] = {}

    def put(name):
        return lambda m, a, out: rec.__setitem__(name, (out[0] if isinstance(out, tuple) else out).detach().clone())

    def cond(m, a, out):  # (temb, timestep_proj, text, image)
        rec["condition_embedder.temb"], rec["condition_embedder"], rec["condition_embedder.text"] = out[0], out[1], out[2]

    model.patch_embedding.register_forward_hook(put("patch_embedding"))
    model.condition_embedder.register_forward_hook(cond)
    for i, b in enumerate(model.blocks):
        b.register_forward_hook(put(f"blocks.{i}"))
    model.proj_out.register_forward_hook(put("proj_out"))
    i = load_file(str(case / "inputs.safetensors"))
    with torch.no_grad():
        pred = model(hidden_states=i["latents_0"], timestep=i["timestep_0"], encoder_hidden_states=i["text_0"],
                     return_dict=False)[0]
    # upstream, as stored (to fp32 rounding: CPU kernels take per-ISA paths, bitwise on the maker's CPU only)
    assert torch.allclose(pred, load_file(str(case / "outputs.safetensors"))["pred_0"], rtol=1e-5, atol=1e-5)
    names = [f"pred_0@{k}" for k in rec]
    edit_tensors(case, "outputs", lambda t: t.update({f"pred_0@{k}": v.contiguous() for k, v in rec.items()}))
    edit_meta(case, lambda m: m.update(intermediates=names))
    return names


@pytest.mark.upstream
def test_intermediates_localise_a_planted_divergence_against_upstream(tmp_path, monkeypatch):
    import reference.wan

    case = copy_case(tmp_path, "wan/dit_t2v")
    names = upstream_intermediates(case)
    ok = rows(run([case]), case.name)
    assert ok["reference:pred_0@intermediates"].passed and ok["optimized:pred_0@intermediates"].passed
    assert f"{len(names)} intermediates" in ok["optimized:pred_0@intermediates"].detail

    real = reference.wan.load_wan_transformer

    def planted(cfg, state):  # the reference's second block mixes 5% of its channels reversed into its output
        model = real(cfg, state)  # (not a scale or a shift: the output LayerNorm would hide those from pred_0)
        model.blocks[1].register_forward_hook(lambda m, a, out: out + 0.05 * out.flip(-1))
        return model

    monkeypatch.setattr(reference.wan, "load_wan_transformer", planted)
    bad = rows(run([case]), case.name)
    inter = bad["reference:pred_0@intermediates"]
    assert not inter.passed and inter.divergence == "blocks.1" and "first diverging intermediate blocks.1" in inter.detail
    assert not bad["reference:pred_0"].passed and bad["reference:pred_0"].divergence == "blocks.1"
    assert bad["optimized:pred_0"].passed and bad["optimized:pred_0@intermediates"].passed


@pytest.mark.upstream
def test_an_intermediate_the_side_cannot_trace_fails_its_row(tmp_path):
    case = copy_case(tmp_path, "wan/dit_t2v")
    upstream_intermediates(case)
    edit_tensors(case, "outputs", lambda t: t.update({"pred_0@blocks.0.attn1": t["pred_0@blocks.0"].clone()}))
    edit_meta(case, lambda m: m["intermediates"].insert(3, "pred_0@blocks.0.attn1"))
    r = rows(run([case], ("optimized",)), case.name)["optimized:pred_0@intermediates"]
    assert not r.passed and "blocks.0.attn1" in r.detail and "not traced" in r.detail


# ------------------------------------------------------------------------------------------------
# Encode without a posterior sample
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src", ["wan/tiny21_encode", "cosmos3_sound/tiny_sound_encode"])
def test_encode_case_without_posterior_sample(tmp_path, src):
    case = copy_case(tmp_path, src)
    edit_meta(case, lambda m: m["params"].pop("sample_seed"))
    edit_tensors(case, "outputs", lambda t: t.pop("posterior_sample"))
    rep = run([case])
    assert rep.passed and {"reference:posterior_mean", "reference:posterior_std"} <= set(rows(rep, case.name))
    assert not any("posterior_sample" in n for n in rows(rep, case.name))

    seedless = copy_case(tmp_path, src, "seedless")  # a stored sample nobody can draw again
    edit_meta(seedless, lambda m: m["params"].pop("sample_seed"))
    rep = run([seedless, case])
    assert [c.name for c in rep.checks if not c.passed] == ["seedless/case"]
    assert "sample_seed" in rows(rep, "seedless")["case"].detail


# ------------------------------------------------------------------------------------------------
# A malformed case fails alone
# ------------------------------------------------------------------------------------------------

def test_malformed_cases_fail_alone_and_the_run_goes_on(fvparity, tmp_path):
    good = copy_case(tmp_path, "cosmos3_sound/tiny_sound_decode")
    bad_json = copy_case(tmp_path, "cosmos3_sound/tiny_sound_decode", "bad_json")
    (bad_json / "case.json").write_text("{not json")
    no_outputs = copy_case(tmp_path, "cosmos3_sound/tiny_sound_decode", "no_outputs")
    (no_outputs / "outputs.safetensors").unlink()
    unknown = copy_case(tmp_path, "cosmos3_sound/tiny_sound_decode", "unknown_probe")
    edit_meta(unknown, lambda m: m.update(probe="cosmos3.no_such_probe"))
    out = tmp_path / "r.json"
    proc = fvparity("golden", str(bad_json), str(good), str(no_outputs), str(unknown), "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    doc = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert not doc["bad_json/case"]["passed"] and "not valid JSON" in doc["bad_json/case"]["detail"]
    assert not doc["no_outputs/case"]["passed"] and "outputs.safetensors" in doc["no_outputs/case"]["detail"]
    assert not doc["unknown_probe/case"]["passed"] and "unknown probe" in doc["unknown_probe/case"]["detail"]
    assert [n for n, c in doc.items() if not c["passed"]] == ["bad_json/case", "no_outputs/case", "unknown_probe/case"]
    assert any(n.startswith("tiny_sound_decode/") for n in doc)

    with pytest.raises(SetupError, match="bad_json.*no_outputs"):  # nothing readable at all: bad input (exit 2)
        run([bad_json, no_outputs])


# ------------------------------------------------------------------------------------------------
# Every stored tensor is checked or declared ignored
# ------------------------------------------------------------------------------------------------

def test_an_unchecked_stored_tensor_fails_unless_ignored_with_a_reason(tmp_path):
    stray = copy_case(tmp_path, "wan/tiny21_decode", "stray")
    edit_tensors(stray, "inputs", lambda t: t.update(stray_noise=torch.randn(3)))
    extra = copy_case(tmp_path, "wan/tiny21_decode", "extra")
    edit_tensors(extra, "outputs", lambda t: t.update(video_graded=t["video"] * 2))
    rep = run([stray, extra])
    assert [c.name for c in rep.checks if not c.passed] == ["stray/tensors:unchecked", "extra/outputs:undeclared"]
    assert "inputs:stray_noise" in rows(rep, "stray")["tensors:unchecked"].detail

    edit_meta(stray, lambda m: m.update(ignore={"stray_noise": "drawn by the maker for a later probe, unused"}))
    edit_meta(extra, lambda m: m.update(ignore={"video_*": ""}))            # a reason is required
    stale = copy_case(tmp_path, "wan/tiny21_decode", "stale")
    edit_meta(stale, lambda m: m.update(ignore={"no_such_tensor": "names nothing stored"}))
    rep = run([stray, extra, stale])
    assert all(c.passed for c in rows(rep, "stray").values())
    assert not rows(rep, "extra")["case"].passed and "reason" in rows(rep, "extra")["case"].detail
    assert not rows(rep, "stale")["case"].passed and "no_such_tensor" in rows(rep, "stale")["case"].detail


def test_a_one_side_run_does_not_report_the_other_sides_tensors(tmp_path):
    """cosmos3.sound_encode runs on the reference only: an optimized-only run reads nothing, by design."""
    rep = run([ROOT / "golden" / "cosmos3_sound" / "tiny_sound_encode"], ("optimized",))
    assert not any(c.name.endswith("tensors:unchecked") for c in rep.checks)
