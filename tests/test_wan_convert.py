"""wan VAE converter (fvconvert wan --from diffusers | original): tiny 2.1 / 2.2 checkpoints in both upstream
layouts, built from seeded canonical random tensors by the documented mappings written out by hand below
(independent of the manifests' regexes), convert key for key and bit for bit, pass C0 on the converted weights,
and bad inputs are refused by name with nothing written. Also the manifest rule ops `let` / `where` (index
arithmetic, converters/exprs.py) that the original 2.1 decoder layout needs.

The released key sets (wan2.1, wan2.2) are checked against upstream classes in tests/test_wan_keysets.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import ConversionError, convert, inspect_source, load_canonical, load_manifest
from converters.cli import main
from converters.engine import plan_conversion
from converters.families import get_family
from converters.hooks import get_post_check
from converters.manifest import CheckpointManifest, Rule
from converters.readers import TensorInfo
from manifests.wan import WanVAEConfig, canonical_key_shapes, load_variant
from parity.errors import SetupError
from parity.families.wan import check_converted
from parity.families.wan.vae import run_c0
from parity.weights import random_state_dict
from tests.conftest import ROOT

FAMILY = get_family("wan")
TINY = ("tiny-2.1", "tiny-2.2")

# ------------------------------------------------------------------------------------------------
# the documented inverse mapping: canonical (= diffusers AutoencoderKLWan) key -> original Wan release key
# (Wan2.1 wan/modules/vae.py, Wan2.2 wan/modules/vae2_2.py; diffusers scripts/convert_wan_to_diffusers.py)

_RESNET = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
           "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
           "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}


def original_key(key: str, cfg: WanVAEConfig) -> str:
    n = cfg.num_res_blocks
    p = key.split(".")
    if p[0] == "quant_conv":
        return f"conv1.{p[1]}"
    if p[0] == "post_quant_conv":
        return f"conv2.{p[1]}"
    side, rest = p[0], p[1:]
    if rest[0] == "conv_in":
        return f"{side}.conv1.{rest[1]}"
    if rest == ["norm_out", "gamma"]:
        return f"{side}.head.0.gamma"
    if rest[0] == "conv_out":
        return f"{side}.head.2.{rest[1]}"
    if rest[:2] == ["mid_block", "attentions"]:
        return f"{side}.middle.1." + ".".join(rest[3:])
    if rest[:2] == ["mid_block", "resnets"]:
        return f"{side}.middle.{2 * int(rest[2])}." + _RESNET[".".join(rest[3:])]
    i = int(rest[1])
    tail = ".".join(rest[2:])
    if side == "encoder":
        if not cfg.is_residual:       # 2.1: one flat list in both layouts
            return f"encoder.downsamples.{i}." + _RESNET.get(tail, tail)
        if rest[2] == "resnets":      # 2.2: Down_ResidualBlock.downsamples = n res blocks + the resample
            return f"encoder.downsamples.{i}.downsamples.{rest[3]}." + _RESNET[".".join(rest[4:])]
        return f"encoder.downsamples.{i}.downsamples.{n}." + ".".join(rest[3:])          # downsampler.*
    if not cfg.is_residual:           # 2.1: flat decoder.upsamples, n + 1 res blocks + a resample per stage
        if rest[2] == "resnets":
            return f"decoder.upsamples.{i * (n + 2) + int(rest[3])}." + _RESNET[".".join(rest[4:])]
        return f"decoder.upsamples.{i * (n + 2) + n + 1}." + ".".join(rest[4:])          # upsamplers.0.*
    if rest[2] == "resnets":          # 2.2: Up_ResidualBlock.upsamples = n + 1 res blocks + the resample
        return f"decoder.upsamples.{i}.upsamples.{rest[3]}." + _RESNET[".".join(rest[4:])]
    return f"decoder.upsamples.{i}.upsamples.{n + 1}." + ".".join(rest[3:])              # upsampler.*


def original_file(cfg: WanVAEConfig) -> str:
    return "Wan2.2_VAE.pth" if cfg.is_residual else "Wan2.1_VAE.pth"


def diffusers_config(cfg: WanVAEConfig) -> dict:
    return {"_class_name": "AutoencoderKLWan", "_diffusers_version": "0.42.1", **cfg.to_diffusers_config()}


def canonical_state(variant: str, seed: int = 0) -> dict[str, torch.Tensor]:
    return random_state_dict(canonical_key_shapes(load_variant(variant)), seed)


def make_diffusers(src: Path, variant: str, mutate=None) -> dict[str, torch.Tensor]:
    """A diffusers `vae/` folder: the canonical names unchanged (identity) + config.json."""
    sd = canonical_state(variant)
    src.mkdir(parents=True)
    out = dict(sd)
    if mutate:
        mutate(out)
    save_file(out, str(src / "diffusion_pytorch_model.safetensors"))
    (src / "config.json").write_text(json.dumps(diffusers_config(load_variant(variant)), indent=2))
    return sd


def make_original(src: Path, variant: str, mutate=None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A bare original-layout .pth (no config), by the inverse mapping above."""
    cfg = load_variant(variant)
    sd = canonical_state(variant)
    orig = {original_key(k, cfg): v for k, v in sd.items()}
    assert len(orig) == len(sd)
    if mutate:
        mutate(orig)
    src.mkdir(parents=True)
    path = src / original_file(cfg)
    torch.save(orig, path)
    return path, sd


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def assert_bit_identical(out: Path, want: dict[str, torch.Tensor], variant: str) -> None:
    cfg, sd = load_canonical(out)
    assert cfg == load_variant(variant)
    assert list(sd) == list(canonical_key_shapes(cfg))
    for k, v in want.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    assert json.loads((out / "manifest.json").read_text())["family"] == "wan"


