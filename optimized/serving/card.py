"""DeploymentCard: what one engine instance serves, exported as JSON (`engine.deployment_card()`, `fvgen card`,
HTTP `GET /v1/models`). Read from the engine and its family entry; nothing is measured or loaded to build it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

CARD_VERSION = 1


@dataclass(frozen=True)
class DeploymentCard:
    family: str
    variant: str                          # the variant name, or "custom" when the config matches none
    weights_version: str | None
    media_weights_version: str | None     # the VAE's, when it is not part of the model's weights (None: the model's)
    capabilities: dict                    # modalities, CFG policies, size limits
    loops: list[str]
    request_types: list[str]
    programs: list[str]                   # the family's programs + "video" when a media chain is available
    dtypes: dict                          # component -> dtype
    device: str
    buckets_captured: list                # compiled / captured step bodies so far: {mode, bucket, batch_size, ...}
    parallel_plan: dict                   # axes and degrees ({} = single device)
    memory: dict                          # budget, reserved, peak (bytes), parameter bytes
    card_version: int = CARD_VERSION
    extra: dict = field(default_factory=dict)
    # served accelerations (optimized.serving.requests.serve_accel): label, exact, default, certificate path,
    # passed, budget, reasons; [] when the engine serves only the exact path
    accelerations: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _variant(engine: Any) -> str:
    name = engine.__dict__.get("variant")
    if name:
        return name
    cfg = getattr(engine.model, "cfg", None)
    for v in engine.family.list_variants():
        try:
            if engine.family.load_variant(v) == cfg:
                return v
        except Exception:  # noqa: BLE001 - a variant that does not load is simply not this one
            continue
    return "custom"


def _param_bytes(obj: Any, seen: set | None = None, depth: int = 0) -> int:
    """Bytes of the tensors an instance holds (attributes, dicts, lists, nn.Modules), each storage counted once."""
    seen = set() if seen is None else seen
    if depth > 6:
        return 0
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.device.type)
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, torch.nn.Module):
        return sum(_param_bytes(t, seen, depth + 1) for t in list(obj.parameters()) + list(obj.buffers()))
    if isinstance(obj, dict):
        return sum(_param_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_param_bytes(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.startswith("optimized"):
        return sum(_param_bytes(v, seen, depth + 1) for k, v in vars(obj).items() if k not in ("cache", "und_cache"))
    return 0


def _dtypes(model: Any) -> dict:
    out = {"model": str(getattr(model, "dtype", "unknown")).replace("torch.", "")}
    for name in ("vae", "text_encoder", "dit", "dit_2"):
        part = getattr(model, name, None)
        if part is not None and getattr(part, "dtype", None) is not None:
            out[name] = str(part.dtype).replace("torch.", "")
    if hasattr(model, "vae_dtype"):
        out["vae"] = str(model.vae_dtype).replace("torch.", "")
    return out


def _parallel(engine: Any) -> dict:
    group = engine.options.group
    if group is None:
        return {}
    size = getattr(group, "world_size", None) or getattr(group, "size", None)
    return {"group": type(group).__name__, "world_size": size() if callable(size) else size}


def _graph_buckets(model: Any) -> list[dict]:
    """The compiled (`compile`) or captured (`cuda`) step bodies held by the model's CompileCaches (the model's own
    and its parts', e.g. each wan expert's), one entry per GraphKey; eager runners are not listed."""
    from optimized.runtime.compile import CompileCache

    owners = [model] + [v for v in vars(model).values() if hasattr(v, "graph_cache")]
    caches = {id(c): c for o in owners if isinstance(c := getattr(o, "graph_cache", None), CompileCache)}
    return sorted(({"mode": k.mode, "bucket": k.bucket, "batch_size": k.batch_size, "attention": k.attention,
                    "dtype": k.dtype, "parallel_plan": k.parallel_plan_hash}
                   for c in caches.values() for k in c.keys() if k.mode != "eager"),
                  key=lambda d: (d["mode"], d["bucket"], d["batch_size"]))


def _weights_memory(engine: Any) -> dict:
    """Where the weights are (the memory plane, optimized/runtime/memory.py): offload mode, device / host bytes."""
    plane = getattr(engine, "memory", None)
    if plane is None or not hasattr(plane, "summary"):
        return {}
    s = plane.summary()
    return {"offload": s["offload"], "offload_budget_bytes": s["offload_budget_bytes"],
            "weights_device_bytes": s["weights_device_bytes"], "weights_host_bytes": s["weights_host_bytes"],
            "asleep": plane.asleep(), "unloaded": plane.unloaded()}


def deployment_card(engine: Any) -> DeploymentCard:
    entry, caps = engine.family, engine.family.capabilities
    capabilities = {"modalities": list(caps.modalities), "cfg_policies": list(caps.cfg_policies)}
    for name in ("max_frames", "max_height", "max_width", "max_tokens"):
        if hasattr(caps, name):
            capabilities[name] = getattr(caps, name)
    media_version, video = None, False
    try:
        from optimized.serving.families import media_chain
        media_version, video = media_chain(engine).weights_version, True
    except Exception:  # noqa: BLE001 - no media chain: the card says the engine serves no video program
        pass
    sched = engine.scheduler
    return DeploymentCard(
        family=entry.name, variant=_variant(engine),
        weights_version=getattr(engine.model, "weights_version", None), media_weights_version=media_version,
        capabilities=capabilities, loops=sorted(entry.loops),
        request_types=sorted(t.__name__ for t in entry.request_types),
        programs=sorted(entry.programs) + (["video"] if video else []),
        dtypes=_dtypes(engine.model), device=str(getattr(engine.model, "device", "cpu")),
        buckets_captured=_graph_buckets(engine.model), parallel_plan=_parallel(engine),
        memory={"budget_bytes": sched.memory_budget_bytes, "reserved_bytes": sched.reserved_bytes,
                "peak_bytes": sched.peak_bytes, "parameter_bytes": _param_bytes(engine.model),
                **_weights_memory(engine)},
        extra={"cfg_policy": engine.options.cfg_policy, "max_batch": sched.max_batch},
        accelerations=_accelerations(engine))


def _accelerations(engine: Any) -> list:
    table = engine.__dict__.get("served_accels")
    if not table:
        return []
    return [{"label": label, "default": label == table["default"], **entry}
            for label, entry in sorted(table["served"].items())]
