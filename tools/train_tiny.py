"""Train a tiny wan-architecture model on the procedural "moving shapes" set, deterministically, on CPU (issue 21).

    python tools/train_tiny.py                          # the committed recipe -> golden/trained/wan_shapes/
    python tools/train_tiny.py --out /tmp/m --short     # the shortened recipe (the slow test's)

Three parts, trained in order, each with the reference modules (reference/wan), so the weights are canonical:

    text encoder   a tiny UMT5, FROZEN at its seeded random init, over a word-level tokenizer of the caption grammar
                   (tokenizer.json in the `tokenizers` format: WordLevel, whitespace split, "</s>" appended, "<pad>")
    VAE            a tiny Wan 2.1 VAE (2x spatial, 2x temporal: dim_mult (1, 2), z 8, base 8) trained as an autoencoder
                   on 9-frame 32x32 clips (the first frame and four causal 2-frame chunks), two cosine cycles:
                   foreground-weighted L1 + MSE on decode(posterior mode) before its clamp, a small penalty on the
                   latents' scale. Not 4x spatial: the earlier 4x VAE (dim_mult (1, 2, 2)) decoded every ~11 px
                   shape as a blob, its round trips of ground-truth clips scored 0.667 held-out adherence (every
                   square / triangle read as a circle), a ceiling under the 0.90 target that no DiT can pass; this
                   one's round trips score 1.000 (quality.json autoencoder_ceiling). With a 600-step second cycle
                   they scored 0.958: two triangles decoded as blobs
    DiT            a tiny Wan DiT (4 layers, dim 128, patch (1, 4, 4): 8 x 8 pixel tokens), 3500 steps, trained with
                   the wan objective (rectified flow: x_t = (1 - s) x0 + s noise, target
                   noise - x0, timestep 1000 s; s drawn uniformly then shifted by the scheduler's flow_shift), on the
                   VAE's normalised latents of 5- and 9-frame clips (alternating batches: fvgen's default is 5
                   frames), 10% of captions dropped to "" so CFG has an unconditional branch; an EMA of the weights
                   is what is saved

The result goes through a diffusers pipeline root into `converters.pipeline.convert_pipeline` (what
`fvconvert wan --from diffusers ROOT OUT` runs), so the output is exactly a canonical model directory; then
recipe.json (every hyper-parameter, the data seed), loss.csv and SHA256SUMS (sha256sum format, every file) are added.
Determinism: seeded generators and one intra-op thread (recipe.threads; single-threaded CPU kernels reduce in a
fixed order), denormals flushed: two runs
of one recipe on one machine give bitwise-equal weights. Exit codes: 0 ok, 2 bad usage, 3 a bug."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch

from parity.quality.shapes import (
    COLOURS,
    DIRECTIONS,
    SHAPES,
    SPEEDS,
    Caption,
    render_clip,
    training_captions,
)

DEFAULT_OUT = ROOT / "golden" / "trained" / "wan_shapes"


@dataclass
class Recipe:
    data_seed: int = 0
    init_seed: int = 1
    threads: int = 1                             # one intra-op thread: deterministic kernels, and no
                                                 # oversubscription on a shared machine (2 threads ran 8x slower)
    size: int = 32
    vae_frames: int = 9                          # 1 + 4 x 2: the first frame and four causal chunks (trained on
                                                 # 5 frames, the later chunks of a 9-frame clip decode as haze)
    dit_frames: tuple[int, ...] = (5, 9)        # alternating batches
    clips_per_caption: int = 6                   # data bank: training captions x seeds
    # text encoder (frozen random) and tokenizer
    text: dict = field(default_factory=lambda: dict(vocab_size=32, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                    num_heads=4, relative_attention_num_buckets=8,
                                                    relative_attention_max_distance=16, layer_norm_epsilon=1e-6,
                                                    dense_act_fn="gelu_new"))
    max_sequence_length: int = 16                # text tokens (captions have <= 8); see fix_max_sequence_length
    # VAE
    vae: dict = field(default_factory=lambda: dict(z_dim=8, base_dim=8, decoder_base_dim=None, dim_mult=(1, 2),
                                                   num_res_blocks=1, temporal_downsample=(True,),
                                                   is_residual=False, in_channels=3, out_channels=3, patch_size=1))
    vae_steps: int = 300
    vae_batch: int = 8
    vae_lr: float = 2e-3
    vae_refine_steps: int = 1500                 # a second cosine cycle (warm restart) at a smaller batch: 300 steps
    vae_refine_batch: int = 4                    # alone leave colours mixed (red decodes as orange / yellow), 600
                                                 # leave two held-out triangles blobs
    vae_refine_lr: float = 2e-3
    vae_foreground_weight: float = 8.0
    vae_latent_penalty: float = 1e-3
    # DiT
    dit: dict = field(default_factory=lambda: dict(num_heads=4, head_dim=32, in_channels=8, out_channels=8,
                                                   text_dim=32, freq_dim=32, ffn_dim=256, num_layers=4,
                                                   patch_size=(1, 4, 4), cross_attn_norm=True,
                                                   qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
                                                   added_kv_proj_dim=None, rope_max_seq_len=1024,
                                                   pos_embed_seq_len=None))
    dit_steps: int = 3500
    dit_batch: int = 16
    dit_lr: float = 2e-3
    dit_warmup: int = 50
    dit_ema: float = 0.995
    caption_dropout: float = 0.1
    flow_shift: float = 3.0
    num_train_timesteps: int = 1000

    @classmethod
    def short(cls) -> Recipe:
        """The slow test's recipe: same code path, a few steps, a small bank."""
        return cls(clips_per_caption=1, vae_steps=8, vae_batch=2, vae_refine_steps=4, vae_refine_batch=2, dit_steps=16,
                   dit_batch=4, dit_warmup=2)


