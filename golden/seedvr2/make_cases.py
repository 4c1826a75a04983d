"""Re-packs the public seedvr2 goldens (../shared/goldens/seedvr2, made by the official SeedVR code) into the
project's case format: golden/seedvr2/<case>/{case.json, upstream/, inputs.safetensors, outputs.safetensors}.
No tensor is recomputed: stored upstream tensors are copied (per-block intermediates, but for the 3B last block's
text, and derivable tensors left out to keep the cases small). Run: python golden/seedvr2/make_cases.py [--src ../shared/goldens/seedvr2]."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
UPSTREAM = {"package": "ByteDance-Seed/SeedVR", "version": "673b56374c2adb21b7628b90df3829d457a52bbb",
            "torch": "see calls[*].environment"}
NADIT_IN = ("vid", "vid_shape", "txt", "txt_shape", "timestep")


def _meta(src: Path, name: str) -> dict:
    m = json.loads((src / name / "case.json").read_text())
    m.pop("file_sha256", None)  # of the original files; the repacked ones differ
    return m


def _case(name: str, probe: str, params: dict, calls: list[dict], description: str, upstream_files: dict[str, Path],
          inputs: dict, outputs: dict, links: dict[str, str] | None = None) -> None:
    d = HERE / name
    shutil.rmtree(d, ignore_errors=True)
    (d / "upstream").mkdir(parents=True)
    for dst, src in upstream_files.items():
        shutil.copyfile(src, d / "upstream" / dst)
    for dst, target in (links or {}).items():  # weights shared with another case: a relative symlink, not a copy
        os.symlink(target, d / "upstream" / dst)
    own = calls[0].get("config", {})
    config = {"seedvr2.vae": lambda: own["model"],
              "seedvr2.restore": lambda: {part: {"model": own[part]["model"]} for part in ("dit", "vae")}}.get(probe)
    (d / "case.json").write_text(json.dumps({
        "family": "seedvr2", "probe": probe, "upstream": {**UPSTREAM, "class": calls[0].get("upstream_class")},
        "upstream_format": "official_pth", "dtype": "float32", "seed": calls[0].get("seeds", {}),
        "tolerance": {"rel_l2": 1e-5}, **({"config": config()} if config else {}), "params": params,
        "description": description, "calls": calls}, indent=1) + "\n")
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(d / "inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in outputs.items()}, str(d / "outputs.safetensors"))


def main(src: Path) -> None:
    io = {c: (load_file(str(src / c / "inputs.safetensors")), load_file(str(src / c / "outputs.safetensors")))
          for c in ("nadit3b_tiny_a", "nadit3b_tiny_b", "nadit7b_tiny", "vae_tiny", "pipeline_3b_tiny")}
    keep = ("vid_sample", "emb", "txt_in")
    ins, outs = {}, {}
    for k, c in enumerate(("nadit3b_tiny_a", "nadit3b_tiny_b")):
        ins.update({f"{n}_{k}": io[c][0][n] for n in NADIT_IN})
        outs.update({f"{n}_3b_{k}": io[c][1][n] for n in keep})
        last = max(int(n.split("_")[1]) for n in io[c][1] if n.startswith("block_"))
        # the last block's text output: upstream returns it (doubled, see README) though nothing reads it
        outs[f"block_{last}_txt_3b_{k}"] = io[c][1][f"block_{last}_txt"]
    outs.update({f"{n}_7b": io["nadit7b_tiny"][1][n] for n in keep})  # its inputs = calls 0 and 1 batched
    # each model carries its own upstream constructor config (dit.model), never a project variant name
    _case("nadit", "seedvr2.nadit", {"models": {
              "3b": {"config": _meta(src, "nadit3b_tiny_a")["config"], "weights": "nadit3b.pth", "batch": "per_call"},
              "7b": {"config": _meta(src, "nadit7b_tiny")["config"], "weights": "nadit7b.pth", "batch": "joint"}},
          "num_calls": 2},
          [_meta(src, "nadit3b_tiny_a"), _meta(src, "nadit3b_tiny_b"), _meta(src, "nadit7b_tiny")],
          "3B NaDiT (dit_v2): two single-sample calls, grid (5,24,80) ragged on every axis and (7,16,24) ragged in "
          "time; 7B NaDiT (dit): both calls as one batch of two",
          {"nadit3b.pth": src / "nadit3b_tiny_a" / "upstream_weights.pth",
           "nadit7b.pth": src / "nadit7b_tiny" / "upstream_weights.pth"}, ins, outs)
    iv, ov = io["vae_tiny"]
    _case("vae", "seedvr2.vae", {}, [_meta(src, "vae_tiny")],
          "video VAE (video_vae_v3) encode (moments, posterior) + decode of a 5x64x64 clip",
          {"upstream_weights.pth": src / "vae_tiny" / "upstream_weights.pth"},
          {"x": iv["x"], "posterior_noise": iv["posterior_noise"]},
          {n: ov[n] for n in ("moments", "posterior_mean", "posterior_std", "posterior_sample", "decoded")})
    ip, op = io["pipeline_3b_tiny"]
    _case("restore", "seedvr2.restore", {}, [_meta(src, "pipeline_3b_tiny")],
          "one-step restoration: tiny 3B DiT + tiny VAE, 17x48x64 clip (VAE slicing in time), batch 1", {},
          {n: ip[n] for n in ("lq_video", "txt_pos", "noise", "vae_posterior_noise")},
          {n: op[n] for n in ("cond_latent", "dit_vid_sample", "x0_latent", "decoded", "output_uint8")},
          links={"dit.pth": "../../nadit/upstream/nadit3b.pth",
                 "vae.pth": "../../vae/upstream/upstream_weights.pth"})
    for f in ("nadit3b_full_keys.txt", "nadit7b_full_keys.txt", "vae_full_keys.txt"):
        shutil.copyfile(src / f, HERE / f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--src", type=Path, default=HERE.parents[2] / "shared" / "goldens" / "seedvr2")
    main(ap.parse_args().src)
