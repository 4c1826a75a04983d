"""LoRA in serving: `fvgen --lora FILE[:scale]` (repeatable), the HTTP request field `lora` and the `/v1/loras`
endpoints (SGLang-like), all on the engine's adapter manager (`engine.loras`, optimized/adapters):

    GET    /v1/loras                    {"object": "list", "data": [{name, version, ranks, merged, ...}]}
    POST   /v1/loras                    multipart: name + file (a LoRA .safetensors in any format fvconvert lora reads)
    DELETE /v1/loras/{name}             unload (409 while a request in flight uses it, or while it is merged)
    POST   /v1/loras/{name}/merge       {"scale": s}: fused into the weights, a new weights version
    POST   /v1/loras/unmerge            back to the base weights and version

A request's `lora` is a name, {"name", "scale"}, or a list of them (multipart: the same as a JSON string); requests
with different adapters, or none, batch in one step. Loading and merging run on the engine's driver thread (between
scheduler ticks), never beside a running step."""


import dataclasses  # (no `from __future__ import annotations`: FastAPI reads the routes' annotations at run time)
from pathlib import Path
import json
from typing import Any

from manifests.lora import LoraRef, parse_lora_field, parse_lora_spec

MAX_LORA_BYTES = 1 << 30   # an upload larger than this is refused (413) before it is read whole


def apply_cli_loras(engine: Any, request: Any, specs: list[str] | None) -> Any:
    """Load each `FILE[:scale]` into the engine (named after the file) and return the request using them; a bad
    file or spec raises ValueError (fvgen: exit 2, nothing ran)."""
    if not specs:
        return request
    if not any(f.name == "lora" for f in dataclasses.fields(request)):
        raise ValueError(f"--lora: {engine.family.name} requests take no LoRA adapters")
    refs = []
    for spec in specs:
        path, scale = parse_lora_spec(spec)
        adapter = engine.loras.load(_name(path, [r.name for r in refs]), path)
        refs.append(LoraRef(adapter.name, scale).validate())
    return dataclasses.replace(request, lora=tuple(refs))


def _name(path: str, taken: list[str]) -> str:
    base = "".join(c if c.isalnum() or c in "._-" else "-" for c in Path(path).stem)[:60].lstrip("._-") or "lora"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    return name


def resolve_lora_field(engine: Any, value: Any) -> dict:
    """The request field `lora` -> submit keywords {"lora": refs}, checked against the loaded adapters (BadField
    naming `lora` otherwise)."""
    import json

    from manifests import ManifestError
    from optimized.adapters import AdapterError
    from optimized.serving.videos_api import BadField

    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):   # multipart / form: the JSON form as a string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadField("lora", f"lora: not valid JSON ({e.msg})") from None
    try:
        refs = parse_lora_field(value)   # a family whose requests take no lora: build_request refuses it
        return {"lora": engine.loras.check_refs(refs)} if refs else {}
    except (AdapterError, ManifestError) as e:
        raise BadField("lora", str(e), code="lora_not_found" if "not loaded" in str(e) else None) from None


def install_lora_routes(app: Any, engine: Any, state: dict, upload_dir: Path) -> None:
    """The `/v1/loras` routes and the `lora` field's resolver for this app's engine (`state["engine"]` is its
    AsyncEngine once the app has started)."""
    import tempfile

    from fastapi import Request

    from manifests import ManifestError
    from optimized.adapters import AdapterError
    from optimized.serving.videos_api import BadField, set_lora_resolver

    set_lora_resolver(lambda value: resolve_lora_field(engine, value))

    async def on_driver(fn):
        try:
            return await state["engine"]._call(fn)
        except (AdapterError, ManifestError) as e:
            status = 409 if "in flight" in str(e) or "merged" in str(e) else \
                404 if "no LoRA named" in str(e) else 400
            raise BadField("name" if status == 404 else None, str(e), status) from None

    @app.get("/v1/loras")
    async def list_loras():
        return {"object": "list", "data": await state["engine"]._call(engine.loras.list)}

    @app.post("/v1/loras")
    async def load_lora(request: Request):
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise BadField(None, "POST /v1/loras takes multipart/form-data: name + file")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_LORA_BYTES + (1 << 20):
            raise BadField("file", f"a LoRA file larger than {MAX_LORA_BYTES} bytes", 413)
        form = await request.form()
        name, upload = form.get("name"), form.get("file")
        if not isinstance(name, str) or not name:
            raise BadField("name", "name is required")
        if upload is None or not hasattr(upload, "read"):
            raise BadField("file", "file (the LoRA .safetensors) is required")
        upload_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=upload_dir, suffix=".safetensors", delete=False) as f:
            path = Path(f.name)
            f.write(await upload.read(MAX_LORA_BYTES + 1))
        try:
            if path.stat().st_size > MAX_LORA_BYTES:
                raise BadField("file", f"a LoRA file larger than {MAX_LORA_BYTES} bytes", 413)
            adapter = await on_driver(lambda: engine.loras.load(name, path))
        finally:
            path.unlink(missing_ok=True)   # the adapter is in memory; nothing of the upload stays on disk
        return next(a for a in await state["engine"]._call(engine.loras.list) if a["name"] == adapter.name)

    @app.delete("/v1/loras/{name}")
    async def unload_lora(name: str):
        await on_driver(lambda: engine.loras.unload(name))
        return {"name": name, "object": "lora.deleted", "deleted": True}

    @app.post("/v1/loras/unmerge")
    async def unmerge_lora():
        version = await on_driver(engine.loras.unmerge)
        return {"object": "weights", "weights_version": version}

    @app.post("/v1/loras/{name}/merge")
    async def merge_lora(name: str, request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise BadField(None, "the body must be a JSON object: {\"scale\": s}") from None
        scale = body.get("scale", 1.0) if isinstance(body, dict) else None
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise BadField("scale", "scale must be a number")
        version = await on_driver(lambda: engine.loras.merge(name, float(scale)))
        return {"object": "weights", "weights_version": version, "merged": name, "scale": float(scale)}
