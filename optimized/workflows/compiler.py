"""A validated ComfyUI workflow -> a typed `WorkflowProgram`: the one text-to-video generation its nodes describe,
the model files it names, and the outputs it writes. Nothing is loaded or run here.

What compiles (the Wan 2.1 / 2.2 text-to-video graph ComfyUI ships):
    UNETLoader -> [ModelSamplingSD3 shift] -> KSampler.model
    CLIPLoader(type wan) -> CLIPTextEncode x2 -> KSampler.positive / .negative
    EmptyHunyuanLatentVideo(width, height, length, batch_size 1) -> KSampler.latent_image          (2.1 t2v)
    Wan22ImageToVideoLatent(VAELoader, width, height, length, batch_size 1, no start_image)   (2.2 ti2v, text only)
    KSampler(seed, steps, cfg, sampler_name, scheduler simple, denoise 1.0) -> VAEDecode(VAELoader) -> IMAGE
    IMAGE -> SaveAnimatedWEBP / SaveWEBM / SaveImage / PreviewImage / CreateVideo -> SaveVideo / an unknown node

Mapped onto the project's request: seed -> seed, steps -> num_steps, cfg -> guidance_scale, shift -> flow_shift
(without ModelSamplingSD3: 8.0, ComfyUI's sampling shift for Wan 2.1 models), sampler_name uni_pc / uni_pc_bh2 ->
the UniPC flow solver (bh2, the pipelines' own), euler -> FlowMatch Euler; the latent's frames / size as ComfyUI makes
them. Anything else with no exact counterpart is refused naming the node and the input. Only the nodes an output
depends on are compiled (ComfyUI executes nothing else).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from optimized.workflows.graph import ExternalNode, Node, NodeError, Workflow, WorkflowError, validate

# KSampler sampler_name -> the project's solver. (ComfyUI's "uni_pc" is its bh1 variant and "uni_pc_bh2" its bh2;
# both run the project's UniPC, bh2 as in the diffusers pipelines: the parity statement is the project's request.)
SOLVERS = {"uni_pc": "unipc", "uni_pc_bh2": "unipc", "euler": "euler"}
SCHEDULERS = ("simple",)
CLIP_FAMILIES = {"wan": "wan"}       # CLIPLoader type -> family
DEFAULT_SHIFT = 8.0                  # (upstream) comfy supported_models WAN21_T2V sampling_settings shift
LATENT_TEMPORAL = 4   # (upstream) both latent nodes: (length - 1) // 4 + 1 latent frames
# (upstream) the latent node -> (its spatial compression, the wan task whose model denoises it)
LATENT_NODES = {"EmptyHunyuanLatentVideo": (8, "t2v"), "Wan22ImageToVideoLatent": (16, "ti2v")}
IMAGE_SINKS = ("SaveAnimatedWEBP", "SaveWEBM", "SaveImage", "PreviewImage")


@dataclass(frozen=True)
class ModelFile:
    node_id: str
    input_name: str                  # unet_name | clip_name | vae_name
    name: str


@dataclass(frozen=True)
class TextPrompt:
    node_id: str                     # the CLIPTextEncode node
    text: str


@dataclass(frozen=True)
class Sampling:
    node_id: str                     # the KSampler
    seed: int
    steps: int
    guidance_scale: float
    solver: str                      # "unipc" | "euler"
    flow_shift: float
    shift_node: str | None           # the ModelSamplingSD3 whose shift applies (None: the default)


@dataclass(frozen=True)
class LatentVideo:
    node_id: str                     # the EmptyHunyuanLatentVideo / Wan22ImageToVideoLatent
    class_type: str
    latent_frames: int
    latent_height: int
    latent_width: int
    spatial: int                     # pixels per latent side (8: the 2.1 VAE, 16: the 2.2 VAE)
    task: str                        # the wan task whose model denoises this latent (t2v | ti2v)

    @property
    def num_frames(self) -> int:     # the pixel frames the decoded latents hold
        return (self.latent_frames - 1) * LATENT_TEMPORAL + 1

    @property
    def height(self) -> int:
        return self.latent_height * self.spatial

    @property
    def width(self) -> int:
        return self.latent_width * self.spatial


@dataclass(frozen=True)
class Output:
    node_id: str
    class_type: str
    filename_prefix: str
    options: dict = field(default_factory=dict)   # the node's other widgets (fps, codec, ...), recorded beside it
    external: bool = False                        # an unknown node: its image input is written as the artifact


@dataclass(frozen=True)
class WorkflowProgram:
    workflow: Workflow
    family: str
    unet: ModelFile
    clip: ModelFile
    vae: ModelFile
    positive: TextPrompt
    negative: TextPrompt
    sampling: Sampling
    latent: LatentVideo
    decode_node: str
    outputs: tuple[Output, ...]
    skipped: tuple[str, ...] = ()                 # node ids no output depends on (not executed, as in ComfyUI)

    def request_fields(self) -> dict:
        """The generation as plain request fields (`serving.requests.build_request` / the processor's names)."""
        s, lat = self.sampling, self.latent
        return dict(prompt=self.positive.text, negative_prompt=self.negative.text, num_frames=lat.num_frames,
                    height=lat.height, width=lat.width, num_steps=s.steps, guidance_scale=s.guidance_scale,
                    seed=s.seed, solver=s.solver, flow_shift=s.flow_shift)


def widget_value(node: Node, name: str) -> Any:
    """A widget input's value (module-level: the parity check's negative controls plant faults here)."""
    return node.values[name]


class _Compiler:
    def __init__(self, wf: Workflow):
        self.wf = wf
        self.errors: list[NodeError] = []

    def fail(self, node: Node, input_name: str | None, message: str, kind: str = "value_not_supported") -> None:
        self.errors.append(NodeError(node.id, node.class_type, input_name, kind, message))

    def source(self, node: Node, input_name: str) -> Node:
        return self.wf.nodes[node.links[input_name].source]

    def expect(self, node: Node, input_name: str, *class_types: str) -> Node | None:
        """The node feeding `input_name`, when it is one of `class_types` (a NodeError otherwise)."""
        src = self.source(node, input_name)
        if src.class_type not in class_types:
            self.fail(node, input_name, f"comes from node {src.id} ({src.class_type}); this compiler takes "
                                        f"{' or '.join(class_types)} here", "unsupported_graph")
            return None
        return src

    def needed(self, outputs: list[Node]) -> set[str]:
        seen: set[str] = set()
        stack = [n.id for n in outputs]
        while stack:
            nid = stack.pop()
            if nid in seen or nid not in self.wf.nodes:
                continue
            seen.add(nid)
            stack.extend(l.source for l in self.wf.nodes[nid].links.values())
        return seen

    def model_chain(self, sampler: Node) -> tuple[Node | None, float, str | None]:
        """(UNETLoader, flow shift, the ModelSamplingSD3 that set it): the shift nearest the sampler applies (each
        ModelSamplingSD3 replaces the model's sampling)."""
        node, shift, shift_node = sampler, None, None
        name = "model"
        for _ in range(len(self.wf.nodes)):
            src = self.expect(node, name, "UNETLoader", "ModelSamplingSD3")
            if src is None:
                return None, DEFAULT_SHIFT, None
            if src.class_type == "UNETLoader":
                return src, DEFAULT_SHIFT if shift is None else shift, shift_node
            if shift is None:
                shift, shift_node = float(widget_value(src, "shift")), src.id
            node = src
        return None, DEFAULT_SHIFT, None

    def text(self, sampler: Node, input_name: str) -> tuple[TextPrompt | None, Node | None]:
        enc = self.expect(sampler, input_name, "CLIPTextEncode")
        if enc is None:
            return None, None
        loader = self.expect(enc, "clip", "CLIPLoader")
        return TextPrompt(enc.id, widget_value(enc, "text")), loader

    def compile(self) -> WorkflowProgram:
        wf = self.wf
        sinks = [n for n in wf.nodes.values() if (n.spec is not None and n.spec.output_node) or
                 (isinstance(n, ExternalNode) and not wf.consumers(n.id))]
        needed = self.needed(sinks)
        samplers = sorted(nid for nid in needed if wf.nodes[nid].class_type == "KSampler")
        decodes = sorted(nid for nid in needed if wf.nodes[nid].class_type == "VAEDecode")
        if len(samplers) != 1 or len(decodes) != 1:
            where = wf.nodes[(samplers or decodes or sorted(needed) or [""])[0]] if wf.nodes else None
            msg = (f"the outputs depend on {len(samplers)} KSampler and {len(decodes)} VAEDecode nodes; one "
                   f"text-to-video generation (one KSampler -> one VAEDecode) compiles")
            raise WorkflowError([NodeError(where.id if where else "", where.class_type if where else "", None,
                                           "unsupported_graph", msg)])
        sampler, decode = wf.nodes[samplers[0]], wf.nodes[decodes[0]]
        if self.source(decode, "samples") is not sampler:
            self.fail(decode, "samples", f"must come from the KSampler (node {sampler.id})", "unsupported_graph")

        unet, shift, shift_node = self.model_chain(sampler)
        positive, clip_a = self.text(sampler, "positive")
        negative, clip_b = self.text(sampler, "negative")
        latent = self.expect(sampler, "latent_image", *LATENT_NODES)
        vae = self.expect(decode, "vae", "VAELoader")
        if latent is not None and latent.class_type == "Wan22ImageToVideoLatent":
            if "start_image" in latent.links:
                self.fail(latent, "start_image", "image-conditioned generation is not compiled yet; leave it "
                                                 "unconnected (text-to-video on the ti2v model)")
            own = self.expect(latent, "vae", "VAELoader")
            if own is not None and vae is not None and widget_value(own, "vae_name") != widget_value(vae, "vae_name"):
                self.fail(latent, "vae", f"node {own.id}'s VAE is not the VAEDecode's (node {vae.id}); one model "
                                         f"directory's VAE does both")
            if shift_node is None:   # ComfyUI's own default shift for Wan 2.2 models is not restated here
                self.fail(sampler, "model", "a Wan 2.2 workflow needs a ModelSamplingSD3 node stating its shift")
        if clip_a is not None and clip_b is not None and clip_a is not clip_b and \
                widget_value(clip_a, "clip_name") != widget_value(clip_b, "clip_name"):
            self.fail(clip_b, "clip_name", f"the two prompts are encoded by different text encoders (node "
                                           f"{clip_a.id}'s and node {clip_b.id}'s); one model encodes both")
        family = None
        if unet is not None and widget_value(unet, "weight_dtype") != "default":
            self.fail(unet, "weight_dtype", f"{widget_value(unet, 'weight_dtype')!r}: fp8 weights have no exact "
                                            f"counterpart here; use 'default' (the engine's --dtype applies)")
        if clip_a is not None:
            family = CLIP_FAMILIES.get(widget_value(clip_a, "type"))
            if family is None:
                self.fail(clip_a, "type", f"{widget_value(clip_a, 'type')!r}: only {', '.join(CLIP_FAMILIES)} text "
                                          f"encoders map onto a family here")
        solver = SOLVERS.get(widget_value(sampler, "sampler_name"))
        if solver is None:
            self.fail(sampler, "sampler_name", f"{widget_value(sampler, 'sampler_name')!r} has no exact counterpart "
                                               f"here; use one of {', '.join(SOLVERS)}")
        if widget_value(sampler, "scheduler") not in SCHEDULERS:
            self.fail(sampler, "scheduler", f"{widget_value(sampler, 'scheduler')!r} has no exact counterpart here; "
                                            f"use {' or '.join(SCHEDULERS)} (the flow schedule the solvers shift)")
        if float(widget_value(sampler, "denoise")) != 1.0:
            self.fail(sampler, "denoise", f"{widget_value(sampler, 'denoise')!r}: partial denoising (img2img) has no "
                                          f"counterpart for an empty latent; use 1.0")
        latent_spec = None
        if latent is not None:
            if widget_value(latent, "batch_size") != 1:
                self.fail(latent, "batch_size", f"{widget_value(latent, 'batch_size')!r}: one video per workflow "
                                                f"run; use 1 (queue the workflow again for more)")
            spatial, task = LATENT_NODES[latent.class_type]
            latent_spec = LatentVideo(latent.id, latent.class_type,
                                      (int(widget_value(latent, "length")) - 1) // LATENT_TEMPORAL + 1,
                                      int(widget_value(latent, "height")) // spatial,
                                      int(widget_value(latent, "width")) // spatial, spatial, task)
        outputs = self.outputs(sinks, decode)
        if self.errors:
            raise WorkflowError(self.errors)
        assert unet is not None and clip_a is not None and vae is not None and latent_spec is not None
        sampling = Sampling(sampler.id, int(widget_value(sampler, "seed")), int(widget_value(sampler, "steps")),
                            float(widget_value(sampler, "cfg")), solver, float(shift), shift_node)
        return WorkflowProgram(
            wf, family, ModelFile(unet.id, "unet_name", widget_value(unet, "unet_name")),
            ModelFile(clip_a.id, "clip_name", widget_value(clip_a, "clip_name")),
            ModelFile(vae.id, "vae_name", widget_value(vae, "vae_name")), positive, negative, sampling, latent_spec,
            decode.id, outputs, tuple(sorted(set(wf.nodes) - needed)))

    def outputs(self, sinks: list[Node], decode: Node) -> tuple[Output, ...]:
        out = []
        for sink in sorted(sinks, key=lambda n: n.id):
            if isinstance(sink, ExternalNode):
                images = [name for name, l in sink.links.items() if l.source == decode.id]
                if images:
                    out.append(Output(sink.id, sink.class_type, f"{sink.class_type}_{sink.id}",
                                      {"input": images[0]}, external=True))
                continue
            if sink.class_type == "SaveVideo":
                video = self.expect(sink, "video", "CreateVideo")
                if video is None:
                    continue
                if "audio" in video.links:
                    self.fail(video, "audio", "the wan models make no sound; leave audio unconnected")
                if self.source(video, "images") is not decode:
                    self.fail(video, "images", f"must come from the VAEDecode (node {decode.id})", "unsupported_graph")
                options = {"fps": widget_value(video, "fps"), "format": widget_value(sink, "format"),
                           "codec": widget_value(sink, "codec")}
            else:
                if self.source(sink, "images") is not decode:
                    self.fail(sink, "images", f"must come from the VAEDecode (node {decode.id})", "unsupported_graph")
                options = {k: v for k, v in sink.values.items() if k not in ("images", "filename_prefix")}
            prefix = sink.values.get("filename_prefix", "ComfyUI") if sink.class_type != "PreviewImage" else \
                "ComfyUI_temp"
            out.append(Output(sink.id, sink.class_type, str(prefix), options))
        return tuple(out)


def compile_workflow(wf: Workflow) -> WorkflowProgram:
    """Validate (structure first) then compile; WorkflowError naming every offending node and input."""
    errors = validate(wf)
    if errors:
        raise WorkflowError(errors)
    return _Compiler(wf).compile()


__all__ = ["DEFAULT_SHIFT", "IMAGE_SINKS", "LATENT_NODES", "LATENT_TEMPORAL", "LatentVideo", "ModelFile", "Output", "SOLVERS", "Sampling",
           "TextPrompt", "WorkflowProgram", "compile_workflow", "widget_value"]
