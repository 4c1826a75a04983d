"""Write a port's two forwards into a family made by `fvparity port new`: each side's stub (the method that raises
"not implemented: <side>.forward") is replaced by the fixture's text, which may add module-level helpers after it.

    python tests/data/port_forwards/apply.py ROOT FAMILY FIXTURE_DIR
"""

import re
import sys
from pathlib import Path

STUB = re.compile(r"    def (?:forward|__call__)\(.*?\n        raise NotImplementedError\(\"not implemented: \w+\.forward .*?\"\)\n",
                  re.S)
SIDES = {"reference_forward.py": "reference/{f}/model.py", "optimized_forward.py": "optimized/models/{f}/model.py"}


def apply(root: Path, family: str, fixtures: Path) -> None:
    for fixture, target in SIDES.items():
        path = root / target.format(f=family)
        text, n = STUB.subn(lambda m: (fixtures / fixture).read_text(), path.read_text(), count=1)
        if n != 1:
            raise SystemExit(f"{path}: no forward stub to replace")
        path.write_text(text)


if __name__ == "__main__":
    apply(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