WORDS = ("a", "moving", *COLOURS, *SHAPES, *DIRECTIONS, *(s for s in SPEEDS if s))
SPECIALS = ("<pad>", "</s>", "<unk>")


# ------------------------------------------------------------------------------------------------ tokenizer

def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer.json (+ tokenizer_config.json naming the pad token) for the grammar's words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {w: i for i, w in enumerate((*SPECIALS, *WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 512}, indent=1))


def token_ids(directory: Path, text: str) -> torch.Tensor:
    from tokenizers import Tokenizer
    return torch.tensor(Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids, dtype=torch.int64)


# ------------------------------------------------------------------------------------------------ init

def init_module(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Seeded init in a fixed order: matrices / conv kernels N(0, 1/fan_in), biases 0, norm gains 1, embeddings
    N(0, 1), modulation tables N(0, 1/D) (Wan's init); the DiT's output projection starts at 0."""
    for name, p in module.named_parameters():
        with torch.no_grad():
            if name.endswith("scale_shift_table"):
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
            elif "embed_tokens" in name or name.endswith("shared.weight") or "relative_attention_bias" in name:
                p.copy_(torch.randn(p.shape, generator=generator))
            elif p.ndim == 1 or name.endswith("gamma"):
                p.zero_() if name.endswith("bias") else p.fill_(1.0)   # biases 0, norm gains 1
            elif name.startswith("proj_out"):
                p.zero_()
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))


# ------------------------------------------------------------------------------------------------ data

def clip_bank(captions: list[Caption], per_caption: int, frames: int, size: int, data_seed: int) -> torch.Tensor:
    """[N, 3, F, H, W] in [-1, 1]: per_caption clips of each caption, seeds drawn from data_seed."""
    rng = np.random.default_rng(data_seed)
    seeds = rng.integers(0, 2 ** 31, size=(len(captions), per_caption))
    clips = [render_clip(c, int(s), frames, (size, size)) for c, row in zip(captions, seeds) for s in row]
    return torch.from_numpy(np.stack(clips)).permute(0, 4, 1, 2, 3).contiguous() * 2 - 1


# ------------------------------------------------------------------------------------------------ stages

def train_vae(recipe: Recipe, vae_cfg, bank: torch.Tensor, log: list[dict]):
    """Two cosine cycles (a warm restart): vae_steps at vae_batch / vae_lr, then vae_refine_steps at
    vae_refine_batch / vae_refine_lr; each cycle a fresh Adam and its own seeded batch order."""
    from reference.wan.vae import WanVAE, unpatchify
    g = torch.Generator().manual_seed(recipe.init_seed + 1)
    vae = WanVAE(vae_cfg)
    init_module(vae, g)
    first = 0
    for steps, batch, lr0, seed in ((recipe.vae_steps, recipe.vae_batch, recipe.vae_lr, recipe.data_seed + 11),
                                    (recipe.vae_refine_steps, recipe.vae_refine_batch, recipe.vae_refine_lr,
                                     recipe.data_seed + 12)):
        opt = torch.optim.Adam(vae.parameters(), lr=lr0)
        order = torch.Generator().manual_seed(seed)
        for step in range(steps):
            lr = lr0 * 0.5 * (1 + math.cos(math.pi * step / steps))
            for group in opt.param_groups:
                group["lr"] = lr
            idx = torch.randint(0, len(bank), (batch,), generator=order)
            x = bank[idx]
            z = vae.encode(x).mode()
            y = unpatchify(vae.decoder(vae.post_quant_conv(z)), vae_cfg.patch_size)   # decode() before its clamp
            # to [-1, 1]: through the clamp a channel that starts below -1 gets no gradient and never learns (a 2x
            # VAE trained through it lost green: every green clip decoded black)
            weight = 1 + recipe.vae_foreground_weight * (x.amax(dim=1, keepdim=True) > -0.9).float()  # the shape
            err = y - x
            recon = (weight * (err.abs() + err * err)).mean()
            loss = recon + recipe.vae_latent_penalty * (z * z).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            log.append({"stage": "vae", "step": first + step, "loss": float(loss), "lr": lr})
            if step % 25 == 0 or step == steps - 1:
                print(f"vae {first + step:5d} loss {float(loss):.4f} recon {float(recon):.4f}", file=sys.stderr,
                      flush=True)
        first += steps
    return vae.eval()


@torch.no_grad()
def encode_bank(vae, bank: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    return torch.cat([vae.encode(bank[i:i + chunk]).mode() for i in range(0, len(bank), chunk)])


def shifted_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-shift map the scheduler applies to its sigmas (s' = shift s / (1 + (shift - 1) s))."""
    return shift * u / (1 + (shift - 1) * u)


def train_dit(recipe: Recipe, dit_cfg, latents: dict[int, torch.Tensor], captions_of: torch.Tensor,
              text: torch.Tensor, null_text: torch.Tensor, log: list[dict]):
    """latents: frames -> normalised latents [N, C, T, h, w] (same caption order in each); captions_of [N] indices
    into text [num_captions, L, d]."""
    from reference.wan.transformer import WanTransformer
    g = torch.Generator().manual_seed(recipe.init_seed + 2)
    dit = WanTransformer(dit_cfg)
    init_module(dit, g)
    ema = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    opt = torch.optim.AdamW(dit.parameters(), lr=recipe.dit_lr, weight_decay=0.0, betas=(0.9, 0.99))
    order = torch.Generator().manual_seed(recipe.data_seed + 21)
    frames = recipe.dit_frames
    for step in range(recipe.dit_steps):
        warm = min(1.0, (step + 1) / recipe.dit_warmup)
        lr = recipe.dit_lr * warm * 0.5 * (1 + math.cos(math.pi * step / recipe.dit_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        lat = latents[frames[step % len(frames)]]
        idx = torch.randint(0, len(lat), (recipe.dit_batch,), generator=order)
        x0 = lat[idx]
        noise = torch.randn(x0.shape, generator=order)
        sigma = shifted_sigma(torch.rand(recipe.dit_batch, generator=order), recipe.flow_shift)
        drop = torch.rand(recipe.dit_batch, generator=order) < recipe.caption_dropout
        ctx = torch.where(drop[:, None, None], null_text.expand(recipe.dit_batch, -1, -1), text[captions_of[idx]])
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        pred = dit(xt, sigma * recipe.num_train_timesteps, ctx)
        loss = ((pred - (noise - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for k, v in dit.state_dict().items():
                ema[k].mul_(recipe.dit_ema).add_(v.detach(), alpha=1 - recipe.dit_ema)
        log.append({"stage": "dit", "step": step, "loss": float(loss), "lr": lr})
        if step % 50 == 0 or step == recipe.dit_steps - 1:
            print(f"dit {step:5d} loss {float(loss):.4f}", file=sys.stderr, flush=True)
    dit.load_state_dict(ema)
    return dit.eval()


# ------------------------------------------------------------------------------------------------ output

def _save(d: Path, config: dict, weights: dict[str, torch.Tensor], name: str) -> None:
    from safetensors.torch import save_file
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(d / name))


def write_pipeline_root(root: Path, cfg, weights: dict[str, dict[str, torch.Tensor]], tokenizer_dir: Path) -> None:
    """A diffusers WanPipeline root (the layout `fvconvert wan --from diffusers` reads)."""
    te = dict(weights["text_encoder"], **{"encoder.embed_tokens.weight": weights["text_encoder"]["shared.weight"].clone()})
    _save(root / "transformer", {"_class_name": "WanTransformer3DModel", **cfg.dit.to_diffusers_config()},
          weights["transformer"], "diffusion_pytorch_model.safetensors")
    _save(root / "text_encoder", cfg.text_encoder.to_transformers_config(), te, "model.safetensors")  # tied (upstream)
    _save(root / "vae", {"_class_name": "AutoencoderKLWan", **cfg.vae.to_diffusers_config()}, weights["vae"],
          "diffusion_pytorch_model.safetensors")
    shutil.copytree(tokenizer_dir, root / "tokenizer")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": cfg.num_train_timesteps,
         "flow_shift": cfg.flow_shift, "use_flow_sigmas": True, "prediction_type": "flow_prediction",
         "solver_order": 2, "solver_type": "bh2", "lower_order_final": True}, indent=1))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"], "transformer_2": [None, None], "boundary_ratio": None,
        "expand_timesteps": False}, indent=1))


