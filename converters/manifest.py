"""CheckpointManifest: how one upstream checkpoint format maps onto a family's canonical layout, as data.

A manifest is a JSON file `manifests/<family>/checkpoints/<format>.json`:

    schema             "fvconvert.checkpoint_manifest/1"
    family, format     e.g. "cosmos3", "diffusers"
    description        free text
    conversion_version int; bump when the mapping changes what a converted checkpoint holds
    upstream           {"source": "...", "package": ..., "version": ..., "class_name": ...}
                       class_name, when given, must equal config.json's `_class_name` (if present)
    files              {"config": "config.json",
                        "weights": [{"kind": "safetensors"|"safetensors_index"|"torch", "path": "..."}, ...]}
                       the weight layouts a source directory may hold (exactly one of them must be present)
    config_mapping     id of the function mapping the upstream config onto the family config
    rules              ORDERED list; the first rule whose regex fully matches a source key decides:
                         {"op": "rename", "match": "^...$", "to": "template with \\1 / \\g<name>", "name"?, "note"?}
                         {"op": "drop",   "match": "^...$", "reason": "why this tensor is not needed"}
                       regexes are anchored (^...$) so a rule never matches a key that merely contains it;
                       a source key no rule matches is an error (unexpected key)
    dtype_policy       {"default": "source", "keep_fp32": [regex on canonical keys],
                        "allowed_source_dtypes": ["float32", ...], "note"?}

Loading validates everything (regexes compile and are anchored, templates only name existing groups,
ops and fields are known) and raises ConversionError naming the manifest file and the bad entry.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from converters.errors import ConversionError

SCHEMA = "fvconvert.checkpoint_manifest/1"
RULE_OPS = ("rename", "drop")
WEIGHT_KINDS = ("safetensors", "safetensors_index", "torch")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
_TOP_FIELDS = {"schema", "family", "format", "description", "conversion_version", "upstream", "files",
               "config_mapping", "rules", "dtype_policy"}
_RULE_FIELDS = {"rename": {"op", "match", "to", "name", "note"}, "drop": {"op", "match", "reason", "name", "note"}}
_GROUP_REF = re.compile(r"\\(\d+)|\\g<([^>]*)>")


@dataclass(frozen=True)
class Rule:
    op: str
    match: str
    to: str | None = None
    reason: str | None = None
    name: str | None = None
    note: str | None = None
    pattern: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "pattern", re.compile(self.match))
        except (re.error, TypeError) as e:
            raise ValueError(f"regex {self.match!r} does not compile ({e})") from None

    @property
    def label(self) -> str:
        return self.name or self.match

    def apply(self, key: str) -> str | None:
        """The target key if this rule matches `key` (whole key), else None. Drop rules return ''."""
        m = self.pattern.fullmatch(key)
        if m is None:
            return None
        return "" if self.op == "drop" else m.expand(self.to)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op, "match": self.match}
        for k in ("to", "reason", "name", "note"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


@dataclass(frozen=True)
class WeightFileSpec:
    kind: str
    path: str


@dataclass(frozen=True)
class DtypePolicy:
    default: str = "source"
    keep_fp32: tuple[str, ...] = ()
    allowed_source_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    note: str | None = None

    def keeps_fp32(self, canonical_key: str) -> bool:
        return any(re.search(p, canonical_key) for p in self.keep_fp32)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"default": self.default, "keep_fp32": list(self.keep_fp32),
                             "allowed_source_dtypes": list(self.allowed_source_dtypes)}
        if self.note is not None:
            d["note"] = self.note
        return d


@dataclass(frozen=True)
class CheckpointManifest:
    family: str
    format: str
    conversion_version: int
    upstream: dict[str, Any]
    config_file: str
    weight_files: tuple[WeightFileSpec, ...]
    config_mapping: str
    rules: tuple[Rule, ...]
    dtype_policy: DtypePolicy
    description: str = ""
    schema: str = SCHEMA
    origin: str = field(default="<memory>", compare=False)   # file it was loaded from (for messages)
    sha256: str | None = field(default=None, compare=False)  # of that file

    @property
    def id(self) -> str:
        return f"{self.family}/{self.format}"

    @property
    def upstream_class_name(self) -> str | None:
        return self.upstream.get("class_name")

    # ---- behaviour ----
    def match(self, key: str) -> tuple[Rule | None, str | None]:
        """(rule, target) for a source key: first matching rule wins; target is None for drops and misses."""
        for rule in self.rules:
            t = rule.apply(key)
            if t is not None:
                return rule, (t or None)
        return None, None

    # ---- validation ----
    def validate(self) -> "CheckpointManifest":
        where = f"checkpoint manifest {self.origin}"

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConversionError(f"{where}: {msg}")

        need(self.schema == SCHEMA, f"schema must be {SCHEMA!r}, got {self.schema!r}")
        for name in ("family", "format", "config_mapping", "config_file"):
            v = getattr(self, name)
            need(isinstance(v, str) and v != "", f"{name} must be a non-empty string, got {v!r}")
        need(re.fullmatch(r"[a-z0-9][a-z0-9_-]*", self.format) is not None,
             f"format must be lower-case [a-z0-9_-], got {self.format!r}")
        need(isinstance(self.conversion_version, int) and not isinstance(self.conversion_version, bool)
             and self.conversion_version >= 1, f"conversion_version must be an int >= 1, got {self.conversion_version!r}")
        need(isinstance(self.upstream, dict) and isinstance(self.upstream.get("source"), str),
             "upstream must be an object with a 'source' string")
        need(len(self.weight_files) > 0, "files.weights must list at least one weight layout")
        for w in self.weight_files:
            need(w.kind in WEIGHT_KINDS, f"files.weights: kind {w.kind!r} unknown; known kinds: {', '.join(WEIGHT_KINDS)}")
            need(isinstance(w.path, str) and w.path and "/" not in w.path and "\\" not in w.path,
                 f"files.weights: path {w.path!r} must be a plain file name")
        need(len(self.rules) > 0, "rules must not be empty")
        for i, r in enumerate(self.rules):
            rw = f"rules[{i}] ({r.label})"
            need(r.op in RULE_OPS, f"{rw}: op {r.op!r} unknown; this engine knows ops: {', '.join(RULE_OPS)}")
            need(r.match.startswith("^") and r.match.endswith("$") and not r.match.endswith("\\$"),
                 f"{rw}: regex {r.match!r} must be anchored as ^...$ (whole-key, suffix-exact match)")
            if r.op == "rename":
                need(isinstance(r.to, str) and r.to != "", f"{rw}: a rename rule needs a non-empty 'to'")
                for m in _GROUP_REF.finditer(r.to):
                    ref = m.group(1) if m.group(1) is not None else m.group(2)
                    ok = (int(ref) <= r.pattern.groups) if ref.isdigit() else (ref in r.pattern.groupindex)
                    need(ok, f"{rw}: 'to' {r.to!r} refers to group {ref!r}, which {r.match!r} does not define")
                need(r.reason is None, f"{rw}: 'reason' belongs to drop rules")
            else:
                need(isinstance(r.reason, str) and r.reason.strip() != "", f"{rw}: a drop rule needs a 'reason'")
                need(r.to is None, f"{rw}: a drop rule has no 'to'")
        p = self.dtype_policy
        need(p.default == "source" or p.default in DTYPE_NAMES,
             f"dtype_policy.default must be 'source' or one of {DTYPE_NAMES}, got {p.default!r}")
        for d in p.allowed_source_dtypes:
            need(d in DTYPE_NAMES, f"dtype_policy.allowed_source_dtypes: unknown dtype {d!r}")
        for pat in p.keep_fp32:
            try:
                re.compile(pat)
            except (re.error, TypeError) as e:
                need(False, f"dtype_policy.keep_fp32: regex {pat!r} does not compile ({e})")
        return self

    # ---- (de)serialisation ----
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "family": self.family,
            "format": self.format,
            "description": self.description,
            "conversion_version": self.conversion_version,
            "upstream": dict(self.upstream),
            "files": {"config": self.config_file,
                      "weights": [{"kind": w.kind, "path": w.path} for w in self.weight_files]},
            "config_mapping": self.config_mapping,
            "rules": [r.to_dict() for r in self.rules],
            "dtype_policy": self.dtype_policy.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Any, origin: str = "<memory>", sha256: str | None = None) -> "CheckpointManifest":
        where = f"checkpoint manifest {origin}"
        if not isinstance(d, dict):
            raise ConversionError(f"{where}: expected a JSON object")
        unknown = sorted(set(d) - _TOP_FIELDS)
        if unknown:
            raise ConversionError(f"{where}: unknown fields {unknown}")
        missing = sorted({"family", "format", "conversion_version", "upstream", "files", "config_mapping",
                          "rules", "dtype_policy"} - set(d))
        if missing:
            raise ConversionError(f"{where}: missing fields {missing}")
        files = d["files"]
        if not isinstance(files, dict) or set(files) - {"config", "weights"} or not isinstance(files.get("weights"), list):
            raise ConversionError(f"{where}: files must be {{'config': str, 'weights': [...]}}")
        weights = []
        for i, w in enumerate(files["weights"]):
            if not isinstance(w, dict) or set(w) != {"kind", "path"}:
                raise ConversionError(f"{where}: files.weights[{i}] must be {{'kind': ..., 'path': ...}}")
            weights.append(WeightFileSpec(kind=w["kind"], path=w["path"]))
        if not isinstance(d["rules"], list):
            raise ConversionError(f"{where}: rules must be a list")
        rules = []
        for i, r in enumerate(d["rules"]):
            if not isinstance(r, dict) or not isinstance(r.get("match"), str):
                raise ConversionError(f"{where}: rules[{i}] must be an object with a 'match' regex")
            op = r.get("op")
            if op not in RULE_OPS:
                raise ConversionError(f"{where}: rules[{i}]: op {op!r} unknown; this engine knows ops: {', '.join(RULE_OPS)}")
            extra = sorted(set(r) - _RULE_FIELDS[op])
            if extra:
                raise ConversionError(f"{where}: rules[{i}] ({r.get('name') or r['match']}): unknown fields {extra}")
            try:
                rules.append(Rule(**r))
            except ValueError as e:
                raise ConversionError(f"{where}: rules[{i}]: {e}") from None
        p = d["dtype_policy"]
        if not isinstance(p, dict) or set(p) - {"default", "keep_fp32", "allowed_source_dtypes", "note"}:
            raise ConversionError(f"{where}: dtype_policy must hold only default, keep_fp32, allowed_source_dtypes, note")
        policy = DtypePolicy(default=p.get("default", "source"), keep_fp32=tuple(p.get("keep_fp32", ())),
                             allowed_source_dtypes=tuple(p.get("allowed_source_dtypes", DtypePolicy.allowed_source_dtypes)),
                             note=p.get("note"))
        return cls(
            family=d["family"], format=d["format"], conversion_version=d["conversion_version"],
            upstream=d["upstream"], config_file=files.get("config", "config.json"), weight_files=tuple(weights),
            config_mapping=d["config_mapping"], rules=tuple(rules), dtype_policy=policy,
            description=d.get("description", ""), schema=d.get("schema", SCHEMA), origin=origin, sha256=sha256,
        ).validate()


def load_manifest_file(path: str | Path) -> CheckpointManifest:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConversionError(f"checkpoint manifest {path}: cannot read ({e.strerror or e})") from None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"checkpoint manifest {path}: invalid JSON ({e})") from None
    return CheckpointManifest.from_dict(data, origin=str(path), sha256=hashlib.sha256(raw).hexdigest())


def load_manifest(family: str, fmt: str) -> CheckpointManifest:
    """The validated manifest for converting `fmt` checkpoints of `family` (e.g. "cosmos3", "diffusers")."""
    from converters.families import get_family

    fam = get_family(family)
    known = fam.formats()
    if fmt not in known:
        raise ConversionError(f"unknown format {fmt!r} for {family}; known formats: {', '.join(known) or 'none'}")
    m = load_manifest_file(fam.checkpoints_dir / f"{fmt}.json")
    if m.family != family or m.format != fmt:
        raise ConversionError(f"checkpoint manifest {m.origin}: declares {m.id}, but is filed as {family}/{fmt}")
    if m.config_mapping not in fam.config_mappings:
        raise ConversionError(f"checkpoint manifest {m.origin}: config_mapping {m.config_mapping!r} unknown for {family}; "
                              f"known: {', '.join(sorted(fam.config_mappings))}")
    return m
