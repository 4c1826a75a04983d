"""ComfyUI workflow JSON -> typed nodes and edges, validated before anything runs.

Two formats are read:
  * the API prompt format (what `POST /prompt` takes, and "Export (API)"): `{node_id: {"class_type", "inputs"}}`,
    where an input is a value or a link `[source_node_id, output_slot]`;
  * the UI export (litegraph): `{"nodes": [...], "links": [...]}`, a node's widget values in `widgets_values`
    (mapped onto inputs in the node's input order, with the UI-only `control_after_generate` after a seed), its
    linked inputs in `inputs[].link`, links as `[id, src, src_slot, dst, dst_slot, type]` (or the newer objects).
    Notes are dropped, reroutes followed, a primitive node's value copied into the input it feeds, muted nodes
    (mode 2) left out; bypassed nodes (mode 4) are refused (no exact counterpart).

A node whose class this compiler does not know becomes an `ExternalNode`: refused when it feeds a known node (the
model path), passed through otherwise (its image inputs are written as artifacts). Every problem is a `NodeError`
naming the node id, its class and the input; `WorkflowError` carries them all, with ComfyUI's `node_errors` shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimized.workflows.nodes import ANY, NODES, UI_ONLY_NODES, InputSpec, NodeSpec


@dataclass(frozen=True)
class Link:
    source: str                     # the node id the value comes from
    slot: int                       # its output slot
    type: str | None = None         # the type a UI export declares on the link (None in the API format)


@dataclass
class Node:
    id: str
    class_type: str
    values: dict[str, Any] = field(default_factory=dict)   # widget inputs by name
    links: dict[str, Link] = field(default_factory=dict)   # linked inputs by name
    title: str | None = None

    @property
    def spec(self) -> NodeSpec | None:
        return NODES.get(self.class_type)

    def output_type(self, slot: int) -> str | None:
        """The type of output `slot` (None: no such slot)."""
        outs = self.spec.outputs if self.spec is not None else ()
        return outs[slot] if 0 <= slot < len(outs) else None


@dataclass
class ExternalNode(Node):
    """A node this compiler does not know: never executed; passed through when nothing known depends on it."""
    declared_outputs: tuple[str, ...] = ()     # output types a UI export declares (empty in the API format)
    raw_widgets: Any = None

    def output_type(self, slot: int) -> str | None:
        if self.declared_outputs:
            return self.declared_outputs[slot] if 0 <= slot < len(self.declared_outputs) else None
        return ANY


@dataclass
class Workflow:
    nodes: dict[str, Node]
    source_format: str              # "api" | "ui"

    def consumers(self, node_id: str) -> list[tuple[str, str]]:
        """(consumer node id, input name) of every link out of `node_id`."""
        return [(n.id, name) for n in self.nodes.values() for name, l in n.links.items() if l.source == node_id]


@dataclass(frozen=True)
class NodeError:
    node_id: str
    class_type: str
    input_name: str | None
    kind: str                       # ComfyUI's error types: required_input_missing, value_not_in_list, ...
    message: str

    def text(self) -> str:
        if not self.node_id:   # about the whole workflow (unreadable, no outputs), not one node
            return self.message
        where = f"node {self.node_id} ({self.class_type})" + (f" input {self.input_name}" if self.input_name else "")
        return f"{where}: {self.message}"


class WorkflowError(ValueError):
    """An invalid or uncompilable workflow: one line per NodeError (each naming the node id and input)."""

    def __init__(self, errors: list[NodeError]):
        self.errors = list(errors)
        super().__init__("; ".join(e.text() for e in self.errors) or "invalid workflow")

    def node_errors(self) -> dict:
        """ComfyUI's `node_errors`: {node_id: {errors: [{type, message, details, extra_info}], dependent_outputs,
        class_type}} (errors not tied to a node go under the key "")."""
        out: dict[str, dict] = {}
        for e in self.errors:
            slot = out.setdefault(e.node_id, {"errors": [], "dependent_outputs": [], "class_type": e.class_type})
            slot["errors"].append({"type": e.kind, "message": e.message, "details": e.text(),
                                   "extra_info": {"input_name": e.input_name} if e.input_name else {}})
        return out


def _error(node: Node | None, input_name: str | None, kind: str, message: str) -> NodeError:
    return NodeError(node.id if node else "", node.class_type if node else "", input_name, kind, message)


# ------------------------------------------------------------------------------------------------------ parsing
def load_workflow(source: str | Path | dict) -> Workflow:
    """A workflow from a file, a JSON string or parsed JSON, in either format; WorkflowError if unreadable."""
    data = source
    if isinstance(source, Path) or (isinstance(source, str) and not source.lstrip().startswith("{")):
        try:
            data = json.loads(Path(source).read_text())
        except OSError as e:
            raise WorkflowError([NodeError("", "", None, "invalid_prompt", f"cannot read {source}: {e.strerror}")]) \
                from None
        except json.JSONDecodeError as e:
            raise WorkflowError([NodeError("", "", None, "invalid_prompt", f"{source} is not JSON ({e})")]) from None
    elif isinstance(source, str):
        try:
            data = json.loads(source)
        except json.JSONDecodeError as e:
            raise WorkflowError([NodeError("", "", None, "invalid_prompt", f"not JSON ({e})")]) from None
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict):   # a saved POST /prompt body
        data = data["prompt"]
    if isinstance(data, dict) and isinstance(data.get("nodes"), list):
        return parse_ui(data)
    if isinstance(data, dict) and data and all(isinstance(v, dict) and "class_type" in v for v in data.values()):
        return parse_api(data)
    raise WorkflowError([NodeError("", "", None, "invalid_prompt",
                                   "neither an API prompt ({id: {class_type, inputs}}) nor a UI export "
                                   "({nodes, links})")])


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int)) and \
        not isinstance(value[0], bool) and isinstance(value[1], int) and not isinstance(value[1], bool)


def parse_api(data: dict) -> Workflow:
    nodes: dict[str, Node] = {}
    errors: list[NodeError] = []
    for nid, raw in data.items():
        nid = str(nid)
        class_type, inputs = raw.get("class_type"), raw.get("inputs", {})
        if not isinstance(class_type, str) or not isinstance(inputs, dict):
            errors.append(NodeError(nid, str(class_type), None, "invalid_prompt",
                                    "a node needs a class_type string and an inputs object"))
            continue
        values = {k: v for k, v in inputs.items() if not _is_link(v)}
        links = {k: Link(str(v[0]), int(v[1])) for k, v in inputs.items() if _is_link(v)}
        title = (raw.get("_meta") or {}).get("title") if isinstance(raw.get("_meta"), dict) else None
        kind = Node if class_type in NODES else ExternalNode
        nodes[nid] = kind(nid, class_type, values, links, title)
    if errors:
        raise WorkflowError(errors)
    return Workflow(nodes, "api")


def _ui_links(data: dict) -> dict[int, tuple[str, int, str, int, str | None]]:
    """link id -> (source id, source slot, target id, target slot, type), from either link layout."""
    table = {}
    for l in data.get("links") or []:
        if isinstance(l, list) and len(l) >= 5:
            lid, src, sslot, dst, dslot = l[:5]
            ltype = l[5] if len(l) > 5 else None
        elif isinstance(l, dict):
            lid, src, sslot, dst, dslot, ltype = (l.get(k) for k in ("id", "origin_id", "origin_slot", "target_id",
                                                                       "target_slot", "type"))
        else:
            continue
        table[int(lid)] = (str(src), int(sslot), str(dst), int(dslot), ltype if isinstance(ltype, str) else None)
    return table


def _map_widgets(node: Node, spec: NodeSpec, widgets: Any, linked: set[str]) -> list[NodeError]:
    """widgets_values -> node.values by the node's widget order (a linked widget input keeps its slot)."""
    names = spec.widget_names()
    if widgets is None:
        widgets = []
    if isinstance(widgets, dict):
        node.values.update({k: v for k, v in widgets.items() if k in names and k != "control_after_generate"})
        return []
    if not isinstance(widgets, list):
        return [_error(node, None, "invalid_prompt", "widgets_values must be a list")]
    if len(widgets) > len(names):
        return [_error(node, None, "invalid_prompt",
                       f"widgets_values has {len(widgets)} values; {node.class_type} has {len(names)} widgets "
                       f"({', '.join(names)})")]
    for name, value in zip(names, widgets):
        if name != "control_after_generate" and name not in linked:
            node.values[name] = value
    missing = [n for n in names[len(widgets):] if n != "control_after_generate" and n not in linked
               and not (spec.input(n) and spec.input(n).optional)]
    return [_error(node, n, "required_input_missing", "no value in widgets_values") for n in missing]