# ------------------------------------------------------------------------------------------------
# manifests + documented facts


def test_manifests_load_and_are_filed():
    assert FAMILY.formats() == ["diffusers", "original"]
    d, o = load_manifest("wan", "diffusers"), load_manifest("wan", "original")
    assert d.upstream_class_name == "AutoencoderKLWan" and d.config_file == "config.json"
    assert o.config_file is None and {w.path for w in o.weight_files} == {"Wan2.1_VAE.pth", "Wan2.2_VAE.pth"}
    assert d.parity.required and o.parity.required and d.post_check_name == o.post_check_name == "wan"
    assert all(not r.computes for r in d.rules)
    assert {n for r in o.rules for n in r.expr_names()} == {"num_res_blocks", "is_residual"}
    assert CheckpointManifest.from_dict(o.to_dict(), origin="again") == o          # let/where round-trip


# original key -> canonical key, stated in diffusers' scripts/convert_wan_to_diffusers.py for the releases
RELEASE_PAIRS = {
    "wan2.1": {
        "conv1.weight": "quant_conv.weight", "conv2.bias": "post_quant_conv.bias",
        "encoder.conv1.weight": "encoder.conv_in.weight", "decoder.head.0.gamma": "decoder.norm_out.gamma",
        "encoder.head.2.bias": "encoder.conv_out.bias",
        "encoder.middle.2.residual.3.gamma": "encoder.mid_block.resnets.1.norm2.gamma",
        "decoder.middle.1.to_qkv.weight": "decoder.mid_block.attentions.0.to_qkv.weight",
        "encoder.downsamples.2.resample.1.weight": "encoder.down_blocks.2.resample.1.weight",
        "encoder.downsamples.3.shortcut.weight": "encoder.down_blocks.3.conv_shortcut.weight",
        "decoder.upsamples.0.residual.0.gamma": "decoder.up_blocks.0.resnets.0.norm1.gamma",
        "decoder.upsamples.3.time_conv.weight": "decoder.up_blocks.0.upsamplers.0.time_conv.weight",
        "decoder.upsamples.4.shortcut.bias": "decoder.up_blocks.1.resnets.0.conv_shortcut.bias",
        "decoder.upsamples.6.residual.2.weight": "decoder.up_blocks.1.resnets.2.conv1.weight",
        "decoder.upsamples.7.resample.1.bias": "decoder.up_blocks.1.upsamplers.0.resample.1.bias",
        "decoder.upsamples.11.resample.1.weight": "decoder.up_blocks.2.upsamplers.0.resample.1.weight",
        "decoder.upsamples.14.residual.6.bias": "decoder.up_blocks.3.resnets.2.conv2.bias",
    },
    "wan2.2": {
        "conv1.bias": "quant_conv.bias", "decoder.conv1.weight": "decoder.conv_in.weight",
        "encoder.downsamples.0.downsamples.1.residual.6.weight": "encoder.down_blocks.0.resnets.1.conv2.weight",
        "encoder.downsamples.1.downsamples.0.shortcut.weight": "encoder.down_blocks.1.resnets.0.conv_shortcut.weight",
        "encoder.downsamples.1.downsamples.2.time_conv.weight": "encoder.down_blocks.1.downsampler.time_conv.weight",
        "encoder.downsamples.0.downsamples.2.resample.1.bias": "encoder.down_blocks.0.downsampler.resample.1.bias",
        "decoder.upsamples.0.upsamples.2.residual.0.gamma": "decoder.up_blocks.0.resnets.2.norm1.gamma",
        "decoder.upsamples.0.upsamples.3.resample.1.weight": "decoder.up_blocks.0.upsampler.resample.1.weight",
        "decoder.upsamples.1.upsamples.3.time_conv.bias": "decoder.up_blocks.1.upsampler.time_conv.bias",
        "decoder.upsamples.3.upsamples.2.residual.3.gamma": "decoder.up_blocks.3.resnets.2.norm2.gamma",
    },
}