def sha256sums(directory: Path) -> str:
    lines = []
    for f in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "SHA256SUMS"):
        lines.append(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.relative_to(directory).as_posix()}")
    return "\n".join(lines) + "\n"


VAE_FIELDS = ("data_seed", "init_seed", "threads", "size", "vae_frames", "clips_per_caption", "vae", "vae_steps",
              "vae_batch", "vae_lr", "vae_refine_steps", "vae_refine_batch", "vae_refine_lr", "vae_foreground_weight",
              "vae_latent_penalty")


def reused_vae(directory: Path, recipe: Recipe, vae_cfg, log: list[dict]):
    """The VAE of an earlier run of this tool whose recipe has the same VAE fields (its training is deterministic,
    so it is the VAE this recipe would train); its loss rows are copied into `log`."""
    from manifests.checkpoint import load_state, read_checkpoint
    from reference.wan.vae import WanVAE
    old = json.loads((directory / "recipe.json").read_text())
    mine = json.loads(json.dumps(asdict(recipe)))
    differ = [k for k in VAE_FIELDS if old.get(k) != mine.get(k)]
    if differ:
        raise SystemExit(f"error: --vae-from {directory}: its recipe differs in {', '.join(differ)}")
    vae = WanVAE(vae_cfg)
    state = load_state(read_checkpoint(directory), component="vae")
    vae.load_state_dict({k: v for k, v in state.items()}, strict=True)
    with open(directory / "loss.csv") as f:
        log.extend({"stage": r["stage"], "step": int(r["step"]), "loss": float(r["loss"]), "lr": float(r["lr"])}
                   for r in csv.DictReader(f) if r["stage"] == "vae")
    return vae.eval()


