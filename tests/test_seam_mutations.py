"""The mutation-catalogue rule (issue 22, PORTING.md): every seam a negative control plants gets a catalogue mutation.

A seam is a function (or class) of the model packages that a planted fault replaces through `parity.patching.patched`:
its name is the string literal of a `patched(owner, "name", ...)` / `_patched(...)` call in parity/, or a key's first
element in a module-level `*_SEAMS` table (parity/graph_faults.py). A planted fault proves a check CAN fail there;
a mutation (a realistic source edit of the seam's own body, parity/mutations/<family>.json, scored by `fvparity
mutate`) proves the checks a porter runs DO fail there. Seams planted before the rule are listed in GRANDFATHERED;
the list may only shrink."""

from __future__ import annotations

import ast
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_PACKAGES = ("optimized", "reference", "manifests", "converters")

# seams planted before issue 22 whose body no catalogue mutation edits (remove a name when its mutation lands)
GRANDFATHERED = {
    "advance", "attention_lse", "branch_rows", "broadcast_object", "build_geometry", "cfg_combine", "column_shard",
    "ensure_layout", "key", "key_mask_shard", "latent_stats", "mrope_axis_of_column", "noise_level",
    "real_key_lengths", "resolve_version", "shifted_sigmas", "split_head_groups", "step_sigmas", "text_positions",
    "timestep_embedding_rows", "tp_slice", "window_text_sum",
}


def planted_seams() -> tuple[dict[str, set[str]], list[str]]:
    """({seam name: the parity files planting it}, [`patched` calls whose seam is not a literal nor a *_SEAMS
    table's])."""
    return _planted_seams(ROOT)


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


@functools.cache
def _planted_seams(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    seams: dict[str, set[str]] = {}
    opaque = []
    for path in sorted((root / "parity").rglob("*.py")):
        rel, tree = str(path.relative_to(root)), _parsed(path)
        tables = False
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id.endswith("_SEAMS") for t in targets):
                    tables = True
                    for v in node.value.values:
                        if isinstance(v, ast.Tuple) and isinstance(v.elts[0], ast.Constant):
                            seams.setdefault(v.elts[0].value, set()).add(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("patched", "_patched") \
                    and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    seams.setdefault(name.value, set()).add(rel)
                elif not tables:
                    opaque.append(f"{rel}:{node.lineno}")
    return seams, opaque


def definitions(names: set[str]) -> dict[str, list[tuple[str, int, int]]]:
    """{name: [(file, first line, last line) of every def / class of that name in the model packages]}."""
    return {n: spans for n, spans in _definitions(ROOT).items() if n in names}


@functools.cache
def _definitions(root: Path) -> dict[str, list[tuple[str, int, int]]]:
    out: dict[str, list[tuple[str, int, int]]] = {}
    for pkg in MODEL_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(_parsed(path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.setdefault(node.name, []).append((str(path.relative_to(root)), node.lineno, node.end_lineno))
    return out


def mutated_seams(seams: set[str]) -> dict[str, list[str]]:
    """{seam: catalogue mutations whose edit's `find` text lies inside one of the seam's definitions}."""
    defs = definitions(seams)
    hits: dict[str, list[str]] = {}
    for catalogue in sorted((ROOT / "parity" / "mutations").glob("*.json")):
        for m in json.loads(catalogue.read_text())["mutations"]:
            for e in m.get("edits", [m]):
                path = ROOT / e["file"]
                text = path.read_text() if path.is_file() else ""
                if e["find"] not in text:
                    continue      # tests/test_mutate.py says which entry no longer applies
                line = text[:text.index(e["find"])].count("\n") + 1
                for seam, spans in defs.items():
                    if any(f == e["file"] and a <= line <= b for f, a, b in spans):
                        hits.setdefault(seam, []).append(f"{catalogue.stem}:{m['name']}")
    return hits


def test_every_planted_seam_has_a_catalogue_mutation():
    seams, opaque = planted_seams()
    assert not opaque, f"patched() with a seam name that is neither a literal nor a *_SEAMS table's: {opaque}"
    missing = sorted(set(seams) - set(mutated_seams(set(seams))) - GRANDFATHERED)
    assert not missing, "seams planted by a negative control with no catalogue mutation editing their body (add one " \
        "to parity/mutations/<family>.json; PORTING.md, the mutation rule): " + \
        "; ".join(f"{s} (planted in {', '.join(sorted(seams[s]))})" for s in missing)


def test_the_grandfathered_list_only_shrinks():
    seams, _ = planted_seams()
    hits = mutated_seams(set(seams))
    assert not GRANDFATHERED - set(seams), f"no longer planted, drop: {sorted(GRANDFATHERED - set(seams))}"
    assert not GRANDFATHERED & set(hits), f"now mutated, drop from GRANDFATHERED: {sorted(GRANDFATHERED & set(hits))}"


def test_every_seam_resolves_to_a_definition():
    seams, _ = planted_seams()
    defs = definitions(set(seams))
    unresolved = sorted(s for s in seams if s not in defs)
    assert not unresolved, f"planted seams with no def / class of that name in {MODEL_PACKAGES}: {unresolved}"


def test_the_rule_sees_the_capture_seams_and_would_flag_a_new_one(tmp_path, monkeypatch):
    """The issue-22 capture seams are planted and mutated; a seam planted without a mutation is reported by name."""
    seams, _ = planted_seams()
    hits = mutated_seams(set(seams))
    for seam in ("static_buffers", "copy_in", "copy_out"):
        assert seam in seams and hits.get(seam), (seam, hits.get(seam))
    fake = tmp_path / "parity"
    (fake / "mutations").mkdir(parents=True)
    (fake / "x.py").write_text('with patched(graph, "copy_out", make):\n    pass\n'
                               'with _patched(ops, "brand_new_seam", make):\n    pass\n')
    (fake / "mutations" / "f.json").write_text(json.dumps({"family": "f", "mutations": []}))
    for pkg in MODEL_PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "optimized" / "ops.py").write_text("def brand_new_seam(x):\n    return x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    got, _ = planted_seams()
    assert set(got) == {"copy_out", "brand_new_seam"} and "brand_new_seam" in definitions(set(got))
    assert mutated_seams(set(got)) == {}
