"""ComfyUI workflows compiled to programs (issue 27): both formats compile and run through `fvgen workflow`, bitwise
equal to the direct request; invalid workflows exit 2 naming the node id before anything runs; the parity check
(parity/workflow_checks.py) passes and its negative controls fail; a changed seed re-encodes no text."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from optimized.serving.fvgen import main as fvgen
from optimized.workflows import WorkflowCache, WorkflowError, bind, compile_file, node_keys
from parity.workflow_checks import CASES, EXAMPLES, FAULTS, TINY_MODELS, direct_request, run_checks, write_tiny_models

API = json.loads((EXAMPLES / "wan_t2v_tiny_api.json").read_text())
UI = json.loads((EXAMPLES / "wan_t2v_tiny_ui.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("wf") / "models"
    for name, variant in TINY_MODELS.items():
        write_tiny_models(root, name, variant=variant)
    return root


@pytest.fixture(scope="module")
def engine(models):
    from optimized import Engine
    return Engine.from_checkpoint(models / "tiny-wan-2.1-t2v")


@pytest.fixture(scope="module")
def direct_frames(engine):
    return engine.generate_video(direct_request(engine, CASES[0].settings)).frames


def _frames_of(folder: Path) -> torch.Tensor:
    import numpy as np
    from PIL import Image
    return torch.from_numpy(np.stack([np.asarray(Image.open(p)) for p in sorted(folder.glob("frame_*.png"))]))


@pytest.mark.parametrize("name", ["wan_t2v_tiny_api.json", "wan_t2v_tiny_ui.json"])
def test_fvgen_workflow_writes_frames_bitwise_equal_to_the_direct_request(models, direct_frames, tmp_path, capsys,
                                                                          name):
    out = tmp_path / "out"
    code = fvgen(["workflow", str(EXAMPLES / name), "--models-dir", str(models), "--out", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert list(summary["outputs"]) == ["28"]
    folder = out / "tiny_wan_28"
    assert torch.equal(_frames_of(folder), direct_frames)
    side = json.loads((folder / "video.json").read_text())
    assert side["comfy"]["class_type"] == "SaveAnimatedWEBP" and side["comfy"]["options"]["fps"] == 16.0
    assert side["seed"] == 42 and side["request"]["num_steps"] == 3


def _api(edit) -> dict:
    p = copy.deepcopy(API)
    edit(p)
    return p


def _ui(edit) -> dict:
    p = copy.deepcopy(UI)
    edit(p)
    return p


def _ui_node(p: dict, nid: int) -> dict:
    return next(n for n in p["nodes"] if n["id"] == nid)


def _ui_unknown_on_model_path(p: dict) -> None:   # a LoRA loader between the UNETLoader and ModelSamplingSD3
    p["nodes"].append({"id": 60, "type": "LoraLoaderModelOnly", "mode": 0, "inputs": [
        {"name": "model", "type": "MODEL", "link": 1}], "outputs": [{"name": "MODEL", "type": "MODEL", "links": [12]}],
        "widgets_values": ["x.safetensors", 1.0]})
    p["links"] = [l for l in p["links"] if l[0] != 1] + [[1, 37, 0, 60, 0, "MODEL"], [12, 60, 0, 48, 0, "MODEL"]]
    _ui_node(p, 48)["inputs"][0]["link"] = 12


def _ui_cycle(p: dict) -> None:   # the KSampler's latent fed back into ModelSamplingSD3's model
    p["links"].append([13, 3, 0, 48, 0, "MODEL"])
    _ui_node(p, 48)["inputs"][0]["link"] = 13


INVALID = [
    ("api-unknown-on-model-path", lambda: _api(lambda p: (p.update({"60": {"class_type": "LoraLoaderModelOnly",
                                                                           "inputs": {"model": ["37", 0]}}}),
                                                           p["48"]["inputs"].update(model=["60", 0]))),
     "node 60 (LoraLoaderModelOnly)"),
    ("api-dangling", lambda: _api(lambda p: p["3"]["inputs"].update(latent_image=["99", 0])),
     "node 3 (KSampler) input latent_image"),
    ("api-wrong-type", lambda: _api(lambda p: p["3"]["inputs"].update(positive=["40", 0])),
     "node 3 (KSampler) input positive: expects CONDITIONING"),
    ("api-cycle", lambda: _api(lambda p: p["48"]["inputs"].update(model=["3", 0])), "dependency cycle"),
    ("ui-unknown-on-model-path", lambda: _ui(_ui_unknown_on_model_path), "node 60 (LoraLoaderModelOnly)"),
    ("ui-dangling", lambda: _ui(lambda p: _ui_node(p, 8)["inputs"][0].update(link=77)),
     "node 8 (VAEDecode) input samples"),
    ("ui-wrong-type", lambda: _ui(lambda p: p["links"].__setitem__(4, [5, 40, 0, 3, 1, "LATENT"])),
     "node 3 (KSampler) input positive: expects CONDITIONING"),
    ("ui-cycle", lambda: _ui(_ui_cycle), "dependency cycle"),
    ("ui-bypassed", lambda: _ui(lambda p: _ui_node(p, 48).update(mode=4)), "node 48 (ModelSamplingSD3)"),
    ("scheduler", lambda: _api(lambda p: p["3"]["inputs"].update(scheduler="karras")),
     "node 3 (KSampler) input scheduler"),
    ("denoise", lambda: _api(lambda p: p["3"]["inputs"].update(denoise=0.5)), "node 3 (KSampler) input denoise"),
    ("sampler", lambda: _api(lambda p: p["3"]["inputs"].update(sampler_name="dpmpp_2m")),
     "node 3 (KSampler) input sampler_name"),
    ("clip-type", lambda: _api(lambda p: p["38"]["inputs"].update(type="sd3")), "node 38 (CLIPLoader) input type"),
    ("missing-model", lambda: _api(lambda p: p["39"]["inputs"].update(vae_name="wan_2.1_vae.safetensors")),
     "node 39 (VAELoader) input vae_name"),
]


@pytest.mark.parametrize("case, make, needle", INVALID, ids=[c[0] for c in INVALID])
def test_an_invalid_workflow_exits_2_naming_the_node_before_anything_runs(models, tmp_path, capsys, monkeypatch,
                                                                           case, make, needle):
    from optimized import Engine
    monkeypatch.setattr(Engine, "start_video", lambda *a, **k: pytest.fail("a refused workflow ran"))
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(make()))
    code = fvgen(["workflow", str(wf), "--models-dir", str(models), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_bad_files_and_outputs_exit_2_and_a_failed_run_exits_1_writing_nothing(models, tmp_path, capsys,
                                                                               monkeypatch):
    api = str(EXAMPLES / "wan_t2v_tiny_api.json")
    (tmp_path / "bad.json").write_text('{"3": ')
    for argv, needle in ((["/no/such.json", "--out", str(tmp_path / "o")], "cannot read /no/such.json"),
                         ([str(tmp_path / "bad.json"), "--out", str(tmp_path / "o")], "is not JSON"),
                         ([api, "--out", str(models / "tiny-wan-2.1-t2v" / "o")], "inside the model directory"),
                         ([api, "--out", str(tmp_path / "o.mp4")], "give a directory")):
        code = fvgen(["workflow", *argv, "--models-dir", str(models)])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "Traceback" not in err, err
    import optimized.models.wan.denoise as denoise

    def broken(*a, **k):
        raise RuntimeError("planted solver failure")
    monkeypatch.setattr(denoise, "advance", broken)
    code = fvgen(["workflow", api, "--models-dir", str(models), "--out", str(tmp_path / "o"), "--quiet"])
    assert code == 1 and "planted solver failure" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]
    assert sorted(p.name for p in (models / "tiny-wan-2.1-t2v").iterdir()) == [
        "conversion_report.json", "model_index.json", "scheduler", "text_encoder", "tokenizer", "transformer", "vae"]


def test_a_muted_node_is_left_out_and_a_consumer_of_it_is_refused():
    from optimized.workflows import load_workflow
    muted_note = _ui(lambda p: p["nodes"].append({"id": 70, "type": "PreviewImage", "mode": 2, "inputs": [
        {"name": "images", "type": "IMAGE", "link": None}], "outputs": [], "widgets_values": []}))
    assert "70" not in load_workflow(muted_note).nodes
    with pytest.raises(WorkflowError, match="node 8 \\(VAEDecode\\) input samples: comes from node 3, which is muted"):
        load_workflow(_ui(lambda p: _ui_node(p, 3).update(mode=2)))


def test_an_unknown_output_node_is_passed_through_as_an_artifact(models, direct_frames, tmp_path, capsys):
    wf = _api(lambda p: p.update({"90": {"class_type": "VHS_VideoCombine", "inputs": {
        "images": ["8", 0], "frame_rate": 16, "format": "video/h264-mp4"}}}))
    program = compile_file(wf)
    assert [(o.node_id, o.external) for o in program.outputs] == [("28", False), ("90", True)]
    (tmp_path / "wf.json").write_text(json.dumps(wf))
    code = fvgen(["workflow", str(tmp_path / "wf.json"), "--models-dir", str(models), "--out", str(tmp_path / "o"),
                  "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert torch.equal(_frames_of(tmp_path / "o" / "VHS_VideoCombine_90_90"), direct_frames)


def test_ui_widgets_follow_the_input_order_with_control_after_generate():
    ui, api = compile_file(UI), compile_file(API)
    assert ui.request_fields() == api.request_fields()
    assert ui.sampling.seed == 42 and ui.sampling.steps == 3 and ui.sampling.guidance_scale == 5.0
    too_many = _ui(lambda p: _ui_node(p, 3)["widgets_values"].append(0.5))
    with pytest.raises(WorkflowError, match="node 3 \\(KSampler\\): widgets_values has 8 values"):
        compile_file(too_many)


def test_the_ti2v_latent_refuses_a_start_image_a_missing_shift_and_the_wrong_model(models, engine):
    ti2v = json.loads((EXAMPLES / "wan22_ti2v_tiny_api.json").read_text())
    with_image = copy.deepcopy(ti2v)
    with_image["90"] = {"class_type": "LoadImage", "inputs": {"image": "x.png"}}
    with_image["55"]["inputs"]["start_image"] = ["90", 0]
    with pytest.raises(WorkflowError, match="node 90 \\(LoadImage\\).*model path"):
        compile_file(with_image)
    no_shift = copy.deepcopy(ti2v)
    no_shift["3"]["inputs"]["model"] = ["37", 0]
    del no_shift["48"]
    with pytest.raises(WorkflowError, match="node 3 \\(KSampler\\) input model: a Wan 2.2 workflow needs"):
        compile_file(no_shift)
    with pytest.raises(WorkflowError, match="node 55 \\(Wan22ImageToVideoLatent\\): .* this model is a t2v"):
        bind(compile_file(ti2v), engine)   # the 2.1 t2v engine


def test_no_model_sampling_node_means_comfyui_wan_shift_8():
    wf = _api(lambda p: (p["3"]["inputs"].update(model=["37", 0]), p.pop("48")))
    assert compile_file(wf).sampling.flow_shift == 8.0


def test_a_changed_seed_re_encodes_no_text(engine):
    cache, enc = WorkflowCache(), engine.model.text_encoder
    texts = {"6": "a dog runs on the beach", "7": "low quality video"}   # texts no other test encodes

    def with_texts(p: dict) -> None:
        for nid, text in texts.items():
            p[nid]["inputs"]["text"] = text
    wf = _api(with_texts)
    first = bind(compile_file(wf), engine, cache)
    before = enc.stats.prompts_encoded
    engine.generate_video(first.request)
    assert enc.stats.prompts_encoded - before == 2 and first.cache_hits == {"6": False, "7": False}
    reseeded = _api(lambda p: (with_texts(p), p["3"]["inputs"].update(seed=7)))
    second = bind(compile_file(reseeded), engine, cache)
    assert second.cache_hits == {"6": True, "7": True}
    before = enc.stats.prompts_encoded
    result = engine.generate_video(second.request)
    assert enc.stats.prompts_encoded == before and result.seed == 7
    k1 = node_keys(compile_file(wf).workflow, "w", "float32")
    k2 = node_keys(compile_file(reseeded).workflow, "w", "float32")
    assert sorted(n for n in k1 if k1[n] != k2[n]) == ["28", "3", "8"]   # the sampler and what depends on it
    retexted = bind(compile_file(_api(lambda p: (with_texts(p), p["6"]["inputs"].update(text="a red sky")))),
                    engine, cache)
    assert retexted.cache_hits == {"6": False, "7": True}


@pytest.fixture(scope="module")
def engines(models, engine):
    return {(models / "tiny-wan-2.1-t2v").resolve(): engine}


def test_the_workflow_parity_check_passes(models, engines):
    report = run_checks(models, engines=engines)
    assert report.passed and len(report.checks) == 9, report.table()
    assert {c.name for c in report.checks} >= {"ti2v-api/C1_latents", "ti2v-api/C4_frames"}


@pytest.mark.parametrize("fault, failing", [("widget-shifted-by-one", "ui/compile"),
                                            ("cfg-read-as-steps", "api/settings")])
def test_the_workflow_parity_check_fails_on_a_planted_fault(models, engines, fault, failing):
    report = run_checks(models, fault=fault, engines=engines)
    failed = [c.name for c in report.checks if not c.passed]
    assert not report.passed and failing in failed, report.table()
    if fault == "cfg-read-as-steps":   # silent in the compiler: the bitwise runs catch it too
        assert {f"{c}/{k}" for c in ("api", "ui", "ti2v-api") for k in ("C1_latents", "C4_frames")} <= set(failed)
    assert set(FAULTS) == {"widget-shifted-by-one", "cfg-read-as-steps"}
