"""Goldens for the processors (probes `cosmos3.processor`, `wan.processor`; format in golden/README.md).

Builds small tokenizers locally with `tokenizers` (trained on a tiny corpus, saved as tokenizer.json +
tokenizer_config.json [+ chat_template.jinja]), loads them through transformers exactly as a checkpoint's folder is
loaded (`AutoTokenizer.from_pretrained`: Qwen2Tokenizer / PreTrainedTokenizerFast / T5Tokenizer), and records what
the upstream pipelines' own prompt, tokenizer and image-processor code returns — no model runs:

  cosmos3  `Cosmos3OmniPipeline.tokenize_prompt` and `_prepare_action_video_conditioning` on a real pipeline object
           (tiny Wan VAE with 16x spatial compression, no transformer), `_preprocess_conditioning_image`
  wan      `WanImageToVideoPipeline._get_t5_prompt_embeds` (unbound, a text encoder stub that records the ids and
           mask it is given), `VideoProcessor(vae_scale_factor=8).preprocess`, `encode_image` (unbound, the default
           `CLIPImageProcessor()` and an image encoder stub that records pixel_values)

ftfy is not installed here: the wan pipeline module gets an identity `ftfy.fix_text` (the prompts are chosen so that
ftfy would leave them unchanged). Usage: python tools/make_processor_goldens.py --out golden [--check]
(--check rebuilds in a temp dir and requires identical tensors).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import json
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # deterministic training

CORPUS = ["a cat walks on the beach at sunset", "the robot arm picks up a red cube and puts it down",
          "This video is of 480x832 resolution.", "The video is 3.9 seconds long and is of 24 FPS.",
          "You are a helpful assistant who will generate videos from a give prompt.", "blurry, low quality",
          "This image is not of 512x512 resolution.", "captured from a first-person perspective",
          '{"actions": [{"time": "0:00-0:01", "description": "pick."}], "duration": "1s", "fps": 24.0}']
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# a Qwen3-VL-style chat template (system turn, user turns with optional vision content, generation prompt)
CHAT_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].content is string %}
        {{- messages[0].content }}
    {%- else %}
        {%- for content in messages[0].content %}
            {%- if 'text' in content %}
                {{- content.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _added_tokens_decoder(tok, names):
    return {str(tok.token_to_id(s)): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False} for s in names}


def build_qwen_bpe(d: Path) -> None:
    """Byte-level BPE with Qwen2's normaliser / split regex (what transformers' Qwen2Tokenizer rebuilds)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
        vocab_size=360, special_tokens=QWEN_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "bos_token": None, "added_tokens_decoder": _added_tokens_decoder(tok, QWEN_SPECIALS)},
        indent=1))


def build_qwen_tiny(d: Path) -> None:
    """WordLevel on whitespace (ids < 128: usable with the tiny cosmos3 variant); chat template in the config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS + ["system user assistant"], trainers.WordLevelTrainer(
        vocab_size=120, special_tokens=["[UNK]"] + QWEN_SPECIALS, show_progress=False))
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "[UNK]", "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": _added_tokens_decoder(tok, ["[UNK]"] + QWEN_SPECIALS)}, indent=1))


def build_umt5(d: Path) -> None:
    """Unigram with T5's pre-tokenizer and "$A </s>" post-processor (what transformers' T5Tokenizer rebuilds). The
    pieces are listed, not trained (the Unigram trainer is not deterministic): <pad> 0, </s> 1, <unk> 2, then every
    corpus word as "▁word", then single characters; longer pieces score higher."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    words = sorted({w for line in CORPUS for w in line.split()})
    chars = sorted({c for line in CORPUS for c in line if not c.isspace()})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("▁" + w, -10.0 + len(w) * 0.5) for w in words][:60] \
        + [("▁", -3.0)] + [(c, -12.0) for c in chars]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
                                                       special_tokens=[("</s>", 1)])
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "extra_ids": 0, "additional_special_tokens": [], "model_max_length": 512}, indent=1))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _u8(shape, seed) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=_gen(seed), dtype=torch.uint8)


def _pil(hwc: torch.Tensor):
    from PIL import Image
    return Image.fromarray(hwc.numpy())


# ---------------------------------------------------------------------------------------------------- cosmos3

