"""Wan VAE decode / encode as loops the runtime owns (LoopKernel / WorkPlan contract, optimized/runtime/loop.py).

One step = one temporal chunk (`chunk_frames` latent frames). The chunk's `ConvCache` is typed loop state, so a decode
runs under the `WorkUnitScheduler` like any loop: with other requests (equal `batch_key`s run batched in one call),
cancelled between chunks (every plan is a cancel boundary) and streamed chunk by chunk (each decoded chunk is the
step's `step_output`, a `VideoChunkEvent`; `optimized.runtime.scheduler.stream_request` yields them). The memory a
chunk needs is predicted by `chunk_bytes` and declared in the plan's `resources`; the scheduler runs the chunk only
when it fits its budget and refuses a request whose first chunk never can.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from manifests.wan import WanVAEConfig
from optimized.models.wan.spec import DECODE_LOOP, ENCODE_LOOP
from optimized.models.wan.vae import ConvCache, FastWanVAE
from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan


# ----------------------------------------------------------------------------------------------
# Memory model: bytes one chunk needs (activations at the widest stage x a working-set factor + the cache)
# ----------------------------------------------------------------------------------------------

WORKING_SET = 6  # live tensors of a resblock at its widest: input, normed, conv input (+zero frames), output, skip


def _stage_sizes(cfg: WanVAEConfig, frames: int, h: int, w: int, decode: bool) -> list[tuple[int, int]]:
    """(elements of one activation, elements of one cached frame) per stage, for one sample."""
    out, L = [], len(cfg.dim_mult)
    if decode:
        dims, t = cfg.decoder_dims(), frames
        for i in range(L):
            H, W = h * 2 ** i, w * 2 ** i
            out.append((dims[i] * max(t, 1) * H * W * (2 if i < L - 1 and cfg.temporal_upsample[i] else 1), dims[i] * H * W))
            if i < L - 1 and cfg.temporal_upsample[i]:
                t *= 2
        out.append((dims[-1] * t * h * w * 4 ** (L - 1), dims[-1] * h * w * 4 ** (L - 1)))
    else:
        dims, H, W = cfg.encoder_dims(), h * 2 ** (L - 1), w * 2 ** (L - 1)
        t = frames
        for i in range(L):
            out.append((dims[i + 1] * t * H * W * (1 if i == 0 else 1), dims[i + 1] * H * W))
            if i < L - 1:
                H, W = H // 2, W // 2
                if cfg.temporal_downsample[i]:
                    t = (t + 1) // 2
    return out


def chunk_bytes(cfg: WanVAEConfig, batch: int, latent_frames: int, h: int, w: int, itemsize: int,
                decode: bool = True) -> int:
    """Predicted peak bytes of one chunk of `latent_frames` latent frames at latent size h x w (upper bound)."""
    frames = latent_frames if decode else 4 * latent_frames
    sizes = _stage_sizes(cfg, frames, h, w, decode)
    act = max(a for a, _ in sizes)
    n_convs_per_stage = 2 * (cfg.num_res_blocks + 1) + 1
    cache = sum(2 * c * n_convs_per_stage for _, c in sizes)
    return batch * itemsize * (WORKING_SET * act + cache)


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    latents: torch.Tensor                 # [B, z, T, h, w]: decoder input (already de-normalised)
    chunk_frames: int = 1                 # latent frames per step (upstream: 1); any value gives the same numbers
    keep_output: bool = True              # False: stream only, finalize returns None (memory stays bounded)


@dataclass
class DecodeState:
    request: DecodeRequest
    next_frame: int = 0                   # first latent frame of the next chunk
    cache: ConvCache = field(default_factory=ConvCache)
    chunks: list[torch.Tensor] = field(default_factory=list)
    last_chunk: torch.Tensor | None = None
    frames_out: int = 0                   # video frames produced so far

    @property
    def total(self) -> int:
        return self.request.latents.shape[2]


def _check_latents(cfg: WanVAEConfig, z: torch.Tensor) -> None:
    if not isinstance(z, torch.Tensor) or z.ndim != 5 or z.shape[1] != cfg.z_dim or min(z.shape[2:]) < 1:
        shape = list(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ValueError(f"wan VAE {cfg.version}: latents must be [B, {cfg.z_dim}, T, h, w], got {shape}")
    if not torch.isfinite(z).all():
        raise ValueError(f"wan VAE {cfg.version}: latents hold NaN or Inf values")


class WanVaeDecodeKernel(LoopKernel[DecodeState]):
    loop_id = DECODE_LOOP

    def __init__(self, vae: FastWanVAE, trace: Callable[[str, torch.Tensor], None] | None = None):
        self.vae, self.cfg, self.trace = vae, vae.cfg, trace

    def init_state(self, request: DecodeRequest) -> DecodeState:
        _check_latents(self.cfg, request.latents)
        if request.chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {request.chunk_frames}")
        return DecodeState(request)

    def plan_step(self, state: DecodeState) -> WorkPlan:
        z, n = state.request.latents, state.request.chunk_frames
        a, b = state.next_frame, min(state.next_frame + n, state.total)
        B, _, _, h, w = z.shape
        first = a == 0
        itemsize = self.vae.dtype.itemsize
        nbytes = chunk_bytes(self.cfg, B, b - a, h, w, itemsize, decode=True)
        sig = f"{self.loop_id}:{self.cfg.version}:{b - a}x{h}x{w}:{self.vae.dtype}:{'first' if first else 'next'}"
        return WorkPlan(
            request_id=state.request.request_id, loop_id=self.loop_id, phase="vae_decode_chunk", step_index=a // n,
            batch_key=(sig, str(z.device)), resources=ResourceRequest(device_bytes=nbytes),
            cancel_boundary=True, shape_signature=sig,
            info={"latent_frames": (a, b), "video_frames": (0 if first else 1 + 4 * (a - 1), 1 + 4 * (b - 1))})

    def run_step(self, states: Sequence[DecodeState], plans: Sequence[WorkPlan]) -> list[DecodeState]:
        if len({p.batch_key for p in plans}) != 1:
            raise ValueError("run_step: plans of one call must share a batch_key")
        a, b = plans[0].info["latent_frames"]
        zs = [s.request.latents[:, :, a:b] for s in states]
        sizes = [z.shape[0] for z in zs]
        cache = states[0].cache if len(states) == 1 else ConvCache.concat([s.cache for s in states]) \
            if a > 0 else ConvCache()
        with torch.no_grad():
            # a lone request's chunk updates its cache in place (one conv cache held, not two: peak <= upstream's);
            # safe because a failed single-request step fails its request and is never retried from that cache
            video, cache = self.vae.decode_chunk(torch.cat(zs, 0) if len(zs) > 1 else zs[0], cache, first=a == 0,
                                                 trace=self.trace, consume=len(states) == 1)
        if not torch.isfinite(video).all():
            raise FloatingPointError(f"{self.loop_id}: non-finite values in decoded frames {plans[0].info['video_frames']}")
        outs, caches = (video.split(sizes, 0), cache.split(sizes)) if len(states) > 1 else ((video,), (cache,))
        new = []
        for s, v, c in zip(states, outs, caches):
            chunks = s.chunks + [v] if s.request.keep_output else s.chunks
            new.append(replace(s, next_frame=b, cache=c, chunks=chunks, last_chunk=v, frames_out=s.frames_out + v.shape[2]))
        return new

    def is_done(self, state: DecodeState) -> bool:
        return state.next_frame >= state.total

    def finalize(self, state: DecodeState) -> torch.Tensor | None:
        if not state.request.keep_output:
            return None
        return torch.cat(state.chunks, 2)

    def release(self, state: DecodeState) -> None:
        state.cache = ConvCache()
        state.chunks = []

    def step_output(self, state: DecodeState, plan: WorkPlan) -> "VideoChunkEvent":
        return VideoChunkEvent(plan.request_id, plan.step_index, tuple(plan.info["video_frames"]), state.last_chunk,
                               plan.resources.device_bytes)


# ----------------------------------------------------------------------------------------------
# Encode
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EncodeRequest:
    request_id: str
    video: torch.Tensor                   # [B, 3, 4k+1, H, W] in [-1, 1]
    chunk_frames: int = 1                 # latent frames per step (upstream: 1 = video frame 0, then 4 at a time)


@dataclass
class EncodeState:
    request: EncodeRequest
    next_frame: int = 0                   # next latent frame
    cache: ConvCache = field(default_factory=ConvCache)
    moments: list[torch.Tensor] = field(default_factory=list)

    @property
    def total(self) -> int:
        return 1 + (self.request.video.shape[2] - 1) // 4


@dataclass(frozen=True)
class FastPosterior:
    mean: torch.Tensor
    logvar: torch.Tensor                  # clamped to [-30, 20] (upstream)

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def mode(self) -> torch.Tensor:
        return self.mean

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        noise = torch.randn(self.mean.shape, generator=generator, dtype=self.mean.dtype, device="cpu")
        return self.mean + self.std * noise.to(self.mean.device)


class WanVaeEncodeKernel(LoopKernel[EncodeState]):
    loop_id = ENCODE_LOOP

    def __init__(self, vae: FastWanVAE, trace: Callable[[str, torch.Tensor], None] | None = None):
        self.vae, self.cfg, self.trace = vae, vae.cfg, trace

    def init_state(self, request: EncodeRequest) -> EncodeState:
        v, cfg = request.video, self.cfg
        if not isinstance(v, torch.Tensor) or v.ndim != 5 or v.shape[1] != cfg.pixel_channels:
            raise ValueError(f"wan VAE {cfg.version}: video must be [B, {cfg.pixel_channels}, T, H, W], got "
                             f"{list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        cfg.check_video_shape(*v.shape[2:])
        if not torch.isfinite(v).all():
            raise ValueError(f"wan VAE {cfg.version}: video holds NaN or Inf values")
        if request.chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {request.chunk_frames}")
        return EncodeState(request)

    def plan_step(self, state: EncodeState) -> WorkPlan:
        v, n = state.request.video, state.request.chunk_frames
        a, b = state.next_frame, min(state.next_frame + n, state.total)
        B, _, _, H, W = v.shape
        s = self.cfg.spatial_compression
        nbytes = chunk_bytes(self.cfg, B, b - a, H // s, W // s, self.vae.dtype.itemsize, decode=False)
        sig = f"{self.loop_id}:{self.cfg.version}:{b - a}x{H}x{W}:{self.vae.dtype}:{'first' if a == 0 else 'next'}"
        return WorkPlan(
            request_id=state.request.request_id, loop_id=self.loop_id, phase="vae_encode_chunk", step_index=a // n,
            batch_key=(sig, str(v.device)), resources=ResourceRequest(device_bytes=nbytes), cancel_boundary=True,
            shape_signature=sig,
            info={"latent_frames": (a, b), "video_frames": (max(0, 4 * a - 3), 4 * b - 3)})

    def run_step(self, states: Sequence[EncodeState], plans: Sequence[WorkPlan]) -> list[EncodeState]:
        new = []
        f0, f1 = plans[0].info["video_frames"]
        a, b = plans[0].info["latent_frames"]
        for s in states:  # encode requests run one by one (their chunks rarely share shapes)
            with torch.no_grad():
                m, cache = self.vae.encode_chunk(s.request.video[:, :, f0:f1], s.cache, first=a == 0,
                                                 trace=self.trace)
            new.append(replace(s, next_frame=b, cache=cache, moments=s.moments + [m]))
        return new

    def is_done(self, state: EncodeState) -> bool:
        return state.next_frame >= state.total

    def finalize(self, state: EncodeState) -> FastPosterior:
        mean, logvar = torch.cat(state.moments, 2).chunk(2, dim=1)
        return FastPosterior(mean, logvar.clamp(-30.0, 20.0))

    def release(self, state: EncodeState) -> None:
        state.cache = ConvCache()


@dataclass(frozen=True)
class VideoChunkEvent:
    """What one decode step streams out (the `output` of its `request.output` event)."""
    request_id: str
    step_index: int
    video_frames: tuple[int, int]         # [start, end) in the decoded clip
    frames: torch.Tensor                  # [B, 3, end - start, H, W] in [-1, 1]
    reserved_bytes: int                   # the step's declared device bytes
    kind: str = "media.video_chunk"
