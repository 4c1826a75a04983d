"""seedvr2 architecture configs: the NaDiT (3B = upstream dit_v2, 7B = upstream dit) and the video VAE.

Field names are ours. Variants are named here (`tiny-3b` / `tiny-7b` are the shrunk configs of the public
goldens; `3b` / `7b` are the released sizes). Inconsistent configs are refused, never silently truncated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from manifests.errors import ManifestError

ARCHS = ("dit_v2", "dit")                      # dit_v2 = the 3B release, dit = the 7B release
WINDOW_METHODS = ("regular", "shifted")
UPSTREAM_WINDOW_METHODS = {"720pwin_by_size_bysize": "regular", "720pswin_by_size_bysize": "shifted"}
TIME_FREQ_DIM = 256                            # sinusoidal timestep channels
MAX_TEMPORAL_WINDOW = 30                       # upstream BYTEDANCE_MAX_TEMPORAL_WINDOW
REFERENCE_AREA_TOKENS = 45 * 80                # token grid of a 720x1280 frame after 8x VAE + 2x2 patch


def swiglu_hidden(dim: int, expand_ratio: int = 4) -> int:
    return 256 * math.ceil(int(2 * expand_ratio * dim / 3) / 256)


@dataclass(frozen=True)
class NaDiTConfig:
    arch: str                                  # "dit_v2" (3B) | "dit" (7B)
    dim: int                                   # vid_dim = txt_dim
    heads: int
    head_dim: int
    num_layers: int
    txt_in_dim: int
    mlp_hidden: int
    mm_layers: int                             # layers < mm_layers: separate .vid/.txt weights; others shared .all
    rope_dim: int = 0                          # dit_v2 mmrope3d dimension (0 for dit: pixel rope uses head_dim//2)
    vid_in_channels: int = 33
    vid_out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_windows: tuple[int, int, int] = (4, 3, 3)
    window_methods: tuple[str, ...] = ()       # one per layer ("regular" | "shifted"); () = alternating, regular first
    norm_eps: float = 1e-5
    pixel_rope_max_freq: float = 256.0         # dit pixel rope

    # ---- derived ----
    @property
    def is_3b(self) -> bool:
        return self.arch == "dit_v2"

    @property
    def emb_dim(self) -> int:
        return 6 * self.dim

    @property
    def patch_features(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw * self.vid_in_channels

    @property
    def out_features(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw * self.vid_out_channels

    @property
    def rope_axis_dim(self) -> int:
        """Channels per axis before pairing: 3B rope_dim // 3, 7B (head_dim // 2) // 3."""
        return self.rope_dim // 3 if self.is_3b else (self.head_dim // 2) // 3

    @property
    def rope_num_freqs(self) -> int:
        return self.rope_axis_dim // 2

    @property
    def schedule(self) -> tuple[str, ...]:
        """The window method of every layer (the released configs alternate regular / shifted)."""
        return self.window_methods or tuple("regular" if i % 2 == 0 else "shifted" for i in range(self.num_layers))

    def branch(self, layer: int) -> tuple[str, str]:
        """Weight-branch names (video, text) of a layer: ('vid','txt') or ('all','all'); the 7B never shares."""
        return ("vid", "txt") if not self.is_3b or layer < self.mm_layers else ("all", "all")

    def text_passive(self, layer: int) -> bool:
        """3B last layer is vid_only: text gets attention without ada modulation/gate and no MLP."""
        return self.is_3b and layer == self.num_layers - 1

    def validate(self) -> "NaDiTConfig":
        if self.arch not in ARCHS:
            raise ManifestError(f"seedvr2 NaDiT arch must be one of {ARCHS}, got {self.arch!r}")
        for f in ("dim", "heads", "head_dim", "num_layers", "txt_in_dim", "mlp_hidden"):
            if getattr(self, f) <= 0:
                raise ManifestError(f"seedvr2 NaDiT {f} must be > 0")
        if self.heads * self.head_dim != self.dim:
            raise ManifestError(f"seedvr2 NaDiT heads*head_dim ({self.heads}*{self.head_dim}) != dim {self.dim}")
        if self.window_methods and (len(self.window_methods) != self.num_layers
                                    or any(m not in WINDOW_METHODS for m in self.window_methods)):
            raise ManifestError(f"seedvr2 NaDiT window_methods must give one of {WINDOW_METHODS} per layer "
                                f"({self.num_layers}), got {self.window_methods}")
        if not 0 <= self.mm_layers <= self.num_layers:
            raise ManifestError(f"seedvr2 NaDiT mm_layers {self.mm_layers} outside [0, {self.num_layers}]")
        if not self.is_3b and self.mm_layers != 0:
            raise ManifestError("seedvr2 7B (dit) has separate vid/txt weights in every layer: mm_layers must be 0")
        if self.is_3b and (self.rope_dim <= 0 or self.rope_dim > self.head_dim):
            raise ManifestError(f"seedvr2 3B rope_dim must be in (0, head_dim], got {self.rope_dim}")
        if self.rope_num_freqs <= 0:
            raise ManifestError("seedvr2 NaDiT: rope has no frequency per axis")
        if self.patch_size[0] != 1:
            raise ManifestError("seedvr2 NaDiT: only temporal patch 1 is released")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "NaDiTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ManifestError(f"seedvr2 NaDiT config: unknown fields {unknown}")
        raw = dict(raw)
        for f in ("patch_size", "num_windows", "window_methods"):
            if f in raw:
                raw[f] = tuple(raw[f])
        try:
            return cls(**raw).validate()
        except TypeError as e:
            raise ManifestError(f"seedvr2 NaDiT config: {e}") from None