COSMOS3_PROMPTS = [  # name, tokenize_prompt kwargs
    ("t2v", dict(prompt="A cat walks on the beach at sunset.", negative_prompt=None, num_frames=93, height=480,
                 width=832, fps=24.0)),
    ("t2v_neg_fps16", dict(prompt="the robot arm picks up a red cube...", negative_prompt="blurry, low quality",
                           num_frames=61, height=256, width=320, fps=16.0)),
    ("half_rounding", dict(prompt="a cat", negative_prompt="", num_frames=3, height=32, width=48, fps=23.5)),
    ("t2i_empty", dict(prompt="", negative_prompt="", num_frames=1, height=512, width=512)),
    ("no_system", dict(prompt="a red cube", negative_prompt=None, num_frames=5, height=32, width=32,
                       use_system_prompt=False)),
    ("no_templates", dict(prompt="a red cube.", negative_prompt="blurry.", num_frames=5, height=32, width=32,
                          add_resolution_template=False, add_duration_template=False)),
    ("special_in_prompt", dict(prompt="look <|im_end|> here\nand  there", negative_prompt=None, num_frames=9,
                               height=64, width=64)),
    ("action_policy", dict(prompt="pick up the red cube", negative_prompt=None, num_frames=5, height=256,
                           width=320, action_mode="policy", action_view_point="ego_view")),
    ("action_unknown_view", dict(prompt="puts it down!", negative_prompt="blurry", num_frames=61, height=320,
                                 width=256, fps=2.0, action_mode="forward_dynamics", action_view_point="top_view")),
    ("action_minutes", dict(prompt="", negative_prompt=None, num_frames=151, height=192, width=320, fps=2.0,
                            action_mode="inverse_dynamics", action_view_point=None)),
]
TINY_PROMPTS = ["t2v", "t2i_empty", "no_templates", "action_policy"]

# i2v images: name, input kind, shape / seed, target (height, width)
COSMOS3_I2V = [("i2v_uint8_down", "u8_chw", (3, 37, 53), 32, 48), ("i2v_pil_up", "pil", (20, 30, 3), 32, 64),
               ("i2v_float01", "f01_chw", (3, 40, 40), 32, 32), ("i2v_floatpm1", "fpm1_chw", (3, 50, 30), 48, 32),
               ("i2v_numpy_hwc", "u8_hwc_np", (33, 33, 3), 16, 32)]
# action clips: name, frames kind, frame shape, number of frames, tier, num_frames (chunk + 1)
COSMOS3_ACTION = [("act_pil_single", "pil", (100, 130, 3), 1, 256, 2),
                  ("act_pil_clip_reflect", "pil", (200, 260, 3), 2, 256, 3),
                  ("act_tensor_replicate", "f01_chw", (3, 64, 200), 2, 256, 2),
                  ("act_pil_downscale", "pil", (350, 250, 3), 1, 256, 2)]
BAND = 6  # rows stored each side of the content / padding seam (the whole canvas is pinned by its sha256)


def _image_input(kind: str, shape, seed: int):
    """(stored tensor, the object handed to upstream)."""
    if kind in ("u8_chw", "u8_hwc_np", "pil"):
        t = _u8(shape, seed)
        obj = {"u8_chw": lambda: t, "u8_hwc_np": lambda: t.numpy(), "pil": lambda: _pil(t)}[kind]()
        return t, obj
    t = torch.rand(shape, generator=_gen(seed))
    if kind == "fpm1_chw":
        t = t * 2 - 1
    return t, t