@pytest.mark.parametrize("variant", sorted(RELEASE_PAIRS))
def test_documented_release_pairs(variant):
    cfg = load_variant(variant)
    m, fields = load_manifest("wan", "original"), cfg.to_dict()
    shapes = canonical_key_shapes(cfg)
    for src, want in RELEASE_PAIRS[variant].items():
        assert m.match(src, fields)[1] == want, src
        assert want in shapes and original_key(want, cfg) == src
    # the other version's layout is refused by its rules' guards, not mis-mapped
    other = load_variant("wan2.2" if variant == "wan2.1" else "wan2.1").to_dict()
    for src in RELEASE_PAIRS[variant]:
        if ".downsamples." in src or ".upsamples." in src:
            assert m.match(src, other)[0] is None, src


@pytest.mark.parametrize("variant", ["tiny-2.1", "tiny-2.2", "wan2.1", "wan2.2"])
def test_inverse_mapping_plans_exactly(variant):
    """Headers only: every canonical key from exactly one original key (and identity for diffusers)."""
    cfg = load_variant(variant)
    shapes = canonical_key_shapes(cfg)
    for fmt, keyf in (("original", lambda k: original_key(k, cfg)), ("diffusers", lambda k: k)):
        infos = {keyf(k): TensorInfo(keyf(k), Path("x"), "float32", s) for k, s in shapes.items()}
        plan = plan_conversion(FAMILY, load_manifest("wan", fmt), cfg, infos)
        assert {e.target: e.shape for e in plan.entries} == shapes
        assert sorted(e.source_key for e in plan.entries) == sorted(infos)
        assert not plan.dropped and not plan.sidecars and plan.parts["complete"]


# ------------------------------------------------------------------------------------------------
# round trips: bit-identical, C0 on the converted weights


@pytest.mark.parametrize("variant", TINY)
def test_diffusers_layout_converts_and_passes_c0(tmp_path, variant):
    want = make_diffusers(tmp_path / "vae", variant)
    out = tmp_path / "out"
    report = convert("wan", "diffusers", tmp_path / "vae", out, post_check=check_converted)
    assert report.ok and not report.unexpected and not report.missing and not report.dropped
    assert report.num_source_keys == report.num_output_keys == len(want)
    assert report.parity["status"] == "pass" and report.parity["checks"] > 10 and not report.parity["failed"]
    assert report.config_source["kind"] == "file"
    assert_bit_identical(out, want, variant)
    # byte-identical weights file from the other layout too (no source-format stamp)
    pth, _ = make_original(tmp_path / "orig", variant)
    convert("wan", "original", pth, tmp_path / "out2", variant=variant, skip_parity=True)
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "out2" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("variant", TINY)
def test_original_layout_converts_bit_identical(tmp_path, variant):
    pth, want = make_original(tmp_path / "src", variant)
    out = tmp_path / "out"
    report = convert("wan", "original", pth, out, variant=variant, post_check=check_converted)
    assert report.ok and not report.dropped and report.num_source_keys == len(want)
    assert report.variant == {"name": variant, "status": "config taken from the variant"}
    assert report.parity["status"] == "pass"
    assert_bit_identical(out, want, variant)
    renamed = {r["from"]: r["to"] for r in report.renamed}
    cfg = load_variant(variant)
    assert all(renamed[original_key(k, cfg)] == k for k in want)
    # --config: a diffusers config.json (or our canonical one) instead of --variant; a directory SRC
    (tmp_path / "cfg.json").write_text(json.dumps(diffusers_config(cfg)))
    convert("wan", "original", pth.parent, tmp_path / "out-cfg", config=tmp_path / "cfg.json", skip_parity=True)
    convert("wan", "original", pth, tmp_path / "out-canon", config=out / "config.json", skip_parity=True)
    for d in ("out-cfg", "out-canon"):
        assert_bit_identical(tmp_path / d, want, variant)


