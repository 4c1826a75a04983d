"""`deployment.yaml`: which role pools a fleet runs, how many replicas each, how state crosses between roles and
where the replicas are placed, validated into frozen dataclasses (the seed's Deployment and Fleet Plane).

    version: 1
    name: wan-tiny-disagg
    model: {family: wan, variant: tiny-2.1-t2v, seed_weights: 0, device: cpu, dtype: fp32}   # or model: {path: DIR}
    transport: shared_memory          # inprocess | shared_memory | torch_dist | ray_object_store
    placement: {backend: ray, address: local, num_cpus: 2, strategy: PACK}
    roles:
      encoder:  {replicas: 1, num_cpus: 0.5}
      denoiser: {replicas: 2, num_cpus: 0.5}       # ranks: model-parallel ranks inside one replica (torchrun's)
      decoder:  {replicas: 1, num_cpus: 0.5}
    routing: {affinity: true, health_interval_s: 2, health_timeout_s: 10, stage_timeout_s: 600, max_attempts: 3}
    slo: {p95_latency_s: 120, max_queue: 16}

`load_deployment(path)` / `parse_deployment(mapping)` -> `DeploymentSpec`; anything wrong is one `DeploymentError`
whose message starts with the dotted field (`roles.denoiser.replicas: must be an integer >= 1, got 0`). Ray places
replicas (one actor each, `optimized/fleet/ray_pool.py`); torchrun stays the launcher of the model-parallel ranks
inside one replica (`ranks` > 1 is refused here until a replica can start them). stdlib only (+ PyYAML when
installed; a JSON file is read without it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("encoder", "denoiser", "decoder")          # the program's stage boundaries, in order
TRANSPORTS = ("inprocess", "shared_memory", "torch_dist", "ray_object_store")
BACKENDS = ("ray", "local")                         # local: every replica in this process (tests, no Ray)
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")   # Ray placement-group strategies
DTYPES = ("fp32", "bf16", "fp16")
SPEC_VERSION = 1


class DeploymentError(ValueError):
    """A deployment.yaml the fleet cannot run; `field` is the dotted path of the first wrong field."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}" if field_path else message)
        self.field = field_path


@dataclass(frozen=True)
class ModelSource:
    """What every role loads: a canonical model directory (`path`) or a family variant with seeded weights."""
    family: str | None = None
    variant: str | None = None
    path: str | None = None
    seed_weights: int = 0
    device: str = "cpu"
    dtype: str = "fp32"


@dataclass(frozen=True)
class RolePoolSpec:
    """One role's pool: `replicas` resident instances, each with its own scheduler in its own process."""
    role: str
    replicas: int = 1
    num_cpus: float = 1.0              # Ray resources reserved per replica
    num_gpus: float = 0.0
    ranks: int = 1                     # model-parallel ranks inside one replica (launched by torchrun, not Ray)
    max_inflight: int = 4              # stage calls queued on one replica before the router looks elsewhere


@dataclass(frozen=True)
class PlacementSpec:
    backend: str = "ray"
    address: str = "local"             # local: start a Ray cluster in this process; else ray.init(address=...)
    num_cpus: int | None = None        # the local cluster's CPUs (None: Ray's default, the machine's)
    strategy: str = "PACK"


@dataclass(frozen=True)
class RoutingSpec:
    affinity: bool = True              # prefer the replica where the prompt's text embedding is resident
    health_interval_s: float = 2.0     # seconds between health probes of a replica
    health_timeout_s: float = 10.0     # a probe not answered in this long marks the replica unhealthy
    stage_timeout_s: float = 600.0     # a stage call not answered in this long: the replica is taken as dead
    max_attempts: int = 3              # tries of one stage (on different replicas) before the request fails


@dataclass(frozen=True)
class SLOSpec:
    p95_latency_s: float | None = None
    max_queue: int = 16                # requests in flight at the gateway (more: 429)


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    model: ModelSource
    transport: str
    placement: PlacementSpec
    roles: tuple[RolePoolSpec, ...]    # in ROLES order
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    slo: SLOSpec = field(default_factory=SLOSpec)
    version: int = SPEC_VERSION

    def pool(self, role: str) -> RolePoolSpec:
        for p in self.roles:
            if p.role == role:
                return p
        raise KeyError(role)

    def replica_ids(self, role: str) -> list[str]:
        return [f"{role}-{i}" for i in range(self.pool(role).replicas)]

    def to_dict(self) -> dict:
        import dataclasses
        d = dataclasses.asdict(self)
        d["roles"] = {p.pop("role"): p for p in d["roles"]}
        return d