def parse_ui(data: dict) -> Workflow:
    links = _ui_links(data)
    raw_nodes = {str(n.get("id")): n for n in data["nodes"] if isinstance(n, dict)}
    errors: list[NodeError] = []
    nodes: dict[str, Node] = {}

    def resolve(link_id: int, consumer: Node, name: str, hops: int = 0) -> Link | Any | None:
        """A link id -> the Link it means (reroutes followed), or the literal value of a primitive node."""
        if link_id not in links:
            errors.append(_error(consumer, name, "dangling_link", f"link {link_id} is not in the links table"))
            return None
        src, slot, _, _, ltype = links[link_id]
        raw = raw_nodes.get(src)
        if raw is not None and raw.get("type") == "Reroute" and hops < 64:
            upstream = next((i.get("link") for i in raw.get("inputs") or []), None)   # a reroute's one input
            if upstream is None:
                errors.append(_error(consumer, name, "dangling_link", f"reroute node {src} has no input"))
                return None
            return resolve(int(upstream), consumer, name, hops + 1)
        if raw is not None and raw.get("type") == "PrimitiveNode":
            vals = raw.get("widgets_values") or []
            return ("value", vals[0]) if vals else None
        return Link(src, slot, ltype)

    for nid, raw in raw_nodes.items():
        class_type, mode = str(raw.get("type")), raw.get("mode", 0)
        if class_type in UI_ONLY_NODES or mode == 2:     # notes / reroutes / primitives, and muted nodes
            continue
        spec = NODES.get(class_type)
        if spec is None:
            outs = tuple(str(o.get("type")) for o in raw.get("outputs") or [])
            node: Node = ExternalNode(nid, class_type, {}, {}, raw.get("title"), outs, raw.get("widgets_values"))
        else:
            node = Node(nid, class_type, {}, {}, raw.get("title"))
        if mode == 4:
            errors.append(_error(node, None, "bypassed_node", "bypassed nodes (mode 4) have no exact counterpart "
                                                              "here; delete it or wire around it"))
        linked: set[str] = set()
        for inp in raw.get("inputs") or []:
            name, lid = inp.get("name"), inp.get("link")
            if lid is None:
                continue
            got = resolve(int(lid), node, name)
            if isinstance(got, Link):
                node.links[name] = got
                linked.add(name)
            elif isinstance(got, tuple):
                node.values[name] = got[1]
                linked.add(name)
        if spec is not None:
            errors.extend(_map_widgets(node, spec, raw.get("widgets_values"), linked))
        nodes[nid] = node
    for nid, raw in raw_nodes.items():   # a consumer of a muted node: its input is dangling, say why
        if raw.get("mode", 0) == 2 and str(raw.get("type")) not in UI_ONLY_NODES:
            for n in nodes.values():
                for name, l in list(n.links.items()):
                    if l.source == nid:
                        errors.append(_error(n, name, "dangling_link", f"comes from node {nid}, which is muted"))
                        del n.links[name]
    if errors:
        raise WorkflowError(errors)
    return Workflow(nodes, "ui")


