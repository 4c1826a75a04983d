"""A new family is its folders: a temporary family `toyfam` (a transformer only, no loop) written into tmp_path and
put on each side's package path is found by the checkpoint reader, the converter, the optimized registry, the
parity registry and fvconvert's post-check lookup, with no registration anywhere. Also: a family missing its
post-check makes fvconvert exit 2 naming the fix; variants are per family (a bare name only when unique); the
random-weight gains are the family's declaration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

LAYOUT = '''
import re
from dataclasses import asdict, dataclass
from manifests.layouts import ComponentLayout, FamilyLayout


@dataclass(frozen=True)
class ToyConfig:
    dim: int = 4
    num_layers: int = 2

    @classmethod
    def from_dict(cls, d):
        return cls(**d)

    def to_dict(self):
        return asdict(self)


def key_shapes(cfg):
    out = {}
    for i in range(cfg.num_layers):
        out[f"blocks.{i}.proj.weight"] = (cfg.dim, cfg.dim)
        out[f"blocks.{i}.norm_q.weight"] = (cfg.dim,)
    return out


VARIANTS = {"tiny": ToyConfig(), "wide": ToyConfig(dim=8)}

LAYOUT = FamilyLayout("toyfam", (ComponentLayout(
    "toyfam", "transformer", ToyConfig.from_dict, key_shapes, load_variant=lambda n: VARIANTS[n],
    list_variants=lambda: sorted(VARIANTS), config_mappings={"toy_config": ToyConfig.from_dict},
    layer_key=re.compile(r"^blocks\\.(\\d+)\\."), gains=("norm_q.weight",)),))
'''

MANIFEST = {
    "schema": "fvconvert.checkpoint_manifest/2", "family": "toyfam", "format": "plain",
    "description": "toy upstream format: canonical names, no config (pass --variant)", "conversion_version": 1,
    "upstream": {"source": "a test", "revision": "0", "url": "https://example.invalid"},
    "files": {"config": None, "weights": [{"kind": "safetensors", "path": "model.safetensors"}]},
    "config_mapping": "toy_config",
    "rules": [{"op": "rename", "name": "every key", "match": "^(blocks\\..+)$", "to": "\\1"}],
    "dtype_policy": {"default": "source", "allowed_source_dtypes": ["float32"]},
    "parity": {"level": "C0", "required": True},
}

OPTIMIZED = '''
from manifests.toyfam.layout import VARIANTS, ToyConfig, key_shapes
from optimized.runtime.family import Capabilities, FamilyEntry, declared_random_state
from optimized.runtime.spec import ComponentSpec


class ToyInstance:
    def __init__(self, cfg, weights, weights_version):
        self.cfg, self.weights, self.weights_version = cfg, weights, weights_version
        self.dtype, self.device = None, "cpu"


FAMILY = FamilyEntry(
    name="toyfam", config_class=ToyConfig, load_variant=lambda n: VARIANTS[n], list_variants=lambda: sorted(VARIANTS),
    config_from_dict=ToyConfig.from_dict,
    load=lambda cfg, w, device="cpu", dtype=None, weights_version=None: ToyInstance(cfg, w, weights_version),
    random_weights=lambda cfg, seed: {"transformer": declared_random_state("toyfam", "transformer", cfg, seed)},
    components=lambda cfg: (ComponentSpec("transformer", "transformer", tuple(sorted(key_shapes(cfg).items())), ()),),
    loops={}, request_types={}, capabilities=Capabilities(modalities=()))
'''

PARITY = '''
import os
from manifests.toyfam.layout import VARIANTS
from parity.family import ParityFamily


def check_converted(out_dir):
    from manifests.checkpoint import load_state
    sd = load_state(out_dir)
    return {"status": "pass", "level": "C0", "checks": len(sd), "failed": []}


def run_c0(variants, checkpoint, device, dtypes, seed, fault, progress):
    raise NotImplementedError


FAMILY = ParityFamily(name="toyfam", description="a component-only toy", levels={"C0": run_c0},
                      variants=lambda: sorted(VARIANTS), default_variants=("tiny",),
                      check_converted=check_converted if os.environ.get("TOY_POST_CHECK") else None)
'''


def _write_family(root: Path) -> dict[str, Path]:
    """The toy family's folders under `root`, one per side (a stand-in for manifests/, optimized/models/, parity/families/)."""
    dirs = {"manifests": root / "manifests", "optimized.models": root / "models", "parity.families": root / "families"}
    pkg = dirs["manifests"] / "toyfam"
    (pkg / "checkpoints").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "layout.py").write_text(LAYOUT)
    (pkg / "checkpoints" / "plain.json").write_text(json.dumps(MANIFEST, indent=1))
    (dirs["optimized.models"] / "toyfam").mkdir(parents=True)
    (dirs["optimized.models"] / "toyfam" / "__init__.py").write_text(OPTIMIZED)
    dirs["parity.families"].mkdir()
    (dirs["parity.families"] / "toyfam.py").write_text(PARITY)
    return dirs