@dataclass(frozen=True)
class VAEConfig:
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    norm_groups: int = 32
    layers_per_block: int = 2                  # encoder; the decoder uses layers_per_block + 1
    in_channels: int = 3
    latent_channels: int = 16
    temporal_scale_num: int = 2                # encoder blocks 1..n downsample time, decoder blocks 0..n-1 upsample
    norm_eps: float = 1e-6
    scaling_factor: float = 0.9152

    def validate(self) -> "VAEConfig":
        if len(self.block_out_channels) != 4:
            raise ManifestError("seedvr2 VAE: the released layout has 4 blocks")
        if any(c % self.norm_groups for c in self.block_out_channels):
            raise ManifestError(f"seedvr2 VAE: channels {self.block_out_channels} not divisible by "
                                f"norm_groups {self.norm_groups}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "VAEConfig":
        raw = dict(raw)
        if "block_out_channels" in raw:
            raw["block_out_channels"] = tuple(raw["block_out_channels"])
        try:
            return cls(**raw).validate()
        except TypeError as e:
            raise ManifestError(f"seedvr2 VAE config: {e}") from None


NADIT_VARIANTS: dict[str, NaDiTConfig] = {
    # the shrunk configs of the public goldens (nadit3b_tiny_*, nadit7b_tiny)
    "tiny-3b": NaDiTConfig("dit_v2", dim=64, heads=2, head_dim=32, num_layers=4, txt_in_dim=80,
                           mlp_hidden=swiglu_hidden(64), mm_layers=2, rope_dim=32),
    "tiny-7b": NaDiTConfig("dit", dim=64, heads=2, head_dim=32, num_layers=4, txt_in_dim=80,
                           mlp_hidden=4 * 64, mm_layers=0),
    # released sizes (configs_3b/main.yaml, configs_7b/main.yaml)
    "3b": NaDiTConfig("dit_v2", dim=2560, heads=20, head_dim=128, num_layers=32, txt_in_dim=5120,
                      mlp_hidden=swiglu_hidden(2560), mm_layers=10, rope_dim=128),
    "7b": NaDiTConfig("dit", dim=3072, heads=24, head_dim=128, num_layers=36, txt_in_dim=5120,
                      mlp_hidden=4 * 3072, mm_layers=0),
}

VAE_VARIANTS: dict[str, VAEConfig] = {
    "tiny": VAEConfig(block_out_channels=(4, 8, 16, 16), norm_groups=2),
    "released": VAEConfig(),
}


def list_variants() -> list[str]:
    return list(NADIT_VARIANTS)


def load_variant(name: str) -> NaDiTConfig:
    if name not in NADIT_VARIANTS:
        raise ManifestError(f"unknown seedvr2 variant {name!r}; known: {', '.join(NADIT_VARIANTS)}")
    return NADIT_VARIANTS[name].validate()


def load_vae_variant(name: str) -> VAEConfig:
    if name not in VAE_VARIANTS:
        raise ManifestError(f"unknown seedvr2 VAE variant {name!r}; known: {', '.join(VAE_VARIANTS)}")
    return VAE_VARIANTS[name].validate()


def nadit_from_upstream_config(raw: dict) -> NaDiTConfig:
    """Map an upstream NaDiT constructor config (configs_*/main.yaml `dit.model`, as in the goldens' case.json)."""
    is_3b = raw.get("rope_type") == "mmrope3d" or "mm_layers" in raw
    n = int(raw["num_layers"])
    methods = raw.get("window_method") or []
    try:
        window_methods = tuple(UPSTREAM_WINDOW_METHODS[m] for m in methods)
        if window_methods == tuple("regular" if i % 2 == 0 else "shifted" for i in range(n)):
            window_methods = ()  # the released alternating schedule
    except KeyError as e:
        raise ManifestError(f"seedvr2: unknown upstream window method {e}") from None
    windows = {tuple(w) for w in raw.get("window", [(4, 3, 3)])}
    if len(windows) != 1:
        raise ManifestError(f"seedvr2: per-layer window counts must be equal, got {sorted(windows)}")
    dim = int(raw["vid_dim"])
    if int(raw.get("txt_dim", dim)) != dim:
        raise ManifestError("seedvr2: txt_dim must equal vid_dim")
    ratio = int(raw.get("expand_ratio", 4))
    return NaDiTConfig(
        arch="dit_v2" if is_3b else "dit", dim=dim, heads=int(raw["heads"]), head_dim=int(raw["head_dim"]),
        num_layers=n, txt_in_dim=int(raw["txt_in_dim"]),
        mlp_hidden=swiglu_hidden(dim, ratio) if is_3b else ratio * dim,
        mm_layers=int(raw.get("mm_layers", n)) if is_3b else 0, rope_dim=int(raw.get("rope_dim", 0)) if is_3b else 0,
        vid_in_channels=int(raw.get("vid_in_channels", 33)), vid_out_channels=int(raw.get("vid_out_channels", 16)),
        patch_size=tuple(raw.get("patch_size", (1, 2, 2))), num_windows=windows.pop(), window_methods=window_methods,
        norm_eps=float(raw.get("norm_eps", 1e-5))).validate()


def vae_from_upstream_config(raw: dict) -> VAEConfig:
    return VAEConfig(block_out_channels=tuple(raw["block_out_channels"]), norm_groups=int(raw["norm_num_groups"]),
                     layers_per_block=int(raw.get("layers_per_block", 2)),
                     latent_channels=int(raw.get("latent_channels", 16)),
                     temporal_scale_num=int(raw.get("temporal_scale_num", 2))).validate()
