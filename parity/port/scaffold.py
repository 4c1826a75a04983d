"""`fvparity port new FAMILY --from diffusers:CLASS`: write a family skeleton that runs at once.

Every file lands in the family's own folders (nothing else in the tree changes; every registry discovers them):

    manifests/F/        config dataclass + variants (tiny, upstream-default), key shapes, layout, diffusers
                        CheckpointManifest (identity rules from the upstream state-dict names), parity contract
    reference/F/        the readable model (weights under canonical names; forward to write)
    optimized/models/F/ the fast model, its ComponentSpec and FAMILY = FamilyEntry (component-only)
    parity/families/F/  FAMILY = ParityFamily (C0, one planted fault, golden probe, post-check), inputs
    golden/F/           make_cases.py (runs `fvparity align F --save`)
    tests/test_F.py     listed, C0, fault, golden

Until the two forwards are written, C0 fails with "not implemented: reference.forward".
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity.port import upstream as U

TEMPLATES = Path(__file__).parent / "templates"
ROOT = Path(__file__).resolve().parents[2]
FAMILY_DIRS = ("manifests/{f}", "reference/{f}", "optimized/models/{f}", "parity/families/{f}", "golden/{f}")
FAMILY_FILES = ("tests/test_{f}.py",)
# template -> destination (relative to the repository root)
FILES = {
    "manifests_init.py": "manifests/{f}/__init__.py", "manifests_config.py": "manifests/{f}/config.py",
    "manifests_keys.py": "manifests/{f}/keys.py", "manifests_layout.py": "manifests/{f}/layout.py",
    "reference_init.py": "reference/{f}/__init__.py", "reference_model.py": "reference/{f}/model.py",
    "optimized_init.py": "optimized/models/{f}/__init__.py", "optimized_model.py": "optimized/models/{f}/model.py",
    "parity_init.py": "parity/families/{f}/__init__.py", "parity_inputs.py": "parity/families/{f}/inputs.py",
    "golden_make_cases.py": "golden/{f}/make_cases.py", "test_family.py": "tests/test_{f}.py",
}


@dataclass(frozen=True)
class Scaffold:
    family: str
    files: dict[str, str]            # repository-relative path -> text
    notes: tuple[str, ...]           # what the porter should know (printed)


def family_paths(family: str) -> tuple[list[str], list[str]]:
    return [d.format(f=family) for d in FAMILY_DIRS], [p.format(f=family) for p in FAMILY_FILES]


def camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in name.split("_"))


def _annotation(default: Any, tiny: Any) -> str:
    v = tiny if tiny is not None else default
    base = {bool: "bool", int: "int", float: "float", str: "str"}.get(type(v))
    if isinstance(v, list):
        inner = {type(x) for x in v}
        base = f"tuple[{next(iter(inner)).__name__}, ...]" if len(inner) == 1 else "tuple"
    base = base or "Any"
    return f"{base} | None" if default is None or tiny is None else base


def _literal(v: Any) -> str:
    return repr(tuple(v)) if isinstance(v, list) else repr(v)


def config_fields(defaults: dict, tiny: dict) -> str:
    return "\n".join(f"    {k}: {_annotation(v, tiny.get(k))} = {_literal(v)}" for k, v in defaults.items())


def key_body(table: U.KeyTable) -> str:
    """key_shapes() as code: the most common product of config fields named once, a loop per layer group."""
    exprs = [d for _, keys in table.segments for _, dims in keys for d in dims]
    products = [re.sub(r"^\d+ \* | [+-] \d+$", "", d) for d in exprs if d.count("c.") >= 2]
    common = max(set(products), key=products.count) if products else None
    lines = []
    if common and products.count(common) >= 2:
        lines.append(f"    inner = {common}")
    def dim(d: str) -> str:
        return d.replace(common, "inner") if common and len(lines) else d
    lines.append("    shapes: dict[str, tuple[int, ...]] = {}")
    for group, keys in table.segments:
        body = [f'"{k}": ({", ".join(dim(d) for d in dims)}{"," if len(dims) == 1 else ""}),' for k, dims in keys]
        if group is None:
            lines.append("    shapes.update({")
            lines += [f"        {b}" for b in body]
            lines.append("    })")
        else:
            lines.append(f"    for i in range(c.{group.field}):")
            lines.append("        shapes.update({")
            lines += [f"            f{b}" for b in body]
            lines.append("        })")
    return "\n".join(lines)


def inputs_body(guesses: list[U.InputGuess]) -> str:
    lines, todo = ["    return {"], []
    for g in guesses:
        if g.code is None:
            todo.append(g.name)
        else:
            lines.append(f'        "{g.name}": {g.code},')
    lines.append("    }")
    if todo:  # a required argument the name does not explain: the porter writes it
        return (f'    raise NotImplementedError("not implemented: inputs {", ".join(todo)} '
                f'(parity/families/<family>/inputs.py)")\n' + "\n".join(lines))
    return "\n".join(lines)


def diffusers_manifest(family: str, up: U.Upstream, table: U.KeyTable, tiny: dict) -> dict:
    """Identity rules, one per top-level module of the state dict: a stray key is refused by name."""
    heads: dict[str, None] = {}
    for group, keys in table.segments:
        for pattern, _ in keys:
            heads.setdefault(group.prefix if group else pattern.split(".")[0])
    # `(\..+)?`: a top-level parameter (LTX-2's `scale_shift_table`) is a key of its own, with no dot
    rules = [{"op": "rename", "name": h, "match": f"^{re.escape(h)}(\\..+)?$", "to": "\\g<0>"} for h in heads]
    return {
        "schema": "fvconvert.checkpoint_manifest/2", "family": family, "format": "diffusers",
        "component": "transformer",
        "description": f"{up.package} {up.name} (config.json + diffusion_pytorch_model*.safetensors) -> canonical "
                       f"{family} layout: the canonical names ARE the upstream names (identity rules). Generated by "
                       f"fvparity port new.",
        "conversion_version": 1,
        "upstream": {"source": f"{up.package} {up.version} {up.name} save_pretrained", "package": up.package,
                     "version": up.version, "class_name": up.name},
        "files": {"config": "config.json", "weights": [
            {"kind": "safetensors", "path": "diffusion_pytorch_model.safetensors"},
            {"kind": "safetensors_index", "path": "diffusion_pytorch_model.safetensors.index.json"}]},
        "config_mapping": f"{family}_diffusers_config",
        "rules": rules,
        "dtype_policy": {"default": "source", "allowed_source_dtypes": ["float32", "bfloat16", "float16"]},
        "parity": {"level": "C0", "required": True},
    }


PARITY_CONTRACT = {
    "note": "design defaults (fp32 CPU component 1e-5, bf16 1e-2); tighten where measured",
    "tolerances": [{"level": "C0", "dtype": "float32", "device": "*", "rel_l2": 1e-05},
                   {"level": "C0", "dtype": "bfloat16", "device": "*", "rel_l2": 0.01}]}


def build(family: str, spec: str, tiny_overrides: dict[str, Any]) -> Scaffold:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", family):
        raise U.PortError(f"family name {family!r}: lower-case letters, digits and _ (a Python package name)")
    up = U.resolve(spec)
    if up.package != "diffusers":
        raise U.PortError(f"--from {spec}: the scaffold writes a diffusers CheckpointManifest; transformers "
                          f"classes are introspected by parity.port.upstream but not yet scaffolded")
    defaults = U.default_config(up)
    tiny = U.tiny_config(up, defaults, tiny_overrides)
    table = U.key_table(up, tiny, defaults)
    guesses = U.guess_inputs(up, tiny)
    switches = U.key_switches(up, tiny)
    group = next((g for g, _ in table.segments if g is not None), None)
    first = next(k for g, keys in table.segments for k, _ in keys)
    if group is not None:  # the planted fault: the first weight of the second layer (or the only one)
        layer_keys = next(keys for g, keys in table.segments if g is group)
        idx = 1 if tiny[group.field] > 1 else 0
        fault_key = layer_keys[0][0].format(i=idx)
        fault_layer = f"{group.prefix}.{idx}"
    else:
        fault_key, fault_layer = first, first.rsplit(".", 1)[0]
    forward_args = "".join(f"{g.name}=None, " if not g.required else f"{g.name}, " for g in guesses)
    subs = {
        "family": family, "Camel": camel(family), "spec": up.spec, "package": up.package, "cls": up.name,
        "version": up.version, "config_fields": config_fields(defaults, tiny), "key_body": key_body(table),
        "fp32_modules": _literal(list(table.fp32_modules)) if table.fp32_modules else "()",
        "gains": repr(tuple(table.gains)),
        "default_check": (" (every key matches)" if not table.default_mismatches else
                          f"; {len(table.default_mismatches)} keys DO NOT match there, write them by hand: "
                          f"{', '.join(table.default_mismatches[:4])}"),
        "inputs_body": inputs_body(guesses).replace("<family>", family),
        "forward_args": forward_args, "fault_key": fault_key, "fault_layer": fault_layer,
        "modality": "video" if "3d" in up.name.lower() or "video" in up.name.lower() else "image",
        "layer_import": "" if group else "NO_LAYERS, ",
        "layer_key": f're.compile(r"^{re.escape(group.prefix)}\\.(\\d+)\\.")' if group else "NO_LAYERS",
        "num_layers_field": group.field if group else "num_layers",
        "switches": "{" + ", ".join(f"{w.field!r}: {w.fitted}" for w in switches) + "}",
    }
    files = {}
    for tmpl, dest in FILES.items():
        text = (TEMPLATES / f"{tmpl}.tmpl").read_text()
        for k, v in subs.items():
            text = text.replace("{{" + k + "}}", v)
        if "{{" in text.replace("{{family}}", ""):
            raise AssertionError(f"template {tmpl}: unfilled placeholder")  # a scaffold bug (exit 3)
        files[dest.format(f=family)] = text
    if group is None:
        files[f"manifests/{family}/layout.py"] = files[f"manifests/{family}/layout.py"].replace(
            "import re\n\n", "")
    files[f"manifests/{family}/variants/tiny.json"] = json.dumps(tiny, indent=2) + "\n"
    files[f"manifests/{family}/variants/upstream-default.json"] = json.dumps(defaults, indent=2) + "\n"
    files[f"manifests/{family}/checkpoints/diffusers.json"] = json.dumps(
        diffusers_manifest(family, up, table, tiny), indent=2) + "\n"
    files[f"manifests/{family}/parity.json"] = json.dumps({"family": family, **PARITY_CONTRACT}, indent=2) + "\n"
    notes = [f"{len(files)} files; {sum(len(k) for _, k in table.segments)} key patterns"
             f"{f', layers: {group.prefix}.<i> x {group.field}' if group else ''}; "
             f"{table.literal_dims} literal dims"]
    if table.default_mismatches:
        notes.append(f"key_shapes is wrong for the upstream default config on {len(table.default_mismatches)} keys "
                     f"(manifests/{family}/keys.py)")
    if switches:
        notes.append(f"boolean switches that change the keys: {', '.join(w.describe() for w in switches)}; "
                     f"key_shapes refuses them until their keys are written (manifests/{family}/keys.py)")
    if any(g.code is None for g in guesses):
        notes.append(f"write the inputs: parity/families/{family}/inputs.py")
    notes.append(f"next: write reference/{family}/model.py forward and optimized/models/{family}/model.py __call__, "
                 f"then fvparity run {family} --level C0")
    return Scaffold(family, files, tuple(notes))


def write(scaffold: Scaffold, root: Path = ROOT) -> list[Path]:
    """All or nothing: refuses when any family folder exists; writes into a temp tree, then moves it in."""
    dirs, singles = family_paths(scaffold.family)
    taken = [p for p in dirs + singles if (root / p).exists()]
    if taken:
        raise U.PortError(f"family {scaffold.family!r} exists already ({', '.join(taken)})")
    with tempfile.TemporaryDirectory(dir=root, prefix=".port-") as tmp:
        for rel, text in scaffold.files.items():
            p = Path(tmp) / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        for rel in dirs + singles:
            src = Path(tmp) / rel
            if src.exists():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(src), str(root / rel))
    return [root / rel for rel in scaffold.files]
