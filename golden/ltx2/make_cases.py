"""Re-create golden/ltx2/ from upstream (diffusers:LTX2VideoTransformer3DModel, diffusers 0.42.1): seeded random weights on the
tiny variant, the upstream forward with every module output hooked, frozen by `fvparity align --save`.

    python golden/ltx2/make_cases.py
"""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "parity.cli", "align", "ltx2", "--upstream", "diffusers:LTX2VideoTransformer3DModel",
                              "--variant", "tiny", "--seed", "0", "--save", str(HERE / "tiny_forward"), "--force"]))