@pytest.fixture
def toyfam(tmp_path, monkeypatch):
    """The toy family visible in this process: each side's package path extended by its folder, caches cleared."""
    import importlib

    import manifests.layouts
    import optimized.registry
    import parity.families
    from converters import families as conv_families

    dirs = _write_family(tmp_path / "toy")
    for pkg, d in dirs.items():
        mod = importlib.import_module(pkg)
        monkeypatch.setattr(mod, "__path__", [*mod.__path__, str(d)])
    monkeypatch.setattr(parity.families, "_CACHE", None)
    monkeypatch.setattr(conv_families, "_CACHE", {})
    manifests.layouts.family_layouts.cache_clear()
    optimized.registry.families.cache_clear()
    yield dirs
    for name in [m for m in sys.modules if "toyfam" in m]:
        del sys.modules[name]
    manifests.layouts.family_layouts.cache_clear()
    optimized.registry.families.cache_clear()


def test_a_family_folder_is_discovered_by_every_side(toyfam, monkeypatch):
    from converters.families import family_names as converter_families
    from converters.families import get_family
    from converters.hooks import MissingPostCheck, get_post_check
    from manifests.checkpoint import default_component, family_names, get_layout
    from optimized import Engine, RequestRejected
    from optimized.registry import family
    from parity.families import families

    assert "toyfam" in family_names() and "toyfam" in converter_families()
    assert default_component("toyfam") == "transformer" and get_layout("toyfam").is_gain("blocks.0.norm_q.weight")
    assert get_family("toyfam").formats() == ["plain"]
    entry = family("toyfam")
    assert entry.component_only
    eng = Engine.from_variant("toyfam:tiny", seed=0)
    assert eng.model.weights_version == "random:toyfam:tiny:0"
    with pytest.raises(RequestRejected, match="'toyfam' is component-only.*cannot generate"):
        eng.generate(object())
    assert families()["toyfam"].levels.keys() == {"C0"}       # a component-only family: C0 only, and it validates
    with pytest.raises(MissingPostCheck, match="toyfam.FAMILY declares no check_converted.*--skip-parity"):
        get_post_check("toyfam")
    monkeypatch.setenv("TOY_POST_CHECK", "1")
    sys.modules.pop("parity.families.toyfam", None)
    assert get_post_check("toyfam").__module__ == "parity.families.toyfam"


def test_declared_gains_shape_both_sides_random_weights(toyfam):
    """The toy family declares norm_q.weight a gain: both generators draw it near 1; the default rule would not."""
    from manifests.checkpoint import get_layout
    from optimized.registry import family
    from optimized.runtime.family import seeded_random_state
    from parity.weights import fan_in_init, fan_in_rule, random_state_dict

    cfg = family("toyfam").load_variant("tiny")
    shapes = get_layout("toyfam").key_shapes(cfg)
    declared = family("toyfam").random_weights(cfg, 0)["transformer"]
    default = seeded_random_state(shapes, 0)
    assert (declared["blocks.0.norm_q.weight"] - 1).abs().max() < 0.2
    assert default["blocks.0.norm_q.weight"].abs().max() < 0.2
    assert torch.equal(declared["blocks.0.proj.weight"], default["blocks.0.proj.weight"])
    ours = random_state_dict(shapes, 0, fan_in_rule(get_layout("toyfam").gains))
    base = random_state_dict(shapes, 0, fan_in_init)
    assert (ours["blocks.1.norm_q.weight"] - 1).abs().max() < 0.5 and base["blocks.1.norm_q.weight"].abs().max() < 0.5
    assert torch.equal(ours["blocks.1.proj.weight"], base["blocks.1.proj.weight"])


