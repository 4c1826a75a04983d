"""Re-create golden/ltx2/ from upstream (diffusers:LTX2VideoTransformer3DModel, diffusers 0.42.1): seeded random weights on the
tiny variants, the upstream forward with every module output hooked, frozen by `fvparity align --save`.

    python golden/ltx2/make_cases.py
"""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    # tiny: LTX-2.0, interleaved RoPE, equal head counts; tiny-split: split RoPE, 4 video heads against 2 audio;
    # tiny-2.3: + gated attention, modulated text cross-attention (sigma), no caption projection; tiny-2.5: the
    # text modulation by a fixed table, no video feed-forward biases
    for variant, case in (("tiny", "tiny_forward"), ("tiny-split", "tiny_split_forward"),
                          ("tiny-2.3", "tiny_23_forward"), ("tiny-2.5", "tiny_25_forward")):
        rc = subprocess.call([sys.executable, "-m", "parity.cli", "align", "ltx2", "--upstream",
                              "diffusers:LTX2VideoTransformer3DModel", "--variant", variant, "--seed", "0", "--save",
                              str(HERE / case), "--force"])
        if rc:
            sys.exit(rc)