# ------------------------------------------------------------------------------------------------ field readers
def _mapping(value: Any, where: str) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise DeploymentError(where, f"must be a mapping, got {type(value).__name__}")
    return value


def _only(m: Mapping, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in m if k not in allowed)
    if unknown:
        path = f"{where}.{unknown[0]}" if where else unknown[0]
        raise DeploymentError(path, f"unknown field; allowed: {', '.join(allowed)}")


def _int(m: Mapping, key: str, where: str, default: int | None, lo: int) -> int | None:
    v = m.get(key, default)
    if v is None and default is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise DeploymentError(f"{where}.{key}", f"must be an integer >= {lo}, got {v!r}")
    return v


def _number(m: Mapping, key: str, where: str, default: float | None, lo: float = 0.0, strict: bool = False) -> Any:
    v = m.get(key, default)
    if v is None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > lo if strict else
                                                                                         v >= lo)
    if not ok:
        raise DeploymentError(f"{where}.{key}", f"must be a number {'>' if strict else '>='} {lo:g}, got {v!r}")
    return float(v)


def _choice(m: Mapping, key: str, where: str, default: str | None, choices: tuple[str, ...]) -> str:
    v = m.get(key, default)
    if v not in choices:
        raise DeploymentError(f"{where}.{key}" if where else key, f"must be one of {', '.join(choices)}, got {v!r}")
    return v


def _str(m: Mapping, key: str, where: str) -> str | None:
    v = m.get(key)
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise DeploymentError(f"{where}.{key}", f"must be a non-empty string, got {v!r}")
    return v


# ------------------------------------------------------------------------------------------------------ sections
def _model(raw: Any) -> ModelSource:
    if raw is None:
        raise DeploymentError("model", "required (family + variant, or path)")
    m = _mapping(raw, "model")
    _only(m, ("family", "variant", "path", "seed_weights", "device", "dtype"), "model")
    family, variant, path = _str(m, "family", "model"), _str(m, "variant", "model"), _str(m, "path", "model")
    if (variant is None) == (path is None):
        raise DeploymentError("model", "give exactly one of variant (seeded random weights) or path (a canonical "
                              "model directory)")
    if variant is not None and family is None and ":" not in variant:
        raise DeploymentError("model.family", "required with variant (or write variant as FAMILY:VARIANT)")
    device = m.get("device", "cpu")
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or
                                           (device.startswith("cuda:") and device[5:].isdigit())):
        raise DeploymentError("model.device", f"must be cpu, cuda or cuda:N, got {device!r}")
    return ModelSource(family=family, variant=variant, path=path,
                       seed_weights=_int(m, "seed_weights", "model", 0, 0),
                       device=device, dtype=_choice(m, "dtype", "model", "fp32", DTYPES))


def _role(role: str, raw: Any) -> RolePoolSpec:
    where = f"roles.{role}"
    m = _mapping(raw, where)
    _only(m, ("replicas", "num_cpus", "num_gpus", "ranks", "max_inflight"), where)
    ranks = _int(m, "ranks", where, 1, 1)
    if ranks != 1:   # torchrun launches the ranks of one replica; a replica that starts them is not built yet
        raise DeploymentError(f"{where}.ranks", f"{ranks} model-parallel ranks per replica: not supported yet (a "
                              f"replica is one process; torchrun launches model-parallel ranks, Ray does not)")
    return RolePoolSpec(role=role, replicas=_int(m, "replicas", where, 1, 1),
                        num_cpus=_number(m, "num_cpus", where, 1.0), num_gpus=_number(m, "num_gpus", where, 0.0),
                        ranks=ranks, max_inflight=_int(m, "max_inflight", where, 4, 1))


def _placement(raw: Any) -> PlacementSpec:
    m = _mapping(raw, "placement")
    _only(m, ("backend", "address", "num_cpus", "strategy"), "placement")
    address = m.get("address", "local")
    if not isinstance(address, str) or not address:
        raise DeploymentError("placement.address", f"must be 'local', 'auto' or ray://HOST:PORT, got {address!r}")
    return PlacementSpec(backend=_choice(m, "backend", "placement", "ray", BACKENDS), address=address,
                         num_cpus=_int(m, "num_cpus", "placement", None, 1),
                         strategy=_choice(m, "strategy", "placement", "PACK", STRATEGIES))