def _fvconvert(dirs: dict[str, Path], args: list[str], post_check: bool) -> subprocess.CompletedProcess:
    """fvconvert in a fresh process whose packages include the toy family's folders (as a new checkout would)."""
    code = textwrap.dedent(f"""
        import importlib, sys
        for pkg, d in {json.dumps({k: str(v) for k, v in dirs.items()})}.items():
            importlib.import_module(pkg).__path__.append(d)
        from converters.cli import main
        sys.exit(main({args!r}))
    """)
    env = {**os.environ, "TOY_POST_CHECK": "1" if post_check else ""}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_fvconvert_a_new_family_and_its_missing_post_check(tmp_path):
    from safetensors.torch import save_file

    dirs = _write_family(tmp_path / "toy")
    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    want = {f"blocks.{i}.{k}": torch.randn(shape, generator=g) for i in range(2)
            for k, shape in (("proj.weight", (4, 4)), ("norm_q.weight", (4,)))}
    save_file(want, str(src / "model.safetensors"))
    out = tmp_path / "out"
    proc = _fvconvert(dirs, ["toyfam", "--from", "plain", str(src), str(out), "--variant", "toyfam:tiny", "-q"], False)
    assert proc.returncode == 2, proc.stderr
    assert "no parity post-check 'toyfam'" in proc.stderr and "--skip-parity" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    proc = _fvconvert(dirs, ["toyfam", "--from", "plain", str(src), str(out), "--variant", "toyfam:tiny", "-q"], True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "conversion_report.json").read_text())["parity"]["status"] == "pass"
    assert "parity:  pass" in proc.stdout


# ------------------------------------------------------------------------------------------------ namespacing

def test_a_bare_variant_two_families_share_is_an_error_naming_both(monkeypatch):
    import optimized.registry as registry
    from optimized import Engine

    fams = dict(registry.families())
    twin = replace(fams["wan"], name="wantwin")
    monkeypatch.setattr(registry, "families", lambda: {**fams, "wantwin": twin})
    with pytest.raises(registry.UnknownFamily, match="'tiny-2.1-t2v' is ambiguous.*wan:tiny-2.1-t2v, "
                                                     "wantwin:tiny-2.1-t2v"):
        registry.family_of_variant("tiny-2.1-t2v")
    assert registry.family_of_variant("wantwin:tiny-2.1-t2v").name == "wantwin"
    assert registry.family_of_variant("wan:tiny-2.1-t2v").name == "wan"
    eng = Engine.from_variant("wantwin:tiny-2.1-t2v", seed=0)
    assert eng.family.name == "wantwin" and eng.model.weights_version == "random:wantwin:tiny-2.1-t2v:0"
    with pytest.raises(registry.UnknownFamily, match="belongs to family 'wan', not 'cosmos3'"):
        registry.family_of_variant("wan:tiny-2.1-t2v", "cosmos3")
    with pytest.raises(registry.UnknownFamily, match="family 'wan' has no variant 'tiny'"):
        registry.family_of_variant("wan:tiny")


def test_qualified_variants_on_the_clis(tmp_path, capsys, fvparity):
    from converters.cli import main

    rc = main(["wan", "--from", "original", str(tmp_path / "none.pth"), str(tmp_path / "o"), "--variant",
               "cosmos3:tiny", "-q"])
    assert rc == 2 and "belongs to family 'cosmos3', not 'wan'" in capsys.readouterr().err
    proc = fvparity("run", "seedvr2", "--level", "C0", "--variant", "wan:tiny-3b")
    assert proc.returncode == 2 and "belongs to family 'wan', not 'seedvr2'" in proc.stderr
