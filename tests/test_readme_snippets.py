"""README.md's Python snippets under "## Engine" and "## Serving" run as pasted: each section's ```python blocks in
order, in one fresh interpreter (a reader pasting them one after another), in an empty directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("Engine", "Serving")


def python_blocks(markdown: str, section: str) -> list[str]:
    """The ```python blocks of a `## section` (its ### subsections included, up to the next ## heading)."""
    m = re.search(rf"^## {re.escape(section)}\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    if m is None:
        return []
    return re.findall(r"^```python\n(.*?)^```", m.group(1), re.M | re.S)


def test_the_sections_have_snippets():
    text = (ROOT / "README.md").read_text()
    for section in SECTIONS:
        assert python_blocks(text, section), f"README.md has no ```python block under ## {section}"


@pytest.mark.parametrize("section", SECTIONS)
def test_readme_snippets_run(section, tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    code = "\n\n".join(python_blocks((ROOT / "README.md").read_text(), section))
    script = tmp_path / "snippet.py"
    script.write_text(code)
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert p.returncode == 0, f"## {section} snippets failed:\n{code}\n--- stderr ---\n{p.stderr[-3000:]}"
