"""CheckpointManifest: how one upstream checkpoint format maps onto a family's canonical layout, as data.

A manifest is a JSON file `manifests/<family>/checkpoints/<format>.json` (one per (family, upstream format)):

    schema             "fvconvert.checkpoint_manifest/2" (".../1" is read too: a subset)
    family, format     e.g. "cosmos3", "framework"
    description        free text
    conversion_version int; bump when the mapping changes what a converted checkpoint holds
    upstream           {"source": str, "package"?, "version"?, "revision"?, "url"?, "note"?,
                        "class_name"?: must equal config.json's `_class_name` when that is present,
                        "model_types"?: [allowed config.json `model_type` values]}
    files              {"config": "config.json" | null,     null: the layout carries no usable config, give
                                                             one with --config or take a named --variant
                        "weights": [{"kind": "safetensors"|"safetensors_index"|"torch", "path": "...",
                                     "config"?: "sub/config.json",   a config path for this weight layout
                                     "sha256"?: "hex"}, ...],        the weight layouts a folder may hold
                        "expected"?: [{"path": "...", "sha256"?: "hex", "bytes"?: int, "required"?: bool}]}
    config_mapping     id of the function mapping the upstream config onto the family config
    normalize          ORDERED key normalisations applied to every source key before the rules:
                         {"op": "strip_prefix", "prefix": "model.net."}          a leading literal, ending in "."
                         {"op": "remove_component", "component": "_orig_mod"}    a whole dotted component
                       two source keys that normalise to one key are an error
    rules              ORDERED list; the first rule whose regex fully matches a (normalised) key decides:
                         {"op": "rename",    "match": "^...$", "to": "template"}
                         {"op": "transpose", "match", "to", "dims": [1, 0]}       permute dims, then rename
                         {"op": "reshape",   "match", "to"}                        reshape to the canonical shape
                         {"op": "split",     "match", "to": ["t1", "t2", ...], "dim": 0}
                                sizes along `dim` come from the targets' canonical shapes, in `to` order
                         {"op": "fuse",      "match", "to": "template", "dim": 0, "part": "\\2", "parts": ["a", "b"]}
                                every source whose `part` expands to one of `parts` is concatenated into
                                `to` along `dim`, in `parts` order; all parts must be present
                         {"op": "drop",      "match", "reason": "why this tensor is not needed",
                                "equals"?: "source.key"}    a tied copy: refused unless bitwise equal to that key
                         {"op": "sidecar",   "match", "sidecar": "vision_encoder", "to": "template", "reason"}
                                not canonical; dropped (reason reported) unless --keep-sidecars, then written
                                to OUT/<sidecar>/ under the `to` key
                       every rule may carry "name" and "note". Regexes are anchored (^...$), so a rule never
                       matches a key that merely contains it (suffix-exact); a key no rule matches is an error.
                       Index arithmetic (converters/exprs.py), on any rule:
                         "where": "g1 % (num_res_blocks + 2) == num_res_blocks + 1"   the rule matches only when
                                the regex matches and this holds (gN = group N as an int; other names are
                                config fields, e.g. num_res_blocks)
                         "let": {"stage": "g1 // (num_res_blocks + 2)"}   integers substituted into `to` as
                                {stage} (only in rules that have a `let`; others keep `{` literal)
    component          optional: which component kind of the family the format converts (e.g. wan "transformer",
                       "text_encoder", "vae"); default: the family's first component (converters/families.py)
    fills              optional list of the family's canonical parts this format fills (default: all);
                       a format filling fewer makes a *partial* canonical checkpoint (parts recorded in OUT)
    dtype_policy       {"default": "source", "allowed_source_dtypes": ["float32", ...], "note"?}
                       which canonical tensors stay float32 whatever the target dtype is not a format's business:
                       it is the canonical model's, the family's `fp32_keys(cfg)` (converters/families.py); a
                       manifest that still carries "keep_fp32" is refused
    parity             {"level": "C0", "post_check": "<entry point name>", "required": bool,
                        "unfilled_parts"?: "placeholders", "note"?}: the parity check a conversion must pass;
                       "placeholders" runs the family post-check on a temporary copy completed with seeded
                       placeholder weights for the parts the format does not fill (never written to OUT)

Loading validates everything (regexes compile and are anchored, templates only name existing groups, ops
and their fields are known) and raises ConversionError naming the manifest file and the bad entry.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from converters.errors import ConversionError
from converters.exprs import Expr, ExprError, Unresolved, group_env

SCHEMA = "fvconvert.checkpoint_manifest/2"
SCHEMAS = ("fvconvert.checkpoint_manifest/1", SCHEMA)
RULE_OPS = ("rename", "transpose", "reshape", "split", "fuse", "drop", "sidecar")
PRODUCING_OPS = ("rename", "transpose", "reshape", "split", "fuse")
NORMALIZE_OPS = ("strip_prefix", "remove_component")
WEIGHT_KINDS = ("safetensors", "safetensors_index", "torch")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
PARITY_LEVELS = ("C0", "C1", "C2", "C3", "C4")
_TOP_FIELDS = {"schema", "family", "format", "description", "conversion_version", "upstream", "files",
               "config_mapping", "normalize", "rules", "fills", "dtype_policy", "parity", "component"}
_UPSTREAM_FIELDS = {"source", "package", "version", "revision", "url", "note", "class_name", "model_types"}
_COMMON = {"op", "match", "name", "note", "where"}
_RULE_FIELDS = {
    "rename": _COMMON | {"to", "let"},
    "transpose": _COMMON | {"to", "dims", "let"},
    "reshape": _COMMON | {"to", "let"},
    "split": _COMMON | {"to", "dim", "let"},
    "fuse": _COMMON | {"to", "dim", "part", "parts", "let"},
    "drop": _COMMON | {"reason", "equals"},
    "sidecar": _COMMON | {"to", "sidecar", "reason", "let"},
}
_GROUP_REF = re.compile(r"\\(\d+)|\\g<([^>]*)>")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SIDECAR_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_COMPONENT = re.compile(r"^[A-Za-z0-9_\-]+$")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_GROUP_NAME = re.compile(r"^g(\d+)$")


def _templates(to: Any) -> list[str]:
    return list(to) if isinstance(to, (list, tuple)) else [to]


@dataclass(frozen=True)
class Rule:
    op: str
    match: str
    to: str | tuple[str, ...] | None = None
    reason: str | None = None
    name: str | None = None
    note: str | None = None
    dims: tuple[int, ...] | None = None
    dim: int | None = None
    part: str | None = None
    parts: tuple[str, ...] | None = None
    sidecar: str | None = None
    equals: str | None = None                        # drop only: a tied copy; must equal this source key bitwise
    let: tuple[tuple[str, str], ...] | None = None   # ordered (name, expression): computed template values
    where: str | None = None                         # guard expression
    pattern: re.Pattern = field(init=False, repr=False, compare=False)
    _exprs: tuple = field(init=False, repr=False, compare=False)    # ((name, Expr), ...), where Expr | None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "pattern", re.compile(self.match))
        except (re.error, TypeError) as e:
            raise ValueError(f"regex {self.match!r} does not compile ({e})") from None
        if isinstance(self.let, dict):
            object.__setattr__(self, "let", tuple(self.let.items()))
        lets: list = []
        if self.let is not None:
            if not isinstance(self.let, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in self.let):
                raise ValueError("'let' must be an object {name: expression}")
            for name, src in self.let:
                if not isinstance(name, str) or not name.isidentifier() or _GROUP_NAME.match(name) \
                        or name in self.pattern.groupindex:
                    raise ValueError(f"'let' name {name!r} must be an identifier other than gN and the regex's "
                                     f"group names")
                lets.append((name, Expr(src)))
        where = Expr(self.where) if self.where is not None else None
        object.__setattr__(self, "_exprs", (tuple(lets), where))

    # ---- index arithmetic (converters/exprs.py) ----
    @property
    def computes(self) -> bool:
        return self.let is not None or self.where is not None

    def expr_names(self) -> set[str]:
        """Config field names the rule's expressions read (everything that is not a group or a let name)."""
        lets, where = self._exprs
        own = {n for n, _ in lets} | set(self.pattern.groupindex)
        names = set().union(*(e.names for _, e in lets), where.names if where else set())
        return {n for n in names if n not in own and not _GROUP_NAME.match(n)}

    def _evaluate(self, m: re.Match, key: str, config) -> tuple[bool, dict[str, str]]:
        """(guard holds, {let name: value as text}). Without a config (format guessing only) a guard that needs
        one counts as holding and a value that needs one stays `{name}`."""
        lets, where = self._exprs
        groups = group_env(m, key)
        env = {**(config or {}), **groups}

        def run(e: Expr):
            for n in e.names:
                gm = _GROUP_NAME.match(n)
                if (gm or n in self.pattern.groupindex) and n not in groups:
                    if gm and int(gm.group(1)) > self.pattern.groups:
                        raise ExprError(f"{n}: the regex has only {self.pattern.groups} groups")
                    raise ExprError(f"{n}: group is {(m.group(int(gm.group(1))) if gm else m.group(n))!r}, "
                                    f"not a decimal integer")
            return e.eval(env)

        try:
            if where is not None:
                try:
                    if not run(where):
                        return False, {}
                except Unresolved:
                    if config is not None:
                        raise
            values: dict[str, str] = {}
            for name, e in lets:
                try:
                    v = run(e)
                except Unresolved:
                    if config is not None:
                        raise
                    continue
                env[name] = int(v)
                values[name] = str(int(v))
            return True, values
        except Unresolved as u:
            raise ConversionError(f"rule {self.label!r}: key {key!r}: expression needs {u.args[0]!r}, which is "
                                  f"neither a regex group nor a field of the config") from None
        except (ExprError, TypeError) as e:
            raise ConversionError(f"rule {self.label!r}: key {key!r}: {e}") from None

    @property
    def label(self) -> str:
        return self.name or self.match

    @property
    def produces(self) -> bool:
        return self.op in PRODUCING_OPS

    def expand(self, key: str, config: Mapping[str, Any] | None = None) -> tuple[str, ...] | None:
        """Targets for a key this rule fully matches (one, or several for split; () for drop), else None.
        `config`: the family config fields (a dict) that `let` / `where` expressions may read."""
        m = self.pattern.fullmatch(key)
        if m is None:
            return None
        values: dict[str, str] = {}
        if self.computes:
            ok, values = self._evaluate(m, key, config)
            if not ok:
                return None
        if self.op == "drop":
            return ()
        out = tuple(m.expand(t) for t in _templates(self.to))
        if self.let is not None:
            out = tuple(_PLACEHOLDER.sub(lambda p: values.get(p.group(1), p.group(0)), t) for t in out)
        return out

    def part_of(self, key: str) -> str:
        """fuse: which of `parts` this key is."""
        return self.pattern.fullmatch(key).expand(self.part)

    def apply(self, key: str, config: Mapping[str, Any] | None = None) -> str | None:
        """Back-compatible single-target view: the (first) target, '' for drops, None when no match."""
        t = self.expand(key, config)
        if t is None:
            return None
        return t[0] if t else ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op, "match": self.match}
        for k in ("to", "dims", "dim", "part", "parts", "sidecar", "reason", "equals", "name", "note", "where"):
            v = getattr(self, k)
            if v is not None:
                d[k] = list(v) if isinstance(v, tuple) else v
        if self.let is not None:
            d["let"] = dict(self.let)
        return d