# ------------------------------------------------------------------------------------------------------ validation
def _check_value(node: Node, spec: InputSpec, value: Any) -> NodeError | None:
    t, name = spec.type, spec.name
    if t == "INT":
        if isinstance(value, bool) or not isinstance(value, int):
            return _error(node, name, "invalid_input_type", f"must be an integer, got {value!r}")
    elif t == "FLOAT":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _error(node, name, "invalid_input_type", f"must be a number, got {value!r}")
    elif t == "STRING":
        if not isinstance(value, str):
            return _error(node, name, "invalid_input_type", f"must be a string, got {value!r}")
    elif t == "BOOLEAN":
        if not isinstance(value, bool):
            return _error(node, name, "invalid_input_type", f"must be true or false, got {value!r}")
    elif t == "COMBO":
        if not isinstance(value, str):
            return _error(node, name, "invalid_input_type", f"must be one of the choices (a string), got {value!r}")
        if spec.choices is not None and value not in spec.choices:
            return _error(node, name, "value_not_in_list", f"{value!r} is not one of {', '.join(spec.choices)}")
    if t in ("INT", "FLOAT"):
        if spec.minimum is not None and value < spec.minimum:
            return _error(node, name, "value_smaller_than_min", f"{value!r} is below the minimum {spec.minimum:g}")
        if spec.maximum is not None and value > spec.maximum:
            return _error(node, name, "value_bigger_than_max", f"{value!r} is above the maximum {spec.maximum:g}")
    return None


