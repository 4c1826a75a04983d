"""The conversion report (conversion_report.json): what was renamed / split / fused / dropped, dtypes, shapes, parts,
sidecars, hashes and parity. Part of the conversion engine (converters/engine.py re-exports these names)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from converters.families import Family
from converters.plan import Plan
from converters.writer import OutTensor


@dataclass
class ConversionReport:
    family: str
    format: str
    src: str
    out: str | None
    engine_version: int
    conversion_version: int
    manifest: dict
    source: dict
    config: dict
    config_source: dict
    dtype_requested: str | None
    variant: dict | None
    num_source_keys: int
    num_output_keys: int
    parts: dict
    components: dict
    renamed: list[dict]
    normalized: list[dict]
    dropped: list[dict]
    sidecars: dict
    unexpected: list[str]
    missing: list[str]
    truncated: dict | None
    dtypes: dict
    shapes: dict
    nonfinite: list[dict]
    inputs: list[dict]
    outputs: list[dict] = field(default_factory=list)
    weights_version: str | None = None     # "sha256:<hex>" over the canonical weight files' + config.json's sha256
    component: str | None = None           # the component kind converted (wan: transformer | text_encoder | vae)
    parity: dict = field(default_factory=lambda: {"status": "skipped"})
    elapsed_s: float = 0.0
    throughput: dict = field(default_factory=dict)
    created_utc: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def ok(self) -> bool:
        return not self.unexpected and not self.missing


def _summaries(plan: Plan, family: Family) -> tuple[dict, dict]:
    src = Counter(e.src_dtype for e in plan.entries)
    out = Counter(e.out_dtype for e in plan.entries)
    cast = sum(e.src_dtype != e.out_dtype for e in plan.entries)
    fp32 = set(family.fp32_keys(plan.cfg))
    kept = [e.target for e in plan.entries if e.out_dtype == "float32" and e.target in fp32]
    sizes = [OutTensor(e.target, e.out_dtype, e.shape) for e in plan.entries]
    largest = max(sizes, key=lambda t: t.nbytes) if sizes else None
    dtypes = {"source": dict(src), "output": dict(out), "cast": cast, "kept_fp32": kept}
    shapes = {"num_params": sum(math.prod(e.shape) for e in plan.entries),
              "output_bytes": sum(t.nbytes for t in sizes),
              "largest": {"key": largest.key, "shape": list(largest.shape), "bytes": largest.nbytes} if largest else None}
    return dtypes, shapes


def _components(plan: Plan) -> dict:
    comp: dict[str, dict] = {}
    for e in plan.entries:
        c = comp.setdefault(e.part, {"keys": 0, "params": 0, "ops": Counter()})
        c["keys"] += 1
        c["params"] += math.prod(e.shape)
        c["ops"][e.op] += 1
    return {p: {**c, "ops": dict(c["ops"])} for p, c in comp.items()}


def _renamed(plan: Plan) -> list[dict]:
    out = []
    for e in plan.entries:
        d = {"from": e.source_key if len(e.sources) == 1 else [s.key for s in e.sources], "to": e.target,
             "file": str(e.file), "rule": e.rule, "op": e.op, "part": e.part}
        out.append(d)
    return out
