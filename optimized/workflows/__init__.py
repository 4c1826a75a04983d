"""The Workflow Plane: ComfyUI workflow JSON compiled to a typed program and run by the normal runtime (designv2
"Workflow Plane"; never a dynamic node executor).

    from optimized.workflows import compile_file, resolve_model_dir, bind
    program = compile_file("examples/workflows/wan_t2v_tiny_api.json")     # parse -> validate -> compile
    engine = Engine.from_checkpoint(resolve_model_dir(program, "models/"))
    result = engine.generate_video(bind(program, engine).request)

graph.py parses both formats into typed nodes / edges and validates them; nodes.py is the node catalogue (input
order, types, choices); compiler.py maps the node subset onto a WorkflowProgram; cache.py keys nodes by signature +
ancestry; runner.py resolves model files, binds to an engine and writes outputs; cli.py is `fvgen workflow`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optimized.workflows.cache import WorkflowCache, node_keys
from optimized.workflows.compiler import WorkflowProgram, compile_workflow
from optimized.workflows.graph import ExternalNode, Link, Node, NodeError, Workflow, WorkflowError, load_workflow
from optimized.workflows.runner import bind, check_served_model, resolve_model_dir, write_outputs


def compile_file(source: str | Path | dict[str, Any]) -> WorkflowProgram:
    """A workflow file / JSON string / parsed JSON (API or UI format) -> its WorkflowProgram (WorkflowError)."""
    return compile_workflow(load_workflow(source))


compile = compile_file   # designv2: `fastvideo.workflow.compile("workflow.json")`

__all__ = ["ExternalNode", "Link", "Node", "NodeError", "Workflow", "WorkflowCache", "WorkflowError",
           "WorkflowProgram", "bind", "check_served_model", "compile", "compile_file", "compile_workflow",
           "load_workflow", "node_keys", "resolve_model_dir", "write_outputs"]