def _routing(raw: Any) -> RoutingSpec:
    m = _mapping(raw, "routing")
    _only(m, ("affinity", "health_interval_s", "health_timeout_s", "stage_timeout_s", "max_attempts"), "routing")
    affinity = m.get("affinity", True)
    if not isinstance(affinity, bool):
        raise DeploymentError("routing.affinity", f"must be true or false, got {affinity!r}")
    return RoutingSpec(affinity=affinity,
                       health_interval_s=_number(m, "health_interval_s", "routing", 2.0, strict=True),
                       health_timeout_s=_number(m, "health_timeout_s", "routing", 10.0, strict=True),
                       stage_timeout_s=_number(m, "stage_timeout_s", "routing", 600.0, strict=True),
                       max_attempts=_int(m, "max_attempts", "routing", 3, 1))


def _slo(raw: Any) -> SLOSpec:
    m = _mapping(raw, "slo")
    _only(m, ("p95_latency_s", "max_queue"), "slo")
    return SLOSpec(p95_latency_s=_number(m, "p95_latency_s", "slo", None, strict=True),
                   max_queue=_int(m, "max_queue", "slo", 16, 1))


def parse_deployment(raw: Any, *, source: str = "deployment") -> DeploymentSpec:
    """A validated DeploymentSpec from the parsed YAML / JSON document (DeploymentError naming the field)."""
    if not isinstance(raw, Mapping):
        raise DeploymentError("", f"{source}: the document must be a mapping (version, model, roles, ...), got "
                              f"{type(raw).__name__}")
    _only(raw, ("version", "name", "model", "transport", "placement", "roles", "routing", "slo"), "")
    version = raw.get("version", SPEC_VERSION)
    if version != SPEC_VERSION:
        raise DeploymentError("version", f"this kit reads version {SPEC_VERSION}, got {version!r}")
    name = raw.get("name", "fleet")
    if not isinstance(name, str) or not name.strip():
        raise DeploymentError("name", f"must be a non-empty string, got {name!r}")
    roles_raw = raw.get("roles")
    if roles_raw is None:
        raise DeploymentError("roles", f"required: one pool per role ({', '.join(ROLES)})")
    roles_m = _mapping(roles_raw, "roles")
    _only(roles_m, ROLES, "roles")
    missing = [r for r in ROLES if r not in roles_m]
    if missing:
        raise DeploymentError(f"roles.{missing[0]}", "missing: every role needs a pool (replicas >= 1)")
    placement = _placement(raw.get("placement"))
    transport = _choice(raw, "transport", "", "shared_memory", TRANSPORTS)
    if transport == "ray_object_store" and placement.backend != "ray":
        raise DeploymentError("transport", "ray_object_store needs placement.backend: ray")
    return DeploymentSpec(name=name, model=_model(raw.get("model")), transport=transport, placement=placement,
                          roles=tuple(_role(r, roles_m[r]) for r in ROLES), routing=_routing(raw.get("routing")),
                          slo=_slo(raw.get("slo")), version=version)


def load_deployment(path: str | Path) -> DeploymentSpec:
    """Read and validate a deployment file (YAML; JSON also without PyYAML)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DeploymentError("", f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DeploymentError("", f"{p}: cannot be read ({e})") from None
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is not None:
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise DeploymentError("", f"{p}: not valid YAML{where} ({getattr(e, 'problem', None) or e})") from None
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise DeploymentError("", f"{p}: not JSON, and reading YAML needs PyYAML (pip install -e '.[fleet]'): "
                                  f"{e.msg} at line {e.lineno}") from None
    return parse_deployment(raw, source=str(p))


__all__ = [
    "BACKENDS",
    "ROLES",
    "STRATEGIES",
    "TRANSPORTS",
    "DeploymentError",
    "DeploymentSpec",
    "ModelSource",
    "PlacementSpec",
    "RolePoolSpec",
    "RoutingSpec",
    "SLOSpec",
    "load_deployment",
    "parse_deployment",
]
