"""The ComfyUI nodes this compiler knows: each node's inputs in ComfyUI's own order (required, then optional), their
types, defaults and choices, its outputs, and its role in the compiled program.

Facts are ComfyUI's (nodes.py, comfy_extras/nodes_model_advanced.py, nodes_hunyuan.py, nodes_video.py, nodes_webm.py,
comfy/sampler_names.py), restated as data here: the input order decides how a UI export's `widgets_values` map onto
inputs, and `/object_info` serves it to clients. Link types (MODEL, CLIP, VAE, CONDITIONING, LATENT, IMAGE, VIDEO,
AUDIO) travel on edges; widget types (INT, FLOAT, STRING, BOOLEAN, COMBO) are values on the node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LINK_TYPES = frozenset({"MODEL", "CLIP", "VAE", "CONDITIONING", "LATENT", "IMAGE", "VIDEO", "AUDIO"})
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
ANY = "*"   # a link whose type is not known (an ExternalNode's output in the API format)

# comfy/sampler_names.py SAMPLER_NAMES and SCHEDULER_NAMES (the choices a KSampler offers)
SAMPLER_NAMES = ("euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "dpm_2",
                 "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral",
                 "dpmpp_2s_ancestral_cfg_pp", "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp",
                 "dpmpp_2m_sde", "dpmpp_2m_sde_gpu", "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde",
                 "dpmpp_3m_sde_gpu", "ddpm", "lcm", "ipndm", "ipndm_v", "deis", "res_multistep",
                 "res_multistep_cfg_pp", "res_multistep_ancestral", "res_multistep_ancestral_cfg_pp",
                 "gradient_estimation", "gradient_estimation_cfg_pp", "er_sde", "seeds_2", "seeds_3", "sa_solver",
                 "sa_solver_pece", "ddim", "uni_pc", "uni_pc_bh2")
SCHEDULER_NAMES = ("normal", "karras", "exponential", "sgm_uniform", "simple", "ddim_uniform", "beta",
                   "linear_quadratic", "kl_optimal")
CLIP_TYPES = ("stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos",
              "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image")
SEED_CONTROL = ("fixed", "increment", "decrement", "randomize")   # the UI's control_after_generate choices


@dataclass(frozen=True)
class InputSpec:
    name: str
    type: str                                   # a link type, or a widget type
    default: Any = None
    choices: tuple[str, ...] | None = None      # COMBO choices; None: any string (file lists: resolved later)
    minimum: float | None = None
    maximum: float | None = None
    optional: bool = False
    control_after_generate: bool = False        # the UI adds a control_after_generate widget right after this one

    @property
    def is_link(self) -> bool:
        return self.type in LINK_TYPES

    def options(self) -> dict:
        """The options dict of `/object_info` (default, min, max, control_after_generate)."""
        opts = {k: v for k, v in (("default", self.default), ("min", self.minimum), ("max", self.maximum))
                if v is not None}
        if self.control_after_generate:
            opts["control_after_generate"] = True
        return opts


@dataclass(frozen=True)
class NodeSpec:
    class_type: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    role: str                                   # loader | model | text | latent | sampler | decode | video | output
    category: str
    display_name: str
    output_names: tuple[str, ...] = ()
    output_node: bool = False
    notes: tuple[str, ...] = field(default=())

    def input(self, name: str) -> InputSpec | None:
        return next((i for i in self.inputs if i.name == name), None)

    def widget_names(self) -> list[str]:
        """widgets_values slots of a UI export, in order: every widget input, plus the UI-only
        control_after_generate after the inputs that have one (its value is the UI's, never the program's)."""
        names: list[str] = []
        for i in self.inputs:
            if not i.is_link:
                names.append(i.name)
                if i.control_after_generate:
                    names.append("control_after_generate")
        return names


def _i(name: str, type_: str, default: Any = None, **kw: Any) -> InputSpec:
    return InputSpec(name, type_, default, **kw)


SEED_MAX = 0xFFFFFFFFFFFFFFFF
NODES: dict[str, NodeSpec] = {n.class_type: n for n in (
    NodeSpec("UNETLoader", (_i("unet_name", "COMBO"),
                            _i("weight_dtype", "COMBO", "default",
                               choices=("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"))),
             ("MODEL",), "loader", "advanced/loaders", "Load Diffusion Model"),
    NodeSpec("CLIPLoader", (_i("clip_name", "COMBO"), _i("type", "COMBO", "stable_diffusion", choices=CLIP_TYPES),
                            _i("device", "COMBO", "default", choices=("default", "cpu"), optional=True)),
             ("CLIP",), "loader", "advanced/loaders", "Load CLIP"),
    NodeSpec("VAELoader", (_i("vae_name", "COMBO"),), ("VAE",), "loader", "loaders", "Load VAE"),
    NodeSpec("CLIPTextEncode", (_i("text", "STRING", ""), _i("clip", "CLIP")), ("CONDITIONING",), "text",
             "conditioning", "CLIP Text Encode (Prompt)"),
    NodeSpec("ModelSamplingSD3", (_i("model", "MODEL"), _i("shift", "FLOAT", 3.0, minimum=0.0, maximum=100.0)),
             ("MODEL",), "model", "advanced/model", "ModelSamplingSD3"),
    NodeSpec("EmptyHunyuanLatentVideo", (_i("width", "INT", 848, minimum=16, maximum=16384),
                                         _i("height", "INT", 480, minimum=16, maximum=16384),
                                         _i("length", "INT", 25, minimum=1, maximum=16384),
                                         _i("batch_size", "INT", 1, minimum=1, maximum=4096)),
             ("LATENT",), "latent", "latent/video", "EmptyHunyuanLatentVideo"),
    NodeSpec("Wan22ImageToVideoLatent", (_i("vae", "VAE"), _i("width", "INT", 1280, minimum=32, maximum=16384),
                                         _i("height", "INT", 704, minimum=32, maximum=16384),
                                         _i("length", "INT", 49, minimum=1, maximum=16384),
                                         _i("batch_size", "INT", 1, minimum=1, maximum=4096),
                                         _i("start_image", "IMAGE", optional=True)),
             ("LATENT",), "latent", "conditioning/inpaint", "Wan22ImageToVideoLatent"),
    NodeSpec("KSampler", (_i("model", "MODEL"),
                          _i("seed", "INT", 0, minimum=0, maximum=SEED_MAX, control_after_generate=True),
                          _i("steps", "INT", 20, minimum=1, maximum=10000),
                          _i("cfg", "FLOAT", 8.0, minimum=0.0, maximum=100.0),
                          _i("sampler_name", "COMBO", choices=SAMPLER_NAMES),
                          _i("scheduler", "COMBO", choices=SCHEDULER_NAMES),
                          _i("positive", "CONDITIONING"), _i("negative", "CONDITIONING"),
                          _i("latent_image", "LATENT"), _i("denoise", "FLOAT", 1.0, minimum=0.0, maximum=1.0)),
             ("LATENT",), "sampler", "sampling", "KSampler"),
    NodeSpec("VAEDecode", (_i("samples", "LATENT"), _i("vae", "VAE")), ("IMAGE",), "decode", "latent", "VAE Decode"),
    NodeSpec("CreateVideo", (_i("images", "IMAGE"), _i("fps", "FLOAT", 30.0, minimum=1.0, maximum=120.0),
                             _i("audio", "AUDIO", optional=True)),
             ("VIDEO",), "video", "image/video", "Create Video"),
    NodeSpec("SaveAnimatedWEBP", (_i("images", "IMAGE"), _i("filename_prefix", "STRING", "ComfyUI"),
                                  _i("fps", "FLOAT", 6.0, minimum=0.01, maximum=1000.0),
                                  _i("lossless", "BOOLEAN", True), _i("quality", "INT", 80, minimum=0, maximum=100),
                                  _i("method", "COMBO", "default", choices=("default", "fastest", "slowest"))),
             (), "output", "image/animation", "SaveAnimatedWEBP", output_node=True),
    NodeSpec("SaveWEBM", (_i("images", "IMAGE"), _i("filename_prefix", "STRING", "ComfyUI"),
                          _i("codec", "COMBO", "vp9", choices=("vp9", "av1")),
                          _i("fps", "FLOAT", 24.0, minimum=0.01, maximum=1000.0),
                          _i("crf", "FLOAT", 32.0, minimum=0.0, maximum=63.0)),
             (), "output", "image/video", "SaveWEBM", output_node=True),
    NodeSpec("SaveVideo", (_i("video", "VIDEO"), _i("filename_prefix", "STRING", "video/ComfyUI"),
                           _i("format", "COMBO", "auto", choices=("auto", "mp4")),
                           _i("codec", "COMBO", "auto", choices=("auto", "h264"))),
             (), "output", "image/video", "Save Video", output_node=True),
    NodeSpec("SaveImage", (_i("images", "IMAGE"), _i("filename_prefix", "STRING", "ComfyUI")),
             (), "output", "image", "Save Image", output_node=True),
    NodeSpec("PreviewImage", (_i("images", "IMAGE"),), (), "output", "image", "Preview Image", output_node=True),
)}

# UI-only nodes of a litegraph export: never executed (notes), or resolved away while parsing (reroutes, primitives)
UI_ONLY_NODES = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})


def object_info(spec: NodeSpec) -> dict:
    """ComfyUI's /object_info entry for one node (input, input_order, output, output_name, ...)."""
    def entry(i: InputSpec) -> list:
        kind: Any = list(i.choices) if i.type == "COMBO" and i.choices is not None else \
            [] if i.type == "COMBO" else i.type
        return [kind, i.options()]
    required = [i for i in spec.inputs if not i.optional]
    optional = [i for i in spec.inputs if i.optional]
    info = {"input": {"required": {i.name: entry(i) for i in required}},
            "input_order": {"required": [i.name for i in required]},
            "output": list(spec.outputs), "output_is_list": [False] * len(spec.outputs),
            "output_name": list(spec.output_names or spec.outputs), "name": spec.class_type,
            "display_name": spec.display_name, "description": "", "python_module": "fastvideo.workflows",
            "category": spec.category, "output_node": spec.output_node}
    if optional:
        info["input"]["optional"] = {i.name: entry(i) for i in optional}
        info["input_order"]["optional"] = [i.name for i in optional]
    return info


__all__ = ["ANY", "CLIP_TYPES", "InputSpec", "LINK_TYPES", "NODES", "NodeSpec", "SAMPLER_NAMES", "SCHEDULER_NAMES",
           "SEED_CONTROL", "UI_ONLY_NODES", "WIDGET_TYPES", "object_info"]
