"""reference/ and optimized/ never import each other (parity between modules that share code proves nothing)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def violations(src: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / src).rglob("*.py")):
        for mod in imported_modules(path):
            if mod.split(".")[0] in forbidden:
                out.append(f"{path.relative_to(ROOT)} imports {mod}")
        text = path.read_text()
        for name in forbidden:  # dynamic imports too
            if f"import_module(\"{name}" in text or f"__import__(\"{name}" in text:
                out.append(f"{path.relative_to(ROOT)} dynamically imports {name}")
    return out


@pytest.mark.parametrize("src, forbidden", [
    ("reference", ("optimized", "parity", "converters")),
    ("optimized", ("reference", "parity", "converters")),
    ("manifests", ("reference", "optimized", "parity", "converters")),
    ("converters", ("reference", "optimized", "parity")),
])
def test_import_boundary(src, forbidden):
    assert (ROOT / src).is_dir()
    assert violations(src, forbidden) == []


def test_checker_catches_a_violation(tmp_path):
    """Negative control: the AST scan must see an import of the other side."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom optimized.models.cosmos3 import x\n")
    assert "optimized.models.cosmos3" in imported_modules(bad)
