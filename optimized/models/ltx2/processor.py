"""ltx2 processor on the serving path: prompts -> Gemma token ids -> `Ltx2GenerateRequest`. Contract: diffusers
0.42.1 LTX2Pipeline `_get_gemma_prompt_embeds`: `prompt.strip()`, the tokenizer's special tokens added (Gemma's
<bos>), truncated to max_sequence_length; the left padding to max_sequence_length with the tokenizer's pad token
(else its eos) is the loop's (`Ltx2GenerateRequest.pad_id`). The empty negative prompt is tokenized too (CFG).
Needs `tokenizers` (the `text` extra), reading the model directory's tokenizer/tokenizer.json; never transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from manifests.ltx2.request import Ltx2GenerateRequest


class ProcessorError(ValueError):
    """A prompt or tokenizer the processor refuses; names the offending argument."""


class Ltx2Processor:
    def __init__(self, tokenizer_dir: str | Path, *, max_sequence_length: int = 1024):
        from tokenizers import Tokenizer

        root = Path(tokenizer_dir)
        try:
            self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - any reader failure is an unusable tokenizer dir
            raise ProcessorError(f"tokenizer_dir {root}: cannot read tokenizer.json ({e})") from None
        conf_file = root / "tokenizer_config.json"
        conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}

        def token(name: str, default: str) -> str:
            v = conf.get(name, default)
            return v["content"] if isinstance(v, dict) else v
        pad, eos, bos = token("pad_token", "<pad>"), token("eos_token", "<eos>"), token("bos_token", "<bos>")
        pad_id = self.tokenizer.token_to_id(pad) if pad is not None else None
        self.pad_id = pad_id if pad_id is not None else self.tokenizer.token_to_id(eos)   # upstream: pad = eos
        if self.pad_id is None:
            raise ProcessorError(f"tokenizer_dir {root}: the tokenizer has neither its pad token {pad!r} nor {eos!r}")
        self.bos_id = self.tokenizer.token_to_id(bos) if bos is not None else None
        self.max_sequence_length = max_sequence_length

    def encode(self, prompt: str, max_sequence_length: int | None = None) -> torch.Tensor:
        n = max_sequence_length or self.max_sequence_length
        ids = self.tokenizer.encode(prompt.strip(), add_special_tokens=True).ids[:n]
        if not ids:
            raise ProcessorError(f"prompt {prompt[:40]!r}: the tokenizer gives no token (and adds none)")
        return torch.tensor(ids, dtype=torch.int64)

    def build_request(self, prompt: str, negative_prompt: str | None = None, image: Any = None, *,
                      num_frames: int = 121, height: int = 512, width: int = 768, steps: int = 30,
                      guidance: float = 3.0, seed: int | None = 0, frame_rate: float = 24.0,
                      max_sequence_length: int | None = None) -> Ltx2GenerateRequest:
        if image is not None:
            raise ProcessorError("image: this ltx2 model is text-to-video+audio (image-to-video is not ported)")
        if not isinstance(prompt, str):
            raise ProcessorError("prompt must be a string")
        neg = self.encode(negative_prompt or "", max_sequence_length)
        return Ltx2GenerateRequest(text_ids=self.encode(prompt, max_sequence_length), negative_text_ids=neg,
                                   num_frames=num_frames, height=height, width=width, frame_rate=frame_rate,
                                   num_steps=steps, guidance_scale=guidance, seed=seed if seed is not None else 0,
                                   pad_id=int(self.pad_id), bos_id=int(self.bos_id if self.bos_id is not None
                                                                       else neg[0]))


__all__ = ["Ltx2Processor", "ProcessorError"]