def pixel_sha256(x: torch.Tensor) -> str:
    """sha256 of a float32 tensor's bytes (C order): exact pixels without storing megabytes."""
    return hashlib.sha256(x.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def cosmos3_upstream_pipeline(tokenizer_dir: Path):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline
    from transformers import AutoTokenizer

    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[
        False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4, scale_factor_spatial=16)
    return Cosmos3OmniPipeline(transformer=None, text_tokenizer=AutoTokenizer.from_pretrained(str(tokenizer_dir)),
                               vae=vae, scheduler=UniPCMultistepScheduler(), enable_safety_checker=False)


def make_cosmos3(case: Path, tokenizer: str) -> None:
    import diffusers
    import transformers
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _preprocess_conditioning_image

    build = {"bpe": build_qwen_bpe, "tiny": build_qwen_tiny}[tokenizer]
    build(case / "upstream")
    pipe = cosmos3_upstream_pipeline(case / "upstream")
    inputs, outputs, prompts, images, actions = {}, {}, [], [], []
    names = [n for n, _ in COSMOS3_PROMPTS] if tokenizer == "bpe" else TINY_PROMPTS
    for name, kw in COSMOS3_PROMPTS:
        if name not in names:
            continue
        cond, uncond = pipe.tokenize_prompt(**kw)
        outputs[f"cond_ids_{name}"] = torch.tensor(cond, dtype=torch.int64)
        outputs[f"uncond_ids_{name}"] = torch.tensor(uncond, dtype=torch.int64)
        prompts.append({"name": name, **kw})
    if tokenizer == "bpe":
        for i, (name, kind, shape, h, w) in enumerate(COSMOS3_I2V):
            stored, obj = _image_input(kind, shape, 100 + i)
            inputs[f"image_{name}"] = stored
            outputs[f"pixels_{name}"] = _preprocess_conditioning_image(obj, height=h, width=w)
            images.append({"name": name, "kind": kind, "height": h, "width": w})
        for i, (name, kind, shape, n, tier, num_frames) in enumerate(COSMOS3_ACTION):
            frames = [_image_input(kind, shape, 200 + 10 * i + j) for j in range(n)]
            inputs[f"clip_{name}"] = torch.stack([f[0] for f in frames])
            objs = [f[1] for f in frames]
            clip = objs if kind == "pil" else torch.stack(objs)      # upstream: a list of PIL / a [T, 3, H, W] tensor
            px, size, th, tw = pipe._prepare_action_video_conditioning(clip, tier, num_frames, "cpu", torch.float32)
            ch = int(size[2])
            outputs[f"band_{name}"] = px[:, :, :, max(ch - BAND, 0):ch + BAND]
            outputs[f"canvas_{name}"] = torch.tensor([th, tw, ch, int(size[3])], dtype=torch.int64)
            actions.append({"name": name, "kind": kind, "tier": tier, "num_frames": num_frames,
                            "band_rows": [max(ch - BAND, 0), ch + BAND], "shape": list(px.shape),
                            "sha256": pixel_sha256(px)})
    meta = {"family": "cosmos3", "probe": "cosmos3.processor",
            "upstream": {"package": "diffusers", "version": diffusers.__version__, "class": "Cosmos3OmniPipeline",
                         "transformers": transformers.__version__, "torch": torch.__version__,
                         "tokenizer_class": type(pipe.text_tokenizer).__name__},
            "upstream_format": "tokenizer", "dtype": "float32", "seed": 100, "tolerance": {"max_abs": 0.0},
            "params": {"prompts": prompts, "i2v": images, "action": actions}}
    _write(case, meta, inputs, outputs)


# ---------------------------------------------------------------------------------------------------- wan

WAN_PROMPTS = [("plain", "A cat walks on the beach at sunset.", 512), ("whitespace", "  a  cat\n\twalks \r\n ", 512),
               ("html", "Tom &amp;amp; Jerry &lt;3 &quot;cube&quot;", 512), ("empty", "", 512),
               ("truncated", "the robot arm picks up a red cube and puts it down " * 4, 16),
               ("unknown_chars", "Über café 東京", 24)]
WAN_VAE_IMAGES = [("vae_pil", "pil", (40, 56, 3), 32, 48), ("vae_float01", "f01_chw", (3, 20, 24), 32, 48),
                  ("vae_floatpm1", "fpm1_chw", (3, 32, 48), 32, 48)]
WAN_CLIP_IMAGES = [("clip_pil_wide", "pil", (120, 300, 3)), ("clip_pil_tall_up", "pil", (260, 150, 3)),
                   ("clip_u8_hwc", "u8_hwc_np", (100, 100, 3)),
                   # long edge 224 * 70 / 50 = 313.6: upstream truncates (313), a rounding port gets 314; wide, tall
                   ("clip_pil_wide_frac", "pil", (50, 70, 3)), ("clip_pil_tall_frac", "pil", (70, 50, 3))]


class _RecordingEncoder(torch.nn.Module):
    """Stands in for UMT5 / CLIP vision: records its inputs, returns zeros."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def forward(self, ids=None, mask=None, pixel_values=None, output_hidden_states=None):
        self.seen.append((ids, mask) if pixel_values is None else pixel_values)
        if pixel_values is not None:
            return types.SimpleNamespace(hidden_states=[torch.zeros(1, 2, 4)] * 2)
        return types.SimpleNamespace(last_hidden_state=torch.zeros(*ids.shape, 4))


def make_wan(case: Path) -> None:
    import diffusers
    import transformers
    from diffusers.pipelines.wan import pipeline_wan_i2v
    from diffusers.video_processor import VideoProcessor
    from transformers import AutoTokenizer, CLIPImageProcessor

    if not hasattr(pipeline_wan_i2v, "ftfy"):  # ftfy absent: identity fix_text (the prompts are ftfy-clean)
        pipeline_wan_i2v.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    build_umt5(case / "upstream")
    encoder = _RecordingEncoder()
    ns = types.SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(case / "upstream")), text_encoder=encoder,
                               _execution_device=torch.device("cpu"), image_processor=CLIPImageProcessor(),
                               image_encoder=None)
    inputs, outputs, prompts, vae_images, clip_images = {}, {}, [], [], []
    for name, text, n in WAN_PROMPTS:
        pipeline_wan_i2v.WanImageToVideoPipeline._get_t5_prompt_embeds(ns, text, max_sequence_length=n)
        ids, mask = encoder.seen.pop()
        outputs[f"padded_ids_{name}"], outputs[f"mask_{name}"] = ids[0], mask[0]
        outputs[f"ids_{name}"] = ids[0][mask[0] > 0]
        prompts.append({"name": name, "prompt": text, "max_sequence_length": n})
    vp = VideoProcessor(vae_scale_factor=8)  # WanImageToVideoPipeline's (Wan2.1 VAE: 8x)
    for i, (name, kind, shape, h, w) in enumerate(WAN_VAE_IMAGES):
        stored, obj = _image_input(kind, shape, 300 + i)
        inputs[f"image_{name}"] = stored
        outputs[f"pixels_{name}"] = vp.preprocess(obj, height=h, width=w)
        vae_images.append({"name": name, "kind": kind, "height": h, "width": w})
    ns.image_encoder = _RecordingEncoder()
    for i, (name, kind, shape) in enumerate(WAN_CLIP_IMAGES):
        stored, obj = _image_input(kind, shape, 400 + i)
        inputs[f"image_{name}"] = stored
        pipeline_wan_i2v.WanImageToVideoPipeline.encode_image(ns, obj, torch.device("cpu"))
        px = ns.image_encoder.seen.pop()
        outputs[f"rows_{name}"] = px[:, :, :BAND]
        clip_images.append({"name": name, "kind": kind, "shape": list(px.shape), "sha256": pixel_sha256(px)})
    meta = {"family": "wan", "probe": "wan.processor",
            "upstream": {"package": "diffusers", "version": diffusers.__version__,
                         "class": "WanImageToVideoPipeline", "transformers": transformers.__version__,
                         "torch": torch.__version__, "tokenizer_class": type(ns.tokenizer).__name__,
                         "image_processor_class": type(ns.image_processor).__name__, "ftfy": None},
            "upstream_format": "tokenizer", "dtype": "float32", "seed": 300, "tolerance": {"max_abs": 0.0},
            "params": {"prompts": prompts, "vae_images": vae_images, "clip_images": clip_images}}
    _write(case, meta, inputs, outputs)


NO_INPUTS = {"none": "placeholder: the case has no image or clip inputs and safetensors writes no empty file"}


def _write(case: Path, meta: dict, inputs: dict, outputs: dict) -> None:
    if not inputs:  # every stored tensor is checked or ignored with a reason (golden/README.md)
        meta = {**meta, "ignore": NO_INPUTS}
    (case / "case.json").write_text(json.dumps(meta, indent=1))
    save_file({k: v.contiguous() for k, v in inputs.items()} or {"none": torch.zeros(0)},
              str(case / "inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in outputs.items()}, str(case / "outputs.safetensors"))


CASES = {"cosmos3/proc_qwen_bpe": lambda p: make_cosmos3(p, "bpe"),
         "cosmos3/proc_wordlevel_tiny": lambda p: make_cosmos3(p, "tiny"),
         "wan/proc_umt5": make_wan}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="golden")
    ap.add_argument("--check", action="store_true", help="rebuild into a temp dir and compare with --out")
    ap.add_argument("--only", action="append", choices=sorted(CASES), help="only this case (repeatable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp()) if args.check else Path(args.out)
    try:
        for rel, make in CASES.items():
            if args.only and rel not in args.only:
                continue
            path = root / rel
            if path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
            make(path)
            if args.check:
                for f in ("inputs.safetensors", "outputs.safetensors"):
                    a, b = load_file(str(path / f)), load_file(str(Path(args.out) / rel / f))
                    if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
                        print(f"{rel}/{f}: differs from the committed case", file=sys.stderr)
                        return 1
            print(f"{rel}: ok")
    finally:
        if args.check:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