def _cycle_nodes(wf: Workflow) -> list[str]:
    """Node ids on a dependency cycle (empty when the graph is a DAG)."""
    state: dict[str, int] = {}   # 1: on the stack, 2: done
    on_cycle: list[str] = []

    def visit(nid: str, stack: list[str]) -> None:
        state[nid] = 1
        stack.append(nid)
        for l in wf.nodes[nid].links.values():
            if l.source not in wf.nodes:
                continue
            if state.get(l.source) == 1:
                on_cycle.extend(x for x in stack[stack.index(l.source):] if x not in on_cycle)
            elif l.source not in state:
                visit(l.source, stack)
        stack.pop()
        state[nid] = 2

    for nid in sorted(wf.nodes):
        if nid not in state:
            visit(nid, [])
    return on_cycle


def model_path_externals(wf: Workflow) -> dict[str, tuple[str, str]]:
    """ExternalNodes that a known node depends on (directly or through other external nodes): id -> (the known
    consumer's id, its input)."""
    found: dict[str, tuple[str, str]] = {}
    frontier = [(n.id, name, l.source) for n in wf.nodes.values() if not isinstance(n, ExternalNode)
                for name, l in n.links.items()]
    while frontier:
        consumer, name, src = frontier.pop()
        node = wf.nodes.get(src)
        if isinstance(node, ExternalNode) and src not in found:
            found[src] = (consumer, name)
            frontier.extend((consumer, name, l.source) for l in node.links.values())
    return found


def validate(wf: Workflow) -> list[NodeError]:
    """Every structural problem, before anything runs: dangling links, wrong link types, missing inputs, values out
    of range or not in the list, cycles, unknown nodes on the model path, no output."""
    errors: list[NodeError] = []
    for node in wf.nodes.values():
        for name, link in node.links.items():
            src = wf.nodes.get(link.source)
            if src is None:
                errors.append(_error(node, name, "dangling_link", f"links node {link.source}, which is not in the "
                                                                  f"workflow"))
                continue
            got = src.output_type(link.slot)
            if got is None:
                errors.append(_error(node, name, "dangling_link", f"links output {link.slot} of node {src.id} "
                                                                  f"({src.class_type}), which has no such output"))
                continue
            want = node.spec.input(name).type if node.spec is not None and node.spec.input(name) else None
            for other in (got, link.type):
                if want is not None and other not in (None, ANY, "*") and other != want:
                    errors.append(_error(node, name, "return_type_mismatch",
                                         f"expects {want}, but node {src.id} ({src.class_type}) output "
                                         f"{link.slot} is {other}"))
                    break
        spec = node.spec
        if spec is None:
            continue
        for inp in spec.inputs:
            if inp.name in node.links:
                continue
            if inp.name not in node.values:
                if not inp.optional:
                    errors.append(_error(node, inp.name, "required_input_missing",
                                         f"required {inp.type} input missing"))
                continue
            if inp.is_link:
                errors.append(_error(node, inp.name, "bad_linked_input",
                                     f"must be a link to a {inp.type} output, got the value "
                                     f"{node.values[inp.name]!r}"))
                continue
            bad = _check_value(node, inp, node.values[inp.name])
            if bad is not None:
                errors.append(bad)
    for nid in _cycle_nodes(wf):
        node = wf.nodes[nid]
        errors.append(_error(node, None, "dependency_cycle", "is on a dependency cycle (a node cannot depend on "
                                                              "its own output)"))
    for nid, (consumer, name) in sorted(model_path_externals(wf).items()):
        node = wf.nodes[nid]
        errors.append(_error(node, None, "unknown_node_on_model_path",
                             f"unknown node type {node.class_type!r} feeds node {consumer} input {name} (the model "
                             f"path); only the nodes of /object_info compile there"))
    has_output = any((n.spec is not None and n.spec.output_node) or
                     (isinstance(n, ExternalNode) and not wf.consumers(n.id)) for n in wf.nodes.values())
    if wf.nodes and not has_output:
        errors.append(NodeError("", "", None, "prompt_no_outputs", "the workflow has no output node (SaveVideo, "
                                                                   "SaveAnimatedWEBP, SaveWEBM, SaveImage, ...)"))
    if not wf.nodes:
        errors.append(NodeError("", "", None, "invalid_prompt", "the workflow has no nodes"))
    return errors


def parse_and_validate(source: str | Path | dict) -> Workflow:
    wf = load_workflow(source)
    errors = validate(wf)
    if errors:
        raise WorkflowError(errors)
    return wf


__all__ = ["ExternalNode", "Link", "Node", "NodeError", "Workflow", "WorkflowError", "load_workflow",
           "model_path_externals", "parse_and_validate", "parse_api", "parse_ui", "validate"]
