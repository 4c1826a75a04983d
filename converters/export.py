"""`fvconvert export --to diffusers MODEL_DIR OUT`: a canonical wan model directory -> a diffusers pipeline root.

The inverse of `fvconvert wan --from diffusers ROOT OUT` (converters/pipeline.py), built from the same data:

    OUT/model_index.json            WanPipeline / WanImageToVideoPipeline (expand_timesteps, boundary_ratio from
                                    the model config)
    OUT/<component>/config.json     the typed config's upstream spelling (WanDiTConfig.to_diffusers_config, ...)
    OUT/<component>/<weights>       the component manifest's safetensors file name; keys are the manifest's rules
                                    run backwards (each inverted key is re-checked by running the rule forwards),
                                    tied copies a `drop ... equals` rule removed are written back (upstream has them)
    OUT/tokenizer/, scheduler/, [image_processor/]   copied verbatim from the model directory's assets

Strict: a directory that is not a complete wan model directory, a rule that cannot be run backwards, or a key no
rule gives back is one ConversionError (exit 2); OUT is written in a temporary directory beside it and put in place
only when complete (converters/staging.py), so a failed run leaves nothing. Tensors are written bit for bit
(no cast): exporting and converting back gives the same tensors.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from converters.errors import ConversionError
from converters.manifest import CheckpointManifest, Rule, load_manifest
from converters.staging import check_output, staged_output
from converters.writer import json_bytes, write_bytes
from manifests.checkpoint import CheckpointError, load_state, read_checkpoint

EXPORT_TARGETS = ("diffusers",)
_GROUP = re.compile(r"\\g<(\w+)>|\\(\d+)")


@dataclass
class ExportReport:
    family: str
    src: str
    out: str
    pipeline_class: str
    components: dict[str, dict] = field(default_factory=dict)   # name -> {format, weights_file, num_keys, tied}
    assets: list[str] = field(default_factory=list)


def _template_regex(template: str) -> re.Pattern | None:
    """The canonical-key template `to` of a rename rule as a regex capturing each group it names (None: the template
    repeats a group, which this inversion does not need)."""
    out, seen, pos = [], set(), 0
    for m in _GROUP.finditer(template):
        name = m.group(1) or m.group(2)
        if name in seen:
            return None
        seen.add(name)
        out.append(re.escape(template[pos:m.start()]))
        out.append(f"(?P<g{name}>.+?)")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("^" + "".join(out) + "$")


def _source_template(pattern: str) -> str | None:
    """A rule's match regex as a template of its numbered groups, when the regex is literal text plus top-level
    capture groups (`^blocks\\.(\\d+)\\.x$` -> `blocks.\\1.x`); None when it is not that simple."""
    body = pattern[1:-1] if pattern.startswith("^") and pattern.endswith("$") else pattern
    out, i, group, depth = [], 0, 0, 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            if depth == 0:
                if body[i + 1] in ".-_/":
                    out.append(body[i + 1])
                else:
                    return None                     # a class such as \d outside a group: not a literal
            i += 2
            continue
        if c == "(":
            if body.startswith("(?", i) and not body.startswith("(?P<", i):
                if depth == 0:
                    return None                     # a non-capturing alternation at top level: not invertible here
            if depth == 0:
                group += 1
                out.append(f"\\{group}")
            depth += 1
        elif c == ")":
            depth -= 1
        elif depth == 0:
            if c in ".*+?[]|{}":
                return None
            out.append(c)
        i += 1
    return "".join(out)


def source_key(manifest: CheckpointManifest, canonical: str, config: dict) -> tuple[str, Rule]:
    """The upstream key that `manifest` turns into `canonical`: the first producing rule whose template can give
    `canonical`, run backwards, then checked by running the whole manifest forwards on it."""
    for rule in manifest.rules:
        if not rule.produces or rule.op != "rename":
            continue
        to = rule.to
        if to == "\\g<0>":                           # identity rename (every wan diffusers manifest): key = key
            cand = canonical
        else:
            rx = _template_regex(to)
            m = rx.match(canonical) if rx is not None else None
            src_t = _source_template(rule.match)
            if m is None or src_t is None:
                continue
            groups = {k[1:]: v for k, v in m.groupdict().items()}
            try:
                cand = _GROUP.sub(lambda g, gs=groups: gs[g.group(1) or g.group(2)], src_t)
            except KeyError:
                continue
        got_rule, got = manifest.match(manifest.normalize_key(cand), config)
        if got_rule is rule and got == canonical:
            return cand, rule
    ops = sorted({r.op for r in manifest.rules if r.produces and r.op != "rename"})
    raise ConversionError(f"manifest {manifest.id}: no rule gives canonical key {canonical!r} back"
                          + (f" (rules of kind {', '.join(ops)} are not run backwards by export)" if ops else ""))


def _tied_copies(manifest: CheckpointManifest, src_keys: dict[str, str]) -> dict[str, str]:
    """{upstream key: upstream key it is a copy of} for each `drop ... equals` rule naming a literal key (the tied
    embed_tokens of UMT5): upstream files carry both."""
    out = {}
    for rule in manifest.rules:
        if rule.op != "drop" or not getattr(rule, "equals", None):
            continue
        literal = _source_template(rule.match)
        if literal is None or "\\" in literal:
            continue
        if rule.equals in src_keys.values():
            out[literal] = rule.equals
    return out


def _upstream_config(kind: str, typed) -> dict:
    if kind == "transformer":
        return typed.to_diffusers_config()
    if kind == "vae":
        return {"_class_name": "AutoencoderKLWan", **typed.to_diffusers_config()}
    if kind in ("text_encoder", "image_encoder"):
        return typed.to_transformers_config()
    raise ConversionError(f"export: no upstream config spelling for a {kind} component")


_UPSTREAM_CLASSES = {"transformer": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"],
                     "text_encoder": ["transformers", "UMT5EncoderModel"],
                     "image_encoder": ["transformers", "CLIPVisionModel"]}
_ASSET_CLASSES = {"tokenizer": ["transformers", "T5TokenizerFast"], "image_processor": ["transformers",
                                                                                          "CLIPImageProcessor"]}
_SCHEDULER_CLASSES = {"unipc": "UniPCMultistepScheduler", "euler": "FlowMatchEulerDiscreteScheduler"}


def _scheduler_config(cfg) -> dict:
    cls = _SCHEDULER_CLASSES.get(cfg.solver)
    if cls is None:
        raise ConversionError(f"export: the model's solver {cfg.solver!r} has no diffusers scheduler here")
    shift = "flow_shift" if cls == "UniPCMultistepScheduler" else "shift"
    d = {"_class_name": cls, "num_train_timesteps": cfg.num_train_timesteps, shift: cfg.flow_shift}
    if cls == "UniPCMultistepScheduler":
        d.update(use_flow_sigmas=True, prediction_type="flow_prediction")
    return d


def export_diffusers(model_dir: str | Path, out: str | Path, *, force: bool = False) -> ExportReport:
    """Write the diffusers pipeline root of the canonical wan model directory `model_dir` into `out`."""
    from manifests.wan.pipeline import WAN_COMPONENTS, WAN_PIPELINES

    src, out = Path(model_dir), Path(out)
    try:
        ckpt = read_checkpoint(src)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if not ckpt.is_model or ckpt.family != "wan":
        raise ConversionError(f"{src}: not a canonical wan model directory (model_index.json with family wan; got "
                              f"{'a model' if ckpt.is_model else 'a single-component'} {ckpt.family} directory); "
                              f"export --to diffusers writes whole wan pipelines")
    if ckpt.partial:
        raise ConversionError(f"{src}: a partial checkpoint cannot be exported as a pipeline")
    check_output(src, out, force)
    try:
        cfg = ckpt.typed_config()
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    task = cfg.task
    pipeline_class = "WanImageToVideoPipeline" if task == "i2v" else "WanPipeline"
    assert pipeline_class in WAN_PIPELINES

    # plan every component (keys inverted, tied copies found) before writing a byte
    planned: dict[str, tuple] = {}
    for name, comp in ckpt.components.items():
        if name not in WAN_COMPONENTS:
            raise ConversionError(f"{src}: component {name!r} is not one a wan diffusers pipeline holds")
        family, fmt = WAN_COMPONENTS[name]
        manifest = load_manifest(family, fmt)
        try:
            state = load_state(ckpt, component=name)
            typed = comp.typed_config()
        except CheckpointError as e:
            raise ConversionError(str(e)) from None
        cfg_fields = typed.to_dict()
        keys = {k: source_key(manifest, k, cfg_fields)[0] for k in state}
        if len(set(keys.values())) != len(keys):
            raise ConversionError(f"manifest {manifest.id}: two canonical keys invert to one upstream key")
        tied = _tied_copies(manifest, keys)
        weights = next((w.path for w in manifest.weight_files if w.kind == "safetensors"), None)
        if weights is None:
            raise ConversionError(f"manifest {manifest.id}: names no single safetensors weights file")
        planned[name] = (comp, manifest, state, keys, tied, weights, _upstream_config(comp.kind, typed))

    report = ExportReport(family="wan", src=str(src.resolve()), out=str(out.resolve()), pipeline_class=pipeline_class)
    index = {"_class_name": pipeline_class, "_diffusers_version": "0.42.1"}
    with staged_output(out) as tmp:
        for name, (comp, manifest, state, keys, tied, weights, up_cfg) in planned.items():
            (tmp / name).mkdir()
            write_bytes(tmp / name / "config.json", json_bytes(up_cfg))
            by_src = {keys[k]: state[k] for k in state}
            for copy, of in tied.items():
                by_src[copy] = by_src[of].clone()      # its own storage: safetensors refuses shared tensors
            _write_weights(tmp / name / weights, by_src)
            index[name] = _UPSTREAM_CLASSES[comp.kind]
            report.components[name] = {"format": manifest.format, "weights_file": f"{name}/{weights}",
                                       "num_keys": len(by_src), "tied": sorted(tied)}
        for asset, path in ckpt.assets.items():
            (tmp / asset).mkdir()
            for f in sorted(Path(path).iterdir()):
                if not f.is_file():
                    raise ConversionError(f"{f}: asset folders are copied verbatim and must hold only files")
                shutil.copyfile(f, tmp / asset / f.name)
            if asset in _ASSET_CLASSES:
                index[asset] = _ASSET_CLASSES[asset]
            report.assets.append(asset)
        if "tokenizer" not in ckpt.assets:
            raise ConversionError(f"{src}: the model directory has no tokenizer/ asset; a pipeline needs one")
        if "scheduler" not in ckpt.assets:
            (tmp / "scheduler").mkdir()
            write_bytes(tmp / "scheduler" / "scheduler_config.json", json_bytes(_scheduler_config(cfg)))
            report.assets.append("scheduler")
        sched = json.loads((tmp / "scheduler" / "scheduler_config.json").read_text())
        index["scheduler"] = ["diffusers", sched.get("_class_name", _SCHEDULER_CLASSES.get(cfg.solver))]
        index.setdefault("transformer_2", [None, None])
        index["boundary_ratio"] = cfg.boundary_ratio if cfg.dit_2 is not None else None
        index["expand_timesteps"] = bool(cfg.expand_timesteps)
        if task == "i2v":
            index.setdefault("image_encoder", [None, None])
            index.setdefault("image_processor", [None, None])
        write_bytes(tmp / "model_index.json", json_bytes(index))
        write_bytes(tmp / "export_report.json", json_bytes(report.__dict__))
    return report


def _write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file, bit for bit (contiguous copies; dtype and values untouched)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path), metadata={"format": "pt"})


__all__ = ["EXPORT_TARGETS", "ExportReport", "export_diffusers", "source_key"]
