"""Processors (prompt -> ids, image -> pixels, -> request), both sides: goldens, C0, upstream, bad input, planted bugs."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")

from parity.families.cosmos3 import processors as p3  # noqa: E402
from parity.families.wan import processors as pw  # noqa: E402
from parity.golden import load_case  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
C3_CASES = [ROOT / "golden/cosmos3/proc_qwen_bpe", ROOT / "golden/cosmos3/proc_wordlevel_tiny"]
WAN_CASE = ROOT / "golden/wan/proc_umt5"
TINY_TOK = ROOT / "golden/cosmos3/proc_wordlevel_tiny/upstream"
SIDES = ("reference", "optimized")


def _failed(results):
    return [(r.name, r.detail) for r in results if not r.passed]


# ------------------------------------------------------------------------------------------------ goldens, C0

@pytest.mark.parametrize("case", C3_CASES, ids=lambda p: p.name)
def test_cosmos3_goldens_both_sides(case):
    results = p3.golden_probe(load_case(case), SIDES)
    assert len(results) >= 16 and not _failed(results)


def test_wan_golden_both_sides():
    results = pw.golden_probe(load_case(WAN_CASE), SIDES)
    assert len(results) >= 40 and not _failed(results)


def test_c0_processor_rows_pass():
    for mod in (p3, pw):
        rows = mod.processor_checks()
        assert len(rows) >= 10 and not _failed(rows)


def test_family_entries_expose_processors():
    import optimized.models.cosmos3 as c3
    import optimized.models.wan as wan

    req = c3.FAMILY.processor(TINY_TOK).build_request("a cat", num_frames=5, height=32, width=32, steps=2)
    assert req.text_ids.dtype == torch.int64 and req.latent_frames == 2
    wreq = wan.FAMILY.processor(WAN_CASE / "upstream").build_request("a cat", num_frames=5, height=32, width=32)
    assert int(wreq.text_ids[-1]) == 1 and wreq.negative_text_ids is not None  # "</s>"; CFG on at 5.0


# ------------------------------------------------------------------------------------------------ requests

def _sides(module: str):
    if module == "cosmos3":
        from optimized.models.cosmos3 import processor as o
        from reference.cosmos3 import processor as r
    else:
        from optimized.models.wan import processor as o
        from reference.wan import processor as r
    return r, o


def test_cosmos3_requests_equal_and_valid():
    from manifests.cosmos3 import load_variant

    cfg = load_variant("tiny")
    r, o = _sides("cosmos3")
    rp, op = r.Cosmos3Processor(TINY_TOK), o.Cosmos3Processor(TINY_TOK)
    enc = lambda px: torch.zeros(1, cfg.latent_channels, (px.shape[2] - 1) // 4 + 1, px.shape[3] // 16,  # noqa: E731
                                 px.shape[4] // 16)
    image = torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8)
    for kw in (dict(num_frames=5, height=32, width=48), dict(num_frames=9, height=32, width=32, image=image),
               dict(num_frames=1, height=16, width=16, image=image)):
        a = rp.build_request("a cat", "blurry", encode_vision=enc, steps=2, **kw).validate(cfg)
        b = op.build_request("a cat", "blurry", encode_vision=enc, steps=2, **kw).validate(cfg)
        assert torch.equal(a.text_ids, b.text_ids) and torch.equal(a.negative_text_ids, b.negative_text_ids)
        assert (a.latent_frames, a.latent_height, a.latent_width, a.vision_condition_frames) == \
            (b.latent_frames, b.latent_height, b.latent_width, b.vision_condition_frames)
    assert a.vision_condition_frames == ()  # num_frames == 1: the image is ignored (upstream)
    from PIL import Image
    clip = Image.fromarray(torch.randint(0, 256, (100, 130, 3), dtype=torch.uint8).numpy())
    reqs = [p.build_request("pick", action=mod.ActionInput("inverse_dynamics", 4, "bridge_orig_lerobot", clip, 256),
                            encode_vision=enc) for p, mod in ((rp, r), (op, o))]
    for q in reqs:  # canvas 256 x 320 names the prompt; latents keep the 96 x 128 content only
        assert (q.latent_frames, q.latent_height, q.latent_width) == (2, 6, 8)
        assert q.vision_condition_frames == (0, 1) and q.action.raw_action_dim == 10 and q.action.domain_id == 7
    assert torch.equal(reqs[0].text_ids, reqs[1].text_ids)
    assert rp.build_request("a", num_frames=5, height=32, width=32, sound=(150, 6)).sound_frames == \
        op.build_request("a", num_frames=5, height=32, width=32, sound=(150, 6)).sound_frames == 6


def test_wan_requests_equal_and_valid():
    from manifests.wan.model import load_model_variant

    r, o = _sides("wan")
    tok = WAN_CASE / "upstream"
    rp, op = r.WanProcessor(tok), o.WanProcessor(tok)
    cfg = load_model_variant("tiny-2.1-i2v")
    from PIL import Image
    img = Image.fromarray(torch.randint(0, 256, (30, 40, 3), dtype=torch.uint8).numpy())
    embeds = torch.randn(3, cfg.dit.image_dim)
    reqs = [p.build_request("a cat", None, img, num_frames=5, height=32, width=32, image_embeds=embeds)
            for p in (rp, op)]
    for q in reqs:
        q.validate(cfg)
    assert torch.equal(reqs[0].image, reqs[1].image) and torch.equal(reqs[0].negative_text_ids, reqs[1].negative_text_ids)
    assert reqs[0].negative_text_ids.tolist() == [1]   # "" -> "</s>" only
    no_cfg = [p.build_request("a cat", "x", num_frames=5, height=32, width=32, guidance=1.0) for p in (rp, op)]
    assert all(q.negative_text_ids is None for q in no_cfg)  # the negative prompt is not encoded without CFG


# ------------------------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("module", ["cosmos3", "wan"])
def test_bad_images_give_one_clear_error(module):
    r, o = _sides(module)
    rgba = torch.zeros(4, 32, 32)
    for side in (r, o):
        if module == "cosmos3":
            proc = side.Cosmos3Processor(TINY_TOK)
            call = (lambda im: side.conditioning_image(im, 32, 32)) if side is r else \
                (lambda im: proc.conditioning_image(im, 32, 32))
            with pytest.raises(side.ProcessorError, match="resolution_tier"):
                proc.build_request("a", action=side.ActionInput("policy", 4, "av", torch.zeros(3, 32, 32), 300))
            with pytest.raises(side.ProcessorError, match="encode_vision"):
                proc.build_request("a", image=torch.zeros(3, 32, 32), num_frames=5, height=32, width=32)
            with pytest.raises(side.ProcessorError, match="height"):
                proc.build_request("a", num_frames=5, height=40, width=32)
        else:
            proc = side.WanProcessor(WAN_CASE / "upstream")
            call = (lambda im: side.vae_pixels(im, 32, 32)) if side is r else (lambda im: proc.vae_image(im, 32, 32))
            with pytest.raises(side.ProcessorError, match="alpha|RGB"):
                (side.clip_pixels if side is r else proc.clip_image)(
                    __import__("PIL.Image").Image.new("RGBA", (40, 40)))
        for bad in ("not an image", rgba, [1, 2, 3]):
            with pytest.raises(side.ProcessorError, match="image"):
                call(bad)
        with pytest.raises(side.ProcessorError, match="prompt"):
            proc.build_request(123, num_frames=5, height=32, width=32)
        no_tok = side.Cosmos3Processor(None) if module == "cosmos3" else side.WanProcessor(None)
        with pytest.raises(side.ProcessorError, match="tokenizer"):
            no_tok.build_request("a", num_frames=5, height=32, width=32)


def test_cosmos3_tokenizer_without_vision_start_is_refused(tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(WAN_CASE / "upstream", d)   # a T5 tokenizer: no chat template, no <|vision_start|>
    r, o = _sides("cosmos3")
    for side in (r, o):
        with pytest.raises(side.ProcessorError, match="chat template|vision_start"):
            side.Cosmos3Processor(d).tokenize_prompt("a", num_frames=5, height=32, width=32)


# ------------------------------------------------------------------------------------------------ planted bugs

def test_wrong_chat_template_fails_the_golden(tmp_path):
    case = tmp_path / "proc_qwen_bpe"
    shutil.copytree(C3_CASES[0], case)
    tpl = case / "upstream/chat_template.jinja"
    tpl.write_text(tpl.read_text().replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant'"))
    failed = _failed(p3.golden_probe(load_case(case), SIDES))
    assert any("reference:cond_ids" in n for n, _ in failed) and any("optimized:cond_ids" in n for n, _ in failed)
    assert not any("pixels" in n for n, _ in failed)  # localised: only the ids


def test_wrong_resize_filter_fails_the_golden(monkeypatch):
    import torch.nn.functional as F

    import reference.cosmos3.processor as rc

    real = F.interpolate

    class NoAntialias:
        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def interpolate(*a, **kw):
            return real(*a, **{**kw, "antialias": False})

    monkeypatch.setattr(rc, "F", NoAntialias())
    failed = _failed(p3.golden_probe(load_case(C3_CASES[0]), ("reference",)))
    assert any("pixels_i2v_uint8_down" in n for n, _ in failed)

    from PIL import Image
    resize = Image.Image.resize
    monkeypatch.setattr(Image.Image, "resize", lambda self, size, resample=None, *a, **kw: resize(
        self, size, Image.Resampling.BILINEAR))
    failed = _failed(pw.golden_probe(load_case(WAN_CASE), ("optimized",)))
    assert any("pixels_vae_pil" in n for n, _ in failed) and any("pixels_clip_pil_wide" in n for n, _ in failed)


# ------------------------------------------------------------------------------------------------ upstream directly

def _maker():
    spec = importlib.util.spec_from_file_location("make_processor_goldens", ROOT / "tools/make_processor_goldens.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.upstream
def test_cosmos3_vs_upstream_directly(tmp_path):
    pytest.importorskip("diffusers")
    m = _maker()
    m.build_qwen_bpe(tmp_path / "tok")
    pipe = m.cosmos3_upstream_pipeline(tmp_path / "tok")
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _preprocess_conditioning_image
    r, o = _sides("cosmos3")
    rp, op = r.Cosmos3Processor(tmp_path / "tok"), o.Cosmos3Processor(tmp_path / "tok")
    prompts = [dict(prompt="Ünïcode\tcafé — 'quotes' <|vision_start|> 12.5%", negative_prompt="bad..",
                    num_frames=45, height=96, width=160, fps=30.0),
               dict(prompt="  spaced  ", negative_prompt=None, num_frames=1, height=64, width=32,
                    add_duration_template=False),
               dict(prompt="turn left", negative_prompt="static", num_frames=17, height=192, width=320, fps=8.0,
                    action_mode="forward_dynamics", action_view_point="third_person_view")]
    for kw in prompts:
        want = pipe.tokenize_prompt(**kw)
        assert tuple(rp.tokenize_prompt(**kw)) == tuple(want) == tuple(op.tokenize_prompt(**kw))
    g = torch.Generator().manual_seed(3)
    for shape, h, w in (((3, 31, 77), 48, 64), ((3, 90, 41), 32, 32)):
        img = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        want = _preprocess_conditioning_image(img, h, w)
        assert torch.equal(r.conditioning_image(img, h, w), want) and torch.equal(op.conditioning_image(img, h, w), want)
    clip = torch.rand(2, 3, 120, 90, generator=g)
    want, size, th, tw = pipe._prepare_action_video_conditioning(clip, 480, 3, "cpu", torch.float32)
    got_r, got_o = r.action_conditioning(clip, 480, 3), op.action_canvas(clip, 480, 3)
    assert torch.equal(got_r.frames, want) and torch.equal(got_o.pixels, want)
    assert got_r.canvas == got_o.canvas_hw == (th, tw) and list(got_r.content) == [int(size[2]), int(size[3])]


@pytest.mark.upstream
def test_wan_vs_upstream_directly(tmp_path):
    pytest.importorskip("diffusers")
    import types

    from diffusers.pipelines.wan import pipeline_wan_i2v
    from diffusers.video_processor import VideoProcessor
    from transformers import AutoTokenizer, CLIPImageProcessor
    m = _maker()
    m.build_umt5(tmp_path / "tok")
    if not hasattr(pipeline_wan_i2v, "ftfy"):
        pipeline_wan_i2v.ftfy = types.SimpleNamespace(fix_text=lambda t: t)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    r, o = _sides("wan")
    rp, op = r.WanProcessor(tmp_path / "tok"), o.WanProcessor(tmp_path / "tok")
    for text, n in (("a  red &amp;amp; blue\ncube ", 20), ("zzz qqq", 8), ("robot " * 30, 10)):
        up = tok([pipeline_wan_i2v.prompt_clean(text)], padding="max_length", max_length=n, truncation=True,
                 add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = up.input_ids[0], up.attention_mask[0]
        t = rp.tokenize(text, n)
        assert torch.equal(t.padded, ids) and torch.equal(t.mask, mask)
        assert torch.equal(op.encode([text], n)[0], ids[mask > 0])
    from PIL import Image
    img = Image.fromarray(torch.randint(0, 256, (77, 53, 3), dtype=torch.uint8).numpy())
    want = VideoProcessor(vae_scale_factor=8).preprocess(img, height=48, width=32)
    assert torch.equal(r.vae_pixels(img, 48, 32), want) and torch.equal(op.vae_image(img, 48, 32), want)
    want = CLIPImageProcessor()(images=img, return_tensors="pt").pixel_values
    assert torch.equal(r.clip_pixels(img), want) and torch.equal(op.clip_image(img), want)