def train(recipe: Recipe, vae_from: Path | None = None
          ) -> tuple[object, dict[str, dict[str, torch.Tensor]], list[dict], Path]:
    """Train everything; (WanModelConfig, canonical weights by component, loss log, tokenizer dir)."""
    from manifests.wan.config import WanVAEConfig
    from manifests.wan.dit import UMT5Config, WanDiTConfig
    from manifests.wan.model import WanModelConfig
    from reference.wan.text_encoder import UMT5Encoder, encode_prompts

    torch.set_num_threads(recipe.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(recipe.init_seed)
    log: list[dict] = []
    tok_dir = Path(tempfile.mkdtemp(prefix="wan_shapes_tok_"))
    write_tokenizer(tok_dir)

    text_cfg = UMT5Config(**recipe.text).validate()
    te = UMT5Encoder(text_cfg)
    init_module(te, torch.Generator().manual_seed(recipe.init_seed))
    te.eval().requires_grad_(False)
    captions = training_captions()
    L = recipe.max_sequence_length
    with torch.no_grad():
        text = torch.cat([encode_prompts(te, [token_ids(tok_dir, c.text)], L) for c in captions])
        null_text = encode_prompts(te, [token_ids(tok_dir, "")], L)

    t0 = time.time()
    probe_mean, probe_std = tuple([0.0] * recipe.vae["z_dim"]), tuple([1.0] * recipe.vae["z_dim"])
    vae_cfg = WanVAEConfig(**{**recipe.vae, "dim_mult": tuple(recipe.vae["dim_mult"]),
                              "temporal_downsample": tuple(recipe.vae["temporal_downsample"])},
                           latents_mean=probe_mean, latents_std=probe_std).validate()
    vae_bank = clip_bank(captions, recipe.clips_per_caption, recipe.vae_frames, recipe.size, recipe.data_seed)
    vae = reused_vae(vae_from, recipe, vae_cfg, log) if vae_from else train_vae(recipe, vae_cfg, vae_bank, log)
    print(f"vae trained in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)

    raw = {f: encode_bank(vae, clip_bank(captions, recipe.clips_per_caption, f, recipe.size, recipe.data_seed + f))
           for f in recipe.dit_frames}
    allz = torch.cat([z.transpose(0, 1).reshape(z.shape[1], -1) for z in raw.values()], dim=1)
    mean = allz.mean(1)
    std = allz.std(1).clamp_min(1e-3)
    vae_cfg = dataclasses.replace(vae_cfg, latents_mean=tuple(round(float(m), 6) for m in mean),
                                  latents_std=tuple(round(float(s), 6) for s in std)).validate()
    m = torch.tensor(vae_cfg.latents_mean).view(1, -1, 1, 1, 1)
    s = torch.tensor(vae_cfg.latents_std).view(1, -1, 1, 1, 1)
    latents = {f: (z - m) / s for f, z in raw.items()}   # the pipeline's normalisation (mean, 1 / std)
    captions_of = torch.arange(len(captions)).repeat_interleave(recipe.clips_per_caption)

    t1 = time.time()
    dit_cfg = WanDiTConfig(**{**recipe.dit, "patch_size": tuple(recipe.dit["patch_size"])}).validate()
    dit = train_dit(recipe, dit_cfg, latents, captions_of, text, null_text, log)
    print(f"dit trained in {time.time() - t1:.0f}s", file=sys.stderr, flush=True)

    cfg = WanModelConfig(task="t2v", dit=dit_cfg, text_encoder=text_cfg, vae=vae_cfg,
                         max_sequence_length=recipe.max_sequence_length,
                         num_train_timesteps=recipe.num_train_timesteps, flow_shift=recipe.flow_shift,
                         solver="unipc").validate()
    weights = {"transformer": {k: v.detach().clone() for k, v in dit.state_dict().items()},
               "text_encoder": {k: v.detach().clone() for k, v in te.state_dict().items()},
               "vae": {k: v.detach().clone() for k, v in vae.state_dict().items()}}
    return cfg, weights, log, tok_dir


def fix_max_sequence_length(out: Path, n: int) -> None:
    """A pipeline root does not carry max_sequence_length (a `__call__` argument): the converter takes it from
    `--variant` or writes the pipeline default 512. Set the recipe's n, and the weights_version over the new config
    exactly as the converter computes it (what `fvconvert wan --variant V` writes for a variant V with this n)."""
    from manifests.checkpoint import weights_version_of
    index = json.loads((out / "model_index.json").read_text())
    report = json.loads((out / "conversion_report.json").read_text())
    index["config"]["max_sequence_length"] = report["config"]["max_sequence_length"] = n
    config_hash = hashlib.sha256(json.dumps(index["config"], sort_keys=True).encode()).hexdigest()
    version = weights_version_of(
        [(f"component:{name}", c["weights_version"]) for name, c in report["components"].items()]
        + [("config", config_hash)]
        + [(a["path"], a["sha256"]) for files in report["assets"].values() for a in files])
    index["weights_version"] = report["weights_version"] = version
    for path, data in (("model_index.json", index), ("conversion_report.json", report)):
        (out / path).write_text(json.dumps(data, indent=2) + "\n")   # converters.writer.json_bytes


STRIP_PROMPTS = ("a red square moving right", "a green circle moving down quickly", "a blue triangle moving left",
                 "a yellow circle moving up slowly")
REDUNDANCY_PROMPT = "a red square moving right"


def strip_png(engine, path: Path, frames: int = 9, every: int = 2, zoom: int = 3) -> None:
    """A frame strip for the README: one row per STRIP_PROMPTS entry (engine, evaluate.FRAMES / STEPS / GUIDANCE
    settings, seed 0), every `every`-th frame, nearest-upscaled by `zoom`, 2 px gaps."""
    from PIL import Image

    from parity.quality.evaluate import engine_clip
    rows = [engine_clip(engine, p, 0, frames=frames)[::every] for p in STRIP_PROMPTS]
    n, h, w = len(rows[0]), rows[0].shape[1] * zoom, rows[0].shape[2] * zoom
    canvas = np.full((len(rows) * (h + 2) - 2, n * (w + 2) - 2, 3), 255, np.uint8)
    for r, clip in enumerate(rows):
        for c, frame in enumerate(clip):
            canvas[r * (h + 2):r * (h + 2) + h, c * (w + 2):c * (w + 2) + w] = frame.repeat(zoom, 0).repeat(zoom, 1)
    Image.fromarray(canvas).save(path, optimize=True)


def step_redundancy(engine_dir: Path) -> dict:
    """Per-step relative change of the DiT's (cond-branch) output, |v_i - v_(i-1)| / |v_(i-1)|, on one prompt with
    the reference pipeline at the evaluation settings: how much a step cache has to work with."""
    from manifests.checkpoint import load_state, read_checkpoint
    from parity.quality.evaluate import FRAMES, GUIDANCE, SIZE, STEPS
    from reference.wan.pipeline import WanReferencePipeline
    from reference.wan.processor import WanProcessor
    ckpt = read_checkpoint(engine_dir)
    ref = WanReferencePipeline(ckpt.typed_config(), {n: load_state(ckpt, component=n) for n in ckpt.components})
    req = WanProcessor(ckpt.assets["tokenizer"]).build_request(
        REDUNDANCY_PROMPT, None, None, num_frames=FRAMES, height=SIZE[0], width=SIZE[1], steps=STEPS,
        guidance=GUIDANCE, seed=0)
    outputs = []
    hook = ref.transformer.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().clone()))
    try:
        ref.generate(req)
    finally:
        hook.remove()
    cond = outputs[0::2] if req.uses_cfg else outputs      # cond then uncond per step (the reference's order)
    change = [float((b - a).norm() / a.norm()) for a, b in zip(cond[:-1], cond[1:])]
    return {"prompt": REDUNDANCY_PROMPT, "steps": STEPS, "guidance": GUIDANCE, "frames": FRAMES,
            "rel_change_per_step": [round(c, 4) for c in change]}


