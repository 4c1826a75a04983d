"""ComfyUI-compatible endpoints on the engine's server, so ComfyUI API clients can drive it. Installed by
`install_comfy_routes` (one line in server.py's `create_app`); every route also answers under /api/.

    POST /prompt            {"prompt": {id: {class_type, inputs}}, "client_id"?, "extra_data"?} (an API prompt; a UI
                            export is accepted too) -> {"prompt_id", "number", "node_errors": {}}; an invalid or
                            uncompilable workflow -> 400 {"error": {type, message, details, extra_info},
                            "node_errors": {id: {errors: [{type, message, details, extra_info: {input_name}}],
                            dependent_outputs, class_type}}}, refused before anything runs
    GET  /history[/{id}]    {id: {prompt: [number, id, prompt, extra_data, outputs], outputs: {node_id: {images:
                            [{filename, subfolder, type: "output"}]}}, status: {status_str, completed, messages}}};
                            {} for an id that is unknown or not finished (as ComfyUI)
    GET  /queue             {"queue_running": [...], "queue_pending": [...]} (entries as in history's "prompt")
    POST /queue             {"clear": true} | {"delete": [ids]}: cancel pending prompts
    POST /interrupt         cancel the running prompt(s) (at the next step boundary); {"prompt_id"} for one
    GET  /object_info[/{c}] the supported nodes with their inputs, input_order and outputs
    GET  /view?filename=&subfolder=&type=output   an output file

The served engine's model is the one a workflow's loaders must name (its directory's name or its variant). Outputs
are written under OUTPUT_DIR/comfy/<prompt_id>/ (runner.write_outputs). Not served: the /ws progress socket, uploads
(/upload/image), /system_stats. With an API key set, these routes need it as /v1/ does.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from optimized.workflows import WorkflowCache, WorkflowError, bind, check_served_model, compile_workflow, \
    load_workflow
from optimized.workflows.nodes import NODES, object_info
from optimized.workflows.runner import write_outputs

MAX_HISTORY = 1000


@dataclass
class PromptEntry:
    prompt_id: str
    number: int
    prompt: dict
    extra_data: dict
    program: Any
    handle: Any = None
    status: str = "pending"                     # pending | running | success | error | cancelled
    outputs: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)

    def queue_item(self) -> list:
        return [self.number, self.prompt_id, self.prompt, self.extra_data, [o.node_id for o in self.program.outputs]]


def _error(status: int, message: str, kind: str = "invalid_prompt", node_errors: dict | None = None,
           details: str = "") -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message, "details": details, "extra_info": {}},
                         "node_errors": node_errors or {}}, status_code=status)


def install_comfy_routes(app: FastAPI, engine: Any, state: dict, output_dir: str | Path,
                         api_key: str | None = None) -> None:
    """Add the ComfyUI routes to `app`. `state["engine"]` is the server's AsyncEngine (made at startup),
    `state["closing"]` says the server is shutting down."""
    root = Path(output_dir) / "comfy"
    root.mkdir(parents=True, exist_ok=True)
    prompts: OrderedDict[str, PromptEntry] = OrderedDict()
    cache = WorkflowCache()
    counter = {"number": 0}
    tasks: set = set()

    def authorised(request: Request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode("utf-8"))

    def denied() -> JSONResponse:
        return JSONResponse({"error": {"type": "unauthorized", "message": "missing or wrong API key",
                                       "details": "", "extra_info": {}}}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})

    def route(method: str, path: str):
        def wrap(fn):
            async def guarded(request: Request):
                if not authorised(request):
                    return denied()
                return await fn(request, **request.path_params)
            guarded.__name__ = f"comfy_{fn.__name__}"
            for prefix in ("", "/api"):
                app.add_api_route(prefix + path, guarded, methods=[method], include_in_schema=prefix == "")
            return fn
        return wrap

    def compile_body(body: Any) -> tuple[Any, dict, dict]:
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), dict):
            raise WorkflowError([])
        program = compile_workflow(load_workflow(body["prompt"]))
        check_served_model(program, engine)
        extra = body.get("extra_data") if isinstance(body.get("extra_data"), dict) else {}
        return program, body["prompt"], extra

    async def finish(entry: PromptEntry) -> None:
        h = entry.handle
        status = await h.wait()
        if status == "completed":
            entry.status = "running"
            try:
                result = await h.result()
                written = await asyncio.to_thread(write_outputs, entry.program, result, root / entry.prompt_id)
                for nid, w in written.items():
                    folder = root / entry.prompt_id / w["dir"]
                    entry.outputs[nid] = {"images": [{"filename": p.name, "subfolder": f"{entry.prompt_id}/{w['dir']}",
                                                      "type": "output"} for p in sorted(folder.glob("*.png"))]}
                entry.status = "success"
                entry.messages.append(["execution_success", {"prompt_id": entry.prompt_id,
                                                             "timestamp": int(time.time() * 1000)}])
            except Exception as e:  # noqa: BLE001 - a failed write fails this prompt only
                entry.status = "error"
                entry.messages.append(["execution_error", {"prompt_id": entry.prompt_id,
                                                           "exception_message": f"writing outputs: {e}"}])
        else:
            entry.status = "cancelled" if status == "cancelled" else "error"
            err = next((ev.data.get("error") for ev in reversed(h.history) if ev.data.get("error")), None)
            kind = "execution_interrupted" if status == "cancelled" else "execution_error"
            entry.messages.append([kind, {"prompt_id": entry.prompt_id, "exception_message": err or status}])
            state["engine"].release(entry.prompt_id)
        while len(prompts) > MAX_HISTORY:
            prompts.popitem(last=False)

    @route("POST", "/prompt")
    async def post_prompt(request: Request):
        if state.get("closing"):
            return _error(503, "the server is shutting down", "server_shutting_down")
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - a malformed body is the client's
            return _error(400, "body must be JSON", "invalid_prompt")
        try:
            program, prompt, extra = compile_body(body)
            bound = bind(program, engine, cache)
        except WorkflowError as e:
            if not e.errors:
                return _error(400, "body must be {\"prompt\": {node_id: {class_type, inputs}}}", "invalid_prompt")
            nodeless = [x for x in e.errors if not x.node_id]
            if nodeless and len(nodeless) == len(e.errors):
                return _error(400, nodeless[0].message, nodeless[0].kind, details=str(e))
            return _error(400, "Prompt outputs failed validation", "prompt_outputs_failed_validation",
                          e.node_errors(), str(e))
        from optimized.serving.async_engine import EngineClosed, QueueFull
        prompt_id = str(uuid.uuid4())
        try:
            handle = await state["engine"].submit(bound.request, request_id=prompt_id)
        except QueueFull as e:
            return _error(429, str(e), "queue_full")
        except EngineClosed as e:
            return _error(503, str(e), "server_shutting_down")
        except ValueError as e:   # the engine's admission (RequestRejected): nothing was queued
            return _error(400, str(e), "prompt_rejected")
        counter["number"] += 1
        entry = PromptEntry(prompt_id, counter["number"], prompt, extra, program, handle)
        entry.messages.append(["execution_start", {"prompt_id": prompt_id, "timestamp": int(time.time() * 1000)}])
        entry.messages.append(["execution_cached", {"prompt_id": prompt_id,
                                                    "nodes": sorted(k for k, hit in bound.cache_hits.items() if hit)}])
        prompts[prompt_id] = entry
        task = asyncio.ensure_future(finish(entry))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return {"prompt_id": prompt_id, "number": entry.number, "node_errors": {}}

    def history_item(e: PromptEntry) -> dict:
        return {"prompt": e.queue_item(), "outputs": e.outputs,
                "status": {"status_str": "success" if e.status == "success" else "error",
                           "completed": e.status == "success", "messages": e.messages}}

    def finished(e: PromptEntry) -> bool:
        return e.status in ("success", "error", "cancelled")

    @route("GET", "/history")
    async def history(request: Request):
        items = [e for e in prompts.values() if finished(e)]
        limit = request.query_params.get("max_items")
        if limit is not None and limit.isdigit():
            items = items[-int(limit):] if int(limit) else []
        return {e.prompt_id: history_item(e) for e in items}

    @route("GET", "/history/{prompt_id}")
    async def history_one(request: Request, prompt_id: str):
        e = prompts.get(prompt_id)
        return {prompt_id: history_item(e)} if e is not None and finished(e) else {}

    @route("GET", "/queue")
    async def queue(request: Request):
        live = [e for e in prompts.values() if not finished(e)]
        waiting = [e for e in live if e.handle.status == "waiting"]
        return {"queue_running": [e.queue_item() for e in live if e not in waiting],
                "queue_pending": [e.queue_item() for e in waiting]}

    @route("POST", "/queue")
    async def queue_edit(request: Request):
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001
            body = {}
        doomed = [e for e in prompts.values() if not finished(e) and e.handle.status == "waiting"]
        if not (isinstance(body, dict) and body.get("clear")):
            ids = set(body.get("delete") or []) if isinstance(body, dict) else set()
            doomed = [e for e in doomed if e.prompt_id in ids]
        for e in doomed:
            await e.handle.cancel()
        return {"deleted": [e.prompt_id for e in doomed]}

    @route("POST", "/interrupt")
    async def interrupt(request: Request):
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - ComfyUI clients post an empty body
            body = {}
        only = body.get("prompt_id") if isinstance(body, dict) else None
        running = [e for e in prompts.values() if not finished(e) and e.handle.status != "waiting"
                   and (only is None or e.prompt_id == only)]
        for e in running:
            await e.handle.cancel()
        return {"interrupted": [e.prompt_id for e in running]}

    @route("GET", "/object_info")
    async def all_object_info(request: Request):
        return {name: object_info(spec) for name, spec in NODES.items()}

    @route("GET", "/object_info/{node_class}")
    async def one_object_info(request: Request, node_class: str):
        spec = NODES.get(node_class)
        return {node_class: object_info(spec)} if spec is not None else {}

    @route("GET", "/view")
    async def view(request: Request):
        q = request.query_params
        name, sub = q.get("filename", ""), q.get("subfolder", "")
        if q.get("type", "output") != "output":
            return _error(404, "only output files are served", "not_found")
        target = (root / sub / name).resolve()
        if root.resolve() not in target.parents or not target.is_file():
            return _error(404, f"no output file {name[:80]!r}", "not_found")
        return FileResponse(target, media_type="image/png" if target.suffix == ".png" else "application/json")


__all__ = ["install_comfy_routes"]