@dataclass(frozen=True)
class Normalization:
    op: str
    prefix: str | None = None
    component: str | None = None
    note: str | None = None

    def apply(self, key: str) -> str:
        if self.op == "strip_prefix":
            return key[len(self.prefix):] if key.startswith(self.prefix) else key
        parts = key.split(".")
        kept = [p for p in parts if p != self.component]
        return ".".join(kept) if kept else key

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op}
        for k in ("prefix", "component", "note"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


@dataclass(frozen=True)
class WeightFileSpec:
    kind: str
    path: str
    config: str | None = None
    sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "path": self.path}
        if self.config is not None:
            d["config"] = self.config
        if self.sha256 is not None:
            d["sha256"] = self.sha256
        return d


@dataclass(frozen=True)
class ExpectedFile:
    path: str
    sha256: str | None = None
    bytes: int | None = None
    required: bool = True

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path}
        for k in ("sha256", "bytes"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if not self.required:
            d["required"] = False
        return d


@dataclass(frozen=True)
class DtypePolicy:
    """Output and accepted source dtypes of one format. Which tensors stay float32 is the family's `fp32_keys`."""
    default: str = "source"
    allowed_source_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"default": self.default, "allowed_source_dtypes": list(self.allowed_source_dtypes)}
        if self.note is not None:
            d["note"] = self.note
        return d


