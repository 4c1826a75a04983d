"""Re-create golden/ltx2/ from upstream (diffusers:LTX2VideoTransformer3DModel, diffusers 0.42.1): seeded random weights on the
tiny variants, the upstream forward with every module output hooked, frozen by `fvparity align --save`; then each
case declares the inputs its variant's upstream forward never reads (every stored tensor is compared or ignored).

    python golden/ltx2/make_cases.py [OUT_ROOT]      # default: this folder
"""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# tiny: LTX-2.0, interleaved RoPE, equal head counts; tiny-split: split RoPE, 4 video heads against 2 audio;
# tiny-2.3: + gated attention, modulated text cross-attention (sigma), no caption projection; tiny-2.5: the
# text modulation by a fixed table, no video feed-forward biases
CASES = (("tiny", "tiny_forward"), ("tiny-split", "tiny_split_forward"),
         ("tiny-2.3", "tiny_23_forward"), ("tiny-2.5", "tiny_25_forward"))

_SIGMA = ("this variant's config does not modulate the {what}text cross-attention by sigma (a 2.3 switch), so "
          "upstream's forward never reads it")
_KEYFRAMES = ("this variant's config has no keyframe embedding (a 2.5 switch), so upstream's forward never reads it")


def unread_inputs(cfg: dict) -> dict[str, str]:
    """The stored inputs upstream's forward ignores under this config (read off diffusers 0.42.1's forward)."""
    ignore = {}
    # sigma feeds the prompt AdaLN only when the text cross-attention is modulated (2.5 uses a fixed table instead)
    if not (cfg["cross_attn_mod"] and cfg["use_prompt_adaln_single"]):
        ignore["sigma"] = _SIGMA.format(what="")
    if not (cfg["audio_cross_attn_mod"] and cfg["use_prompt_adaln_single"]):
        ignore["audio_sigma"] = _SIGMA.format(what="audio ")
    if not cfg["use_keyframes_abs_pos_embedding"]:
        ignore["video_keyframes_mask"] = _KEYFRAMES
    return ignore


def main(out_root: Path) -> int:
    for variant, case in CASES:
        rc = subprocess.call([sys.executable, "-m", "parity.cli", "align", "ltx2", "--upstream",
                              "diffusers:LTX2VideoTransformer3DModel", "--variant", variant, "--seed", "0", "--save",
                              str(out_root / case), "--force"], cwd=ROOT)
        if rc:
            return rc
        case_json = out_root / case / "case.json"
        meta = json.loads(case_json.read_text())
        cfg = json.loads((ROOT / "manifests" / "ltx2" / "variants" / f"{variant}.json").read_text())
        meta["ignore"] = {**meta.get("ignore", {}), **unread_inputs(cfg)}
        case_json.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE))