def write_quality(model_dir: Path) -> dict:
    """quality.json (held-out adherence through the engine, the VAE's ceiling, step redundancy) and SHA256SUMS of a
    model directory: what training ends with, and what `--rescore` redoes after the evaluator changes."""
    from optimized import Engine
    from parity.quality.evaluate import autoencoder_ceiling, held_out_adherence
    held = held_out_adherence(Engine.from_checkpoint(model_dir))
    ceiling = autoencoder_ceiling(model_dir)
    quality = {"held_out_adherence": held.rate, "held_out_all_correct": held.all_correct,
               "settings": held.settings, "failures": [s.to_dict() for s in held.scores if not s.all_ok],
               "step_redundancy": step_redundancy(model_dir),
               "autoencoder_ceiling": {"held_out_adherence": ceiling.rate, "all_correct": ceiling.all_correct,
                                       "settings": ceiling.settings,
                                       "failures": [s.to_dict() for s in ceiling.scores if not s.all_ok]}}
    (model_dir / "quality.json").write_text(json.dumps(quality, indent=1) + "\n")
    print(f"held-out adherence {held.rate:.3f} (all correct {held.all_correct:.3f}); the VAE's round trips of "
          f"the ground truth {ceiling.rate:.3f}", file=sys.stderr)
    (model_dir / "SHA256SUMS").write_text(sha256sums(model_dir))
    return quality