def test_converted_checkpoint_passes_fvparity_c0(fvparity, tmp_path):
    pth, _ = make_original(tmp_path / "src", "tiny-2.2")
    out = tmp_path / "ckpt"
    convert("wan", "original", pth, out, variant="tiny-2.2", skip_parity=True)
    proc = fvparity("run", "wan", "--level", "C0", "--checkpoint", str(out), "--dtype", "fp32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checkpoint/fp32/decode/chunk1" in proc.stdout and "FAIL" not in proc.stdout
    with pytest.raises(SetupError, match="variant 'tiny-2.1'"):      # --variant must match the checkpoint
        run_c0(["tiny-2.1"], str(out), "cpu", ["fp32"], 0, None, progress=lambda m: None)
    (out / "manifest.json").write_text(json.dumps({"family": "cosmos3"}))
    with pytest.raises(SetupError, match="cosmos3 checkpoint"):
        run_c0([], str(out), "cpu", ["fp32"], 0, None, progress=lambda m: None)


@pytest.mark.upstream
@pytest.mark.parametrize("variant", TINY)
def test_upstream_save_pretrained_converts(tmp_path, variant):
    """A real diffusers AutoencoderKLWan, its weights set to the canonical tensors, saved by save_pretrained."""
    from diffusers import AutoencoderKLWan

    cfg = load_variant(variant)
    want = canonical_state(variant, seed=3)
    model = AutoencoderKLWan(**cfg.to_diffusers_config())
    model.load_state_dict(want, strict=True)
    model.save_pretrained(tmp_path / "vae")
    report = convert("wan", "diffusers", tmp_path / "vae", tmp_path / "out", post_check=check_converted)
    assert report.ok and not report.dropped and report.num_source_keys == len(want)
    assert report.parity["status"] == "pass"
    assert_bit_identical(tmp_path / "out", want, variant)


def test_cli_convert_with_post_check(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("converters.hooks._REGISTRY", {"wan": check_converted})
    pth, want = make_original(tmp_path / "src", "tiny-2.1")
    out = tmp_path / "out"
    rc = main(["wan", "--from", "original", str(pth), str(out), "--variant", "tiny-2.1", "-q"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "variant: tiny-2.1" in cap.out
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["parity"]["status"] == "pass" and report["parity"]["level"] == "C0"
    assert_bit_identical(out, want, "tiny-2.1")


def test_post_check_found_in_the_wan_parity_entry():
    """fvconvert finds `wan`'s post-check at run time in parity.families.wan.FAMILY (no entry point, no reinstall)."""
    assert get_post_check("wan") is check_converted


def test_inspect_names_format_and_variant(tmp_path):
    pth, _ = make_original(tmp_path / "src", "tiny-2.2")
    info = inspect_source(pth)
    assert info["best"] == "wan/original"
    best = next(g for g in info["guesses"] if g["format"] == "wan/original")
    assert best["strict"] == "ok" and best["variant"] == "tiny-2.2"
    make_diffusers(tmp_path / "vae", "tiny-2.1")
    assert inspect_source(tmp_path / "vae")["best"] == "wan/diffusers"


# ------------------------------------------------------------------------------------------------
# bad inputs: exit 2, the key named, nothing in OUT


def _pop(key):
    return lambda sd: sd.pop(key)


def _add(key, value):
    return lambda sd: sd.__setitem__(key, value)


def _shrink(key):
    return lambda sd: sd.__setitem__(key, sd[key][:-1].clone())


BAD = {  # name: (format, variant, mutate, key the message must name)
    "diffusers-missing": ("diffusers", "tiny-2.1", _pop("decoder.up_blocks.1.upsamplers.0.time_conv.bias"),
                          "decoder.up_blocks.1.upsamplers.0.time_conv.bias"),
    "diffusers-extra": ("diffusers", "tiny-2.2", _add("decoder.up_blocks.0.upsampler.extra.weight", torch.ones(2)),
                        "decoder.up_blocks.0.upsampler.extra.weight"),
    "diffusers-shape": ("diffusers", "tiny-2.2", _shrink("encoder.down_blocks.1.resnets.0.conv1.weight"),
                        "encoder.down_blocks.1.resnets.0.conv1.weight"),
    "original-missing": ("original", "tiny-2.1", _pop("decoder.upsamples.5.time_conv.weight"),   # 1 res block:
                         "decoder.up_blocks.1.upsamplers.0.time_conv.weight"),                   # stride 3
    "original-extra": ("original", "tiny-2.2", _add("encoder.downsamples.0.avg_shortcut.weight", torch.ones(2)),
                       "encoder.downsamples.0.avg_shortcut.weight"),
    "original-extra-index": ("original", "tiny-2.1", _add("decoder.upsamples.1.time_conv.weight", torch.ones(2)),
                             "decoder.upsamples.1.time_conv.weight"),   # a resample where a res block belongs
    "original-shape": ("original", "tiny-2.1", _shrink("decoder.upsamples.3.shortcut.weight"),
                       "decoder.upsamples.3.shortcut.weight"),
}


def _bad_source(tmp_path: Path, name: str) -> tuple[str, Path, str, str]:
    fmt, variant, mutate, key = BAD[name]
    if fmt == "diffusers":
        make_diffusers(tmp_path / "src", variant, mutate)
        return fmt, tmp_path / "src", variant, key
    pth, _ = make_original(tmp_path / "src", variant, mutate)
    return fmt, pth, variant, key


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_refused(tmp_path, capsys, name):
    fmt, src, variant, key = _bad_source(tmp_path, name)
    out = tmp_path / "out"
    with pytest.raises(ConversionError) as ei:
        convert("wan", fmt, src, out, variant=variant, post_check=check_converted)
    assert key in str(ei.value) and "\n" not in str(ei.value)
    assert_nothing_left(out)
    rc = main(["wan", "--from", fmt, str(src), str(out), "--variant", variant, "--skip-parity", "-q"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("fvconvert: error:")]
    assert rc == 2 and len(lines) == 1 and key in lines[0] and "Traceback" not in err, err
    assert_nothing_left(out)


@pytest.mark.parametrize("argv, needle", [
    (["--from", "original", "PTH", "OUT"], "--variant"),                         # no config in the file
    (["--from", "original", "PTH", "OUT", "--variant", "tiny-2.2"], "unexpected key"),      # 2.1 file, 2.2 arch
    (["--from", "original", "PTH", "OUT", "--variant", "wan2.1"], "decoder.upsamples.2.resample.1"),  # 2 res blocks
    (["--from", "diffusers", "PTH", "OUT"], "config.json"),                      # a .pth has no diffusers config
])
def test_wrong_architecture_refused(tmp_path, capsys, argv, needle):
    pth, _ = make_original(tmp_path / "src", "tiny-2.1")
    out = tmp_path / "out"
    argv = [str(pth) if a == "PTH" else str(out) if a == "OUT" else a for a in argv]
    rc = main(["wan", *argv, "--skip-parity", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("fvconvert: error:") and err.strip().count("\n") == 0, err
    assert needle in err, err
    assert_nothing_left(out)


def test_wrong_config_class_refused(tmp_path):
    make_diffusers(tmp_path / "vae", "tiny-2.1")
    cfg = json.loads((tmp_path / "vae" / "config.json").read_text())
    (tmp_path / "vae" / "config.json").write_text(json.dumps({**cfg, "_class_name": "AutoencoderKLCosmos"}))
    with pytest.raises(ConversionError, match="AutoencoderKLCosmos"):
        convert("wan", "diffusers", tmp_path / "vae", tmp_path / "out", skip_parity=True)
    assert_nothing_left(tmp_path / "out")


def test_dtype_cast_keeps_values(tmp_path):
    """--dtype casts (every wan key may be cast), the source dtype is otherwise kept."""
    make_diffusers(tmp_path / "vae", "tiny-2.2")
    convert("wan", "diffusers", tmp_path / "vae", tmp_path / "out", dtype="bf16", skip_parity=True)
    src = load_file(str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"))
    _, sd = load_canonical(tmp_path / "out")
    assert all(sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], src[k].to(torch.bfloat16)) for k in src)


# ------------------------------------------------------------------------------------------------
# the rule ops `let` / `where` (converters/exprs.py)


def _rule(**kw) -> Rule:
    return Rule(op="rename", **kw)


def test_let_and_where_compute_indices():
    r = _rule(match=r"^up\.(\d+)\.w$", to="blocks.{s}.res.{j}.w",
              let={"s": "g1 // (n + 2)", "j": "g1 % (n + 2)"}, where="g1 % (n + 2) <= n")
    assert r.expand("up.9.w", {"n": 2}) == ("blocks.2.res.1.w",)
    assert r.expand("up.7.w", {"n": 2}) is None                       # the guard: not a res block
    assert r.expand("up.7.w", {"n": 1}) == ("blocks.2.res.1.w",)      # the stride follows the config
    assert r.expand("up.9.w") == ("blocks.{s}.res.{j}.w",)            # no config: regex only (format guessing)
    named = _rule(match=r"^a\.(?P<i>\d+)\.(w|b)$", to=r"x.{k}.\2", let={"k": "i * 2 + 1", "k2": "k - 1"})
    assert named.expand("a.3.b", {}) == ("x.7.b",)
    cond = _rule(match=r"^m\.(\d+)$", to="m.{r}", let={"r": "0 if g1 == 0 else (g1 - 1) // 2 + 1"},
                 where="not is_residual and (g1 == 0 or g1 % 2 == 1)")
    assert [cond.expand(f"m.{i}", {"is_residual": False}) for i in range(4)] == [("m.0",), ("m.1",), None, ("m.2",)]
    assert cond.expand("m.1", {"is_residual": True}) is None
    drop = Rule(op="drop", match=r"^d\.(\d+)$", reason="r", where="g1 > 1")
    assert drop.expand("d.2", {}) == () and drop.expand("d.1", {}) is None


def test_templates_without_let_keep_braces():
    """Backward compatibility: only rules with `let` substitute {name}."""
    r = _rule(match=r"^(a)$", to=r"{x}.\1")
    assert r.expand("a", {"x": 1}) == ("{x}.a",)


def test_expression_errors_name_the_rule_and_key():
    r = _rule(match=r"^u\.(\w+)$", to="v.{k}", let={"k": "g1 + 1"}, name="flat")
    with pytest.raises(ConversionError, match=r"'flat'.*'u\.x'.*not a decimal integer"):
        r.expand("u.x", {})
    z = _rule(match=r"^u\.(\d+)$", to="v.{k}", let={"k": "g1 // n"})
    with pytest.raises(ConversionError, match="division by zero"):
        z.expand("u.3", {"n": 0})
    with pytest.raises(ConversionError, match="'missing'.*neither a regex group nor a field"):
        _rule(match=r"^u\.(\d+)$", to="v.{k}", let={"k": "missing"}).expand("u.1", {"n": 1})
    with pytest.raises(ConversionError, match="not an integer"):
        _rule(match=r"^u\.(\d+)$", to="v.{k}", let={"k": "name"}).expand("u.1", {"name": "abc"})


def _manifest_with(rule: dict) -> dict:
    d = load_manifest("wan", "original").to_dict()
    d["rules"] = [rule] + d["rules"]
    return d


@pytest.mark.parametrize("rule, needle", [
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{k}", "let": {"k": "__import__('os')"}}, "not allowed"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{k}", "let": {"k": "g1.real"}}, "not allowed"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{k}", "let": {"k": "g1 / 2"}}, "not allowed"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{k}", "let": {"k": "g1 +"}}, "does not parse"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{k}", "let": {"k": "g2"}}, "has 1 groups"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{j}", "let": {"k": "g1"}}, "does not define"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{k}}", "let": {"k": "g1"}}, "brace"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{k}", "let": {"k": "j", "j": "g1"}}, "not defined before"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{k}", "let": {"g1": "1", "k": "1"}}, "identifier other"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": "b.{k}", "let": ["k", "g1"]}, "'let' must be an object"),
    ({"op": "rename", "match": r"^a\.(\d+)$", "to": r"b.\1", "where": "g1 < num_layers"}, "not wan config fields"),
    ({"op": "drop", "match": r"^a\.(\d+)$", "reason": "r", "let": {"k": "1"}}, "unknown fields"),
])
def test_bad_let_where_manifests_refused(tmp_path, rule, needle):
    p = tmp_path / "custom.json"
    p.write_text(json.dumps(_manifest_with(rule)))
    with pytest.raises(ConversionError, match="custom.json") as ei:
        load_manifest("wan", str(p))
    assert needle in str(ei.value), str(ei.value)