@dataclass(frozen=True)
class ParityRequirement:
    level: str = "C0"
    post_check: str | None = None      # entry point name in group fvconvert.post_check (default: the family)
    required: bool = False             # fvconvert refuses to finish without it (unless --skip-parity)
    unfilled_parts: str | None = None  # "placeholders": check a partial checkpoint completed with placeholders
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"level": self.level, "required": self.required}
        for k in ("post_check", "unfilled_parts", "note"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


@dataclass(frozen=True)
class CheckpointManifest:
    family: str
    format: str
    conversion_version: int
    upstream: dict[str, Any]
    config_file: str | None
    weight_files: tuple[WeightFileSpec, ...]
    config_mapping: str
    rules: tuple[Rule, ...]
    dtype_policy: DtypePolicy
    description: str = ""
    normalize: tuple[Normalization, ...] = ()
    fills: tuple[str, ...] | None = None
    parity: ParityRequirement = field(default_factory=ParityRequirement)
    expected_files: tuple[ExpectedFile, ...] = ()
    component: str | None = None                             # None: the family's default component
    schema: str = SCHEMA
    origin: str = field(default="<memory>", compare=False)   # file it was loaded from (for messages)
    sha256: str | None = field(default=None, compare=False)  # of that file

    @property
    def id(self) -> str:
        return f"{self.family}/{self.format}"

    @property
    def upstream_class_name(self) -> str | None:
        return self.upstream.get("class_name")

    @property
    def post_check_name(self) -> str:
        return self.parity.post_check or self.family

    # ---- behaviour ----
    def normalize_key(self, key: str) -> str:
        for n in self.normalize:
            key = n.apply(key)
        return key

    def rule_for(self, key: str, config: Mapping[str, Any] | None = None) -> tuple[Rule | None, tuple[str, ...]]:
        """(first matching rule, its targets) for a normalised key; (None, ()) when no rule matches. `config`
        (the family config as a dict) feeds rules with `let` / `where`; without it such rules match on their
        regex alone and leave config-dependent values unresolved (good for guessing a format, not converting)."""
        for rule in self.rules:
            t = rule.expand(key, config)
            if t is not None:
                return rule, t
        return None, ()

    def match(self, key: str, config: Mapping[str, Any] | None = None) -> tuple[Rule | None, str | None]:
        """(rule, target) for a source key (normalised first): first matching rule wins; target is None for
        drops, sidecars and misses; for a split, the first target."""
        rule, targets = self.rule_for(self.normalize_key(key), config)
        if rule is None or not rule.produces:
            return rule, None
        return rule, targets[0]

    # ---- validation ----
    def validate(self) -> "CheckpointManifest":
        where = f"checkpoint manifest {self.origin}"

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConversionError(f"{where}: {msg}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(self.schema in SCHEMAS, f"schema must be one of {SCHEMAS}, got {self.schema!r}")
        for name in ("family", "format", "config_mapping"):
            v = getattr(self, name)
            need(isinstance(v, str) and v != "", f"{name} must be a non-empty string, got {v!r}")
        need(self.config_file is None or (isinstance(self.config_file, str) and self.config_file != ""),
             f"files.config must be a file name or null, got {self.config_file!r}")
        need(re.fullmatch(r"[a-z0-9][a-z0-9_-]*", self.format) is not None,
             f"format must be lower-case [a-z0-9_-], got {self.format!r}")
        need(is_int(self.conversion_version) and self.conversion_version >= 1,
             f"conversion_version must be an int >= 1, got {self.conversion_version!r}")
        need(isinstance(self.upstream, dict) and isinstance(self.upstream.get("source"), str),
             "upstream must be an object with a 'source' string")
        extra = sorted(set(self.upstream) - _UPSTREAM_FIELDS)
        need(not extra, f"upstream: unknown fields {extra}")
        mt = self.upstream.get("model_types")
        need(mt is None or (isinstance(mt, list) and all(isinstance(x, str) and x for x in mt)),
             "upstream.model_types must be a list of strings")
        need(len(self.weight_files) > 0, "files.weights must list at least one weight layout")
        for w in self.weight_files:
            need(w.kind in WEIGHT_KINDS, f"files.weights: kind {w.kind!r} unknown; known kinds: {', '.join(WEIGHT_KINDS)}")
            need(_plain_relpath(w.path), f"files.weights: path {w.path!r} must be a relative path inside the source")
            need(w.config is None or _plain_relpath(w.config),
                 f"files.weights: config {w.config!r} must be a relative path inside the source")
            need(w.sha256 is None or bool(_HEX64.match(str(w.sha256))),
                 f"files.weights: sha256 of {w.path!r} must be 64 lower-case hex digits")
        for e in self.expected_files:
            need(_plain_relpath(e.path), f"files.expected: path {e.path!r} must be a relative path inside the source")
            need(e.sha256 is None or bool(_HEX64.match(str(e.sha256))),
                 f"files.expected: sha256 of {e.path!r} must be 64 lower-case hex digits")
            need(e.bytes is None or (is_int(e.bytes) and e.bytes >= 0), f"files.expected: bytes of {e.path!r} must be an int >= 0")
        for i, n in enumerate(self.normalize):
            nw = f"normalize[{i}]"
            need(n.op in NORMALIZE_OPS, f"{nw}: op {n.op!r} unknown; known: {', '.join(NORMALIZE_OPS)}")
            if n.op == "strip_prefix":
                need(isinstance(n.prefix, str) and len(n.prefix) > 1 and n.prefix.endswith(".") and n.component is None
                     and not n.prefix.startswith("."),
                     f"{nw}: strip_prefix needs a literal 'prefix' ending in '.' (a whole leading component path)")
            else:
                need(isinstance(n.component, str) and bool(_COMPONENT.match(n.component)) and n.prefix is None,
                     f"{nw}: remove_component needs one dot-free 'component'")
        need(len(self.rules) > 0, "rules must not be empty")
        for i, r in enumerate(self.rules):
            rw = f"rules[{i}] ({r.label})"
            need(r.op in RULE_OPS, f"{rw}: op {r.op!r} unknown; this engine knows ops: {', '.join(RULE_OPS)}")
            need(r.match.startswith("^") and r.match.endswith("$") and not r.match.endswith("\\$"),
                 f"{rw}: regex {r.match!r} must be anchored as ^...$ (whole-key, suffix-exact match)")
            if r.op == "drop":
                need(isinstance(r.reason, str) and r.reason.strip() != "", f"{rw}: a drop rule needs a 'reason'")
                need(r.to is None, f"{rw}: a drop rule has no 'to'")
                continue
            if r.op == "split":
                need(isinstance(r.to, tuple) and len(r.to) >= 2 and all(isinstance(t, str) and t for t in r.to),
                     f"{rw}: a split rule needs 'to': a list of at least two target templates")
                need(len(set(r.to)) == len(r.to), f"{rw}: split targets must differ")
            else:
                need(isinstance(r.to, str) and r.to != "", f"{rw}: a {r.op} rule needs a non-empty 'to' template")
            for t in _templates(r.to):
                for m in _GROUP_REF.finditer(t):
                    ref = m.group(1) if m.group(1) is not None else m.group(2)
                    ok = (int(ref) <= r.pattern.groups) if ref.isdigit() else (ref in r.pattern.groupindex)
                    need(ok, f"{rw}: 'to' {t!r} refers to group {ref!r}, which {r.match!r} does not define")
                if r.let is not None:
                    lets = {n for n, _ in r.let}
                    for p in _PLACEHOLDER.finditer(t):
                        need(p.group(1) in lets, f"{rw}: 'to' {t!r} uses {{{p.group(1)}}}, which 'let' does not define")
                    need("{" not in _PLACEHOLDER.sub("", t) and "}" not in _PLACEHOLDER.sub("", t),
                         f"{rw}: 'to' {t!r} has a brace that is not a {{let name}} placeholder")
            if r.computes:
                lets, guard = r._exprs
                all_lets = {n for n, _ in lets}
                for i, (name, e) in enumerate(lets + ((("where", guard),) if guard else ())):
                    for n in e.names:
                        gm = _GROUP_NAME.match(n)
                        need(not gm or 1 <= int(gm.group(1)) <= r.pattern.groups,
                             f"{rw}: expression {e.source!r} reads {n}, but {r.match!r} has {r.pattern.groups} groups")
                        need(name == "where" or n not in all_lets or n in {x for x, _ in lets[:i]},
                             f"{rw}: let {name!r} reads {n!r}, which is not defined before it")
                        need(name != "where" or n not in all_lets,
                             f"{rw}: 'where' reads let value {n!r}; a guard reads groups and config fields only")
            if r.op in ("split", "fuse"):
                need(is_int(r.dim) and r.dim >= 0, f"{rw}: a {r.op} rule needs 'dim', an int >= 0")
            else:
                need(r.dim is None, f"{rw}: 'dim' belongs to split/fuse rules")
            if r.op == "transpose":
                d = r.dims
                need(isinstance(d, tuple) and len(d) >= 2 and sorted(d) == list(range(len(d)))
                     and all(is_int(x) for x in d) and list(d) != list(range(len(d))),
                     f"{rw}: a transpose rule needs 'dims', a permutation of 0..n-1 other than the identity")
            else:
                need(r.dims is None, f"{rw}: 'dims' belongs to transpose rules")
            if r.op == "fuse":
                need(isinstance(r.part, str) and _GROUP_REF.search(r.part) is not None,
                     f"{rw}: a fuse rule needs 'part', a template naming a group (e.g. \"\\\\2\")")
                for m in _GROUP_REF.finditer(r.part):
                    ref = m.group(1) if m.group(1) is not None else m.group(2)
                    ok = (int(ref) <= r.pattern.groups) if ref.isdigit() else (ref in r.pattern.groupindex)
                    need(ok, f"{rw}: 'part' {r.part!r} refers to group {ref!r}, which {r.match!r} does not define")
                need(isinstance(r.parts, tuple) and len(r.parts) >= 2 and len(set(r.parts)) == len(r.parts)
                     and all(isinstance(p, str) and p for p in r.parts),
                     f"{rw}: a fuse rule needs 'parts', a list of at least two distinct part names (concatenation order)")
            else:
                need(r.part is None and r.parts is None, f"{rw}: 'part'/'parts' belong to fuse rules")
            if r.op == "sidecar":
                need(isinstance(r.sidecar, str) and bool(_SIDECAR_NAME.match(r.sidecar)),
                     f"{rw}: a sidecar rule needs 'sidecar', a folder name [a-z][a-z0-9_]*")
                need(isinstance(r.reason, str) and r.reason.strip() != "", f"{rw}: a sidecar rule needs a 'reason'")
            else:
                need(r.sidecar is None, f"{rw}: 'sidecar' belongs to sidecar rules")
            if r.equals is not None:
                need(r.op == "drop" and isinstance(r.equals, str) and r.equals != "",
                     f"{rw}: 'equals' (a tied copy's source key) belongs to drop rules")
                need(r.reason is None, f"{rw}: 'reason' belongs to drop and sidecar rules")
        if self.fills is not None:
            need(len(self.fills) > 0 and all(isinstance(p, str) and p for p in self.fills)
                 and len(set(self.fills)) == len(self.fills), "fills must be a non-empty list of distinct part names")
        p = self.dtype_policy
        need(p.default == "source" or p.default in DTYPE_NAMES,
             f"dtype_policy.default must be 'source' or one of {DTYPE_NAMES}, got {p.default!r}")
        for d in p.allowed_source_dtypes:
            need(d in DTYPE_NAMES, f"dtype_policy.allowed_source_dtypes: unknown dtype {d!r}")
        q = self.parity
        need(q.level in PARITY_LEVELS, f"parity.level must be one of {PARITY_LEVELS}, got {q.level!r}")
        need(isinstance(q.required, bool), f"parity.required must be true or false, got {q.required!r}")
        need(q.post_check is None or (isinstance(q.post_check, str) and q.post_check != ""),
             "parity.post_check must be an entry point name")
        need(q.unfilled_parts in (None, "placeholders"), f"parity.unfilled_parts must be 'placeholders' or absent, "
                                                          f"got {q.unfilled_parts!r}")
        return self

    # ---- (de)serialisation ----
    def to_dict(self) -> dict[str, Any]:
        files: dict[str, Any] = {"config": self.config_file, "weights": [w.to_dict() for w in self.weight_files]}
        if self.expected_files:
            files["expected"] = [e.to_dict() for e in self.expected_files]
        d: dict[str, Any] = {
            "schema": self.schema,
            "family": self.family,
            "format": self.format,
            "description": self.description,
            "conversion_version": self.conversion_version,
            "upstream": dict(self.upstream),
            "files": files,
            "config_mapping": self.config_mapping,
        }
        if self.normalize:
            d["normalize"] = [n.to_dict() for n in self.normalize]
        d["rules"] = [r.to_dict() for r in self.rules]
        if self.fills is not None:
            d["fills"] = list(self.fills)
        if self.component is not None:
            d["component"] = self.component
        d["dtype_policy"] = self.dtype_policy.to_dict()
        d["parity"] = self.parity.to_dict()
        return d

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
        if (not isinstance(files, dict) or set(files) - {"config", "weights", "expected"}
                or not isinstance(files.get("weights"), list)):
            raise ConversionError(f"{where}: files must be {{'config': str|null, 'weights': [...], 'expected'?: [...]}}")
        weights = []
        for i, w in enumerate(files["weights"]):
            if not isinstance(w, dict) or not {"kind", "path"} <= set(w) or set(w) - {"kind", "path", "config", "sha256"}:
                raise ConversionError(f"{where}: files.weights[{i}] must be {{'kind', 'path', 'config'?, 'sha256'?}}")
            weights.append(WeightFileSpec(kind=w["kind"], path=w["path"], config=w.get("config"), sha256=w.get("sha256")))
        expected = []
        for i, e in enumerate(files.get("expected", [])):
            if not isinstance(e, dict) or "path" not in e or set(e) - {"path", "sha256", "bytes", "required"}:
                raise ConversionError(f"{where}: files.expected[{i}] must be {{'path', 'sha256'?, 'bytes'?, 'required'?}}")
            if not isinstance(e.get("required", True), bool):
                raise ConversionError(f"{where}: files.expected[{i}].required must be true or false")
            expected.append(ExpectedFile(path=e["path"], sha256=e.get("sha256"), bytes=e.get("bytes"),
                                         required=e.get("required", True)))
        norms = []
        raw_norm = d.get("normalize", [])
        if not isinstance(raw_norm, list):
            raise ConversionError(f"{where}: normalize must be a list")
        for i, n in enumerate(raw_norm):
            if not isinstance(n, dict) or set(n) - {"op", "prefix", "component", "note"}:
                raise ConversionError(f"{where}: normalize[{i}] must be {{'op', 'prefix'|'component', 'note'?}}")
            norms.append(Normalization(op=n.get("op"), prefix=n.get("prefix"), component=n.get("component"),
                                       note=n.get("note")))
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
            kw = dict(r)
            for k in ("to", "dims", "parts"):
                if isinstance(kw.get(k), list):
                    kw[k] = tuple(kw[k])
            if "let" in kw and not isinstance(kw["let"], dict):
                raise ConversionError(f"{where}: rules[{i}] ({r.get('name') or r['match']}): 'let' must be an object "
                                      f"{{name: expression}}")
            try:
                rules.append(Rule(**kw))
            except ValueError as e:
                raise ConversionError(f"{where}: rules[{i}]: {e}") from None
        p = d["dtype_policy"]
        if isinstance(p, dict) and "keep_fp32" in p:
            raise ConversionError(f"{where}: dtype_policy.keep_fp32 is no longer read: which canonical tensors stay "
                                  f"float32 is a property of the canonical model, not of a source format, and lives "
                                  f"in the family's fp32_keys(cfg) (converters/families.py: cosmos3 "
                                  f"manifests/cosmos3/keys.py fp32_keys, seedvr2 manifests/seedvr2/keys.py "
                                  f"nadit_fp32_keys, wan DiT manifests/wan/dit.py dit_fp32_keys); remove the field")
        if not isinstance(p, dict) or set(p) - {"default", "allowed_source_dtypes", "note"}:
            raise ConversionError(f"{where}: dtype_policy must hold only default, allowed_source_dtypes, note")
        policy = DtypePolicy(default=p.get("default", "source"),
                             allowed_source_dtypes=tuple(p.get("allowed_source_dtypes", DtypePolicy.allowed_source_dtypes)),
                             note=p.get("note"))
        q = d.get("parity", {})
        if not isinstance(q, dict) or set(q) - {"level", "post_check", "required", "unfilled_parts", "note"}:
            raise ConversionError(f"{where}: parity must hold only level, post_check, required, unfilled_parts, note")
        parity = ParityRequirement(level=q.get("level", "C0"), post_check=q.get("post_check"),
                                   required=q.get("required", False), unfilled_parts=q.get("unfilled_parts"),
                                   note=q.get("note"))
        fills = d.get("fills")
        if fills is not None and not isinstance(fills, list):
            raise ConversionError(f"{where}: fills must be a list of part names")
        return cls(
            family=d["family"], format=d["format"], conversion_version=d["conversion_version"],
            upstream=d["upstream"], config_file=files.get("config", "config.json"), weight_files=tuple(weights),
            config_mapping=d["config_mapping"], rules=tuple(rules), dtype_policy=policy,
            description=d.get("description", ""), normalize=tuple(norms),
            fills=tuple(fills) if fills is not None else None, parity=parity, expected_files=tuple(expected),
            component=d.get("component"), schema=d.get("schema", SCHEMA), origin=origin, sha256=sha256,
        ).validate()


def _plain_relpath(p: Any) -> bool:
    """A relative path inside the source folder: no absolute path, no '..', no backslashes, no empty parts."""
    if not isinstance(p, str) or not p or "\\" in p or p.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in p.split("/"))


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


def check_against_family(m: CheckpointManifest, family) -> CheckpointManifest:
    """Family-level checks: config mapping known, fills name real parts."""
    if m.config_mapping not in family.config_mappings:
        raise ConversionError(f"checkpoint manifest {m.origin}: config_mapping {m.config_mapping!r} unknown for "
                              f"{family.name}; known: {', '.join(sorted(family.config_mappings))}")
    if m.fills is not None:
        bad = [p for p in m.fills if p not in family.part_names]
        if bad:
            raise ConversionError(f"checkpoint manifest {m.origin}: fills names unknown part(s) {bad}; "
                                  f"{family.name} parts: {', '.join(family.part_names)}")
    if m.family != family.name:
        raise ConversionError(f"checkpoint manifest {m.origin}: declares family {m.family!r}, not {family.name!r}")
    computing = [r for r in m.rules if r.computes]
    if computing and family.list_variants():
        fields = set(family.config_to_dict(family.load_variant(family.list_variants()[0])))
        for r in computing:
            bad = sorted(r.expr_names() - fields)
            if bad:
                raise ConversionError(f"checkpoint manifest {m.origin}: rule {r.label!r}: expression reads {bad}, "
                                      f"which are not {family.name} config fields (nor regex groups or let names)")
    return m


def format_aliases(family: str) -> dict[str, str]:
    """Other names a format of `family` goes by (its layout's `format_aliases`, e.g. cosmos3's cosmos_framework)."""
    from manifests.layouts import family_layouts
    lay = family_layouts().get(family)
    return dict(lay.format_aliases) if lay is not None else {}


def load_manifest(family: str, fmt: str) -> CheckpointManifest:
    """The validated manifest for converting `fmt` checkpoints of `family` (e.g. "cosmos3", "diffusers").
    `fmt` may also be a path to a manifest JSON file (a custom format)."""
    from converters.families import family_formats, get_family

    fam = get_family(family)
    if fmt.endswith(".json") and ("/" in fmt or Path(fmt).is_file()):
        m = load_manifest_file(fmt)
        return check_against_family(m, get_family(family, m.component))
    known = family_formats(family)
    fmt = format_aliases(family).get(fmt, fmt)
    if fmt not in known:
        raise ConversionError(f"unknown format {fmt!r} for {family}; known formats: {', '.join(known) or 'none'}")
    m = load_manifest_file(fam.checkpoints_dir / f"{fmt}.json")
    if m.family != family or m.format != fmt:
        raise ConversionError(f"checkpoint manifest {m.origin}: declares {m.id}, but is filed as {family}/{fmt}")
    return check_against_family(m, get_family(family, m.component))