def write_model(out: Path, recipe: Recipe, cfg, weights, log: list[dict], tok_dir: Path, seconds: float,
                cpu_seconds: float | None = None) -> None:
    from converters.pipeline import convert_pipeline
    with tempfile.TemporaryDirectory(prefix="wan_shapes_root_") as tmp:
        root = Path(tmp) / "root"
        write_pipeline_root(root, cfg, weights, tok_dir)
        staged = Path(tmp) / "out"
        convert_pipeline("wan", root, staged, skip_parity=True)
        fix_max_sequence_length(staged, recipe.max_sequence_length)
        rec = asdict(recipe)
        rec["training_seconds"] = round(seconds, 1)                  # wall
        if cpu_seconds is not None:
            rec["training_cpu_seconds"] = round(cpu_seconds, 1)      # this process's CPU time (one thread)
        rec["final_loss"] = {st: next(r["loss"] for r in reversed(log) if r["stage"] == st) for st in ("vae", "dit")}
        (staged / "recipe.json").write_text(json.dumps(rec, indent=1) + "\n")
        with open(staged / "loss.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["stage", "step", "loss", "lr"])
            w.writeheader()
            for r in log:
                w.writerow({"stage": r["stage"], "step": r["step"], "loss": f"{r['loss']:.6g}", "lr": f"{r['lr']:.6g}"})
        from optimized import Engine
        strip_png(Engine.from_checkpoint(staged), staged / "strip.png")
        write_quality(staged)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staged, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"model directory to (re)write (default {DEFAULT_OUT})")
    p.add_argument("--short", action="store_true", help="the shortened recipe (seconds; the slow test's)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a scalar recipe field (dit_steps=800), a scalar of a part's config "
                   "(dit.num_layers=6) or an int tuple of one (dit.patch_size=1,2,2); repeatable")
    p.add_argument("--vae-from", metavar="DIR", help="reuse the VAE of an earlier output of this tool whose recipe "
                   "has the same VAE fields (iterating on the DiT recipe)")
    p.add_argument("--rescore", metavar="DIR", help="no training: rewrite DIR's quality.json and SHA256SUMS with the "
                   "current evaluator (after parity/quality changes)")
    args = p.parse_args(argv)
    if args.rescore:
        if not (Path(args.rescore) / "recipe.json").is_file():
            print(f"error: --rescore {args.rescore}: not a model directory written by this tool (no recipe.json)",
                  file=sys.stderr)
            return 2
        write_quality(Path(args.rescore))
        return 0
    recipe = Recipe.short() if args.short else Recipe()
    for item in args.set:
        key, _, value = item.partition("=")
        part, _, sub = key.partition(".")
        table = getattr(recipe, part, None)
        try:
            if sub and isinstance(table, dict) and isinstance(table.get(sub), (int, float, str)) \
                    and not isinstance(table.get(sub), bool):
                table[sub] = type(table[sub])(value)             # a scalar inside a part's config: dit.num_layers=6
            elif sub and isinstance(table, dict) and isinstance(table.get(sub), (tuple, list)) \
                    and all(type(v) is int for v in table[sub]):
                parsed = tuple(int(v) for v in value.split(","))   # an int tuple: dit.patch_size=1,2,2
                if len(parsed) != len(table[sub]):
                    raise ValueError(value)
                table[sub] = parsed
            elif not sub and hasattr(recipe, key) and not isinstance(getattr(recipe, key), (dict, tuple)):
                setattr(recipe, key, type(getattr(recipe, key))(value))
            else:
                raise KeyError(key)
        except KeyError:
            print(f"error: --set {item}: not a scalar recipe field (FIELD=VALUE, or PART.FIELD=VALUE for a scalar "
                  f"of the text / vae / dit configs)", file=sys.stderr)
            return 2
        except ValueError:
            print(f"error: --set {item}: {value!r} is not of the type of "
                  f"{table[sub] if sub else getattr(recipe, key)!r}",
                  file=sys.stderr)
            return 2
    t0, c0 = time.time(), time.process_time()
    cfg, weights, log, tok_dir = train(recipe, Path(args.vae_from) if args.vae_from else None)
    write_model(Path(args.out), recipe, cfg, weights, log, tok_dir, time.time() - t0, time.process_time() - c0)
    print(f"wrote {args.out} in {time.time() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
