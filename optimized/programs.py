"""Programs: several loops of one resident model instance composed into one user-level request.

`chain(engine, first, then, ...)`: submit `first`; when it completes, submit `then(first's result)` on the same
engine (same instance, same scheduler). A family's programs (e.g. cosmos3's `reason_then_generate`: AR reasoning,
then denoising with the reasoned text as the prompt) are built from it and exposed through its entry's `programs`.
The chain's event subscription is removed as soon as the second request is submitted or the first ends without a
result, so an engine running many programs does not accumulate subscribers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:   # annotations only: the engine imports this module, never the other way round
    from optimized.engine import Engine, RequestHandle

VIDEO_PHASES = ("denoise", "decode", "artifact")   # what a whole video program costs (FamilyEntry.request_cost)


@dataclass
class ProgramHandle:
    engine: "Engine"
    first: "RequestHandle"
    then: Callable[[Any], Any]                       # first's result -> the second request
    then_options: dict = field(default_factory=dict)
    names: tuple[str, str] = ("first", "second")     # result keys (and attribute aliases)
    second: "RequestHandle | None" = None
    _unsubscribe: Callable[[], None] | None = None

    def _on_event(self, ev) -> None:
        if ev.request_id != self.first.request_id or ev.kind not in ("request.completed", "request.cancelled",
                                                                     "request.failed"):
            return
        self._detach()
        if ev.kind == "request.completed" and self.second is None:
            self.second = self.engine.submit(self.then(self.first.record.result), **self.then_options)

    def _detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def __getattr__(self, name: str):
        names = self.__dict__.get("names", ())
        if name in names:
            return self.first if name == names[0] else self.second
        raise AttributeError(name)

    def cancel(self) -> None:
        self.first.cancel()
        if self.second is not None:
            self.second.cancel()

    def result(self) -> dict:
        first = self.first.result()
        self.engine.scheduler.run_until(lambda: self.second is not None)
        if self.second is None:
            raise RuntimeError(f"{self.names[0]} finished but the {self.names[1]} was never submitted")
        return {self.names[0]: first, self.names[1]: self.second.result()}


def chain(engine: "Engine", first: Any, then: Callable[[Any], Any], *, first_options: dict | None = None,
          then_options: dict | None = None, names: tuple[str, str] = ("first", "second")) -> ProgramHandle:
    handle = ProgramHandle(engine, engine.submit(first, **(first_options or {})), then, dict(then_options or {}),
                           names)
    handle._unsubscribe = engine.subscribe(handle._on_event, prefix="request.")
    return handle


# ==================================================================================================================
# Video programs: [encode] -> denoise -> decode, every stage a request on the engine's scheduler
# ==================================================================================================================
#
#   prog = start_video(engine, request, out="clip.mp4", image=None)   # submitted at once; nothing runs until ticks
#   prog.subscribe(fn)                                                # VideoEvent: request.* / progress per step
#   result = prog.result()                                            # drives the scheduler (sync engines only)
#
# Stages: "encode" (only when the family conditions on an encoded image: the chunked VAE encode loop), "denoise"
# (the family's denoise loop, picked by the request's type), "decode" (the chunked VAE decode loop: one WorkUnit per
# latent chunk, batched with other requests' chunks). Each stage is submitted from the previous stage's completion
# event, inside the same scheduler tick, so an engine driven by one thread (Engine, or AsyncEngine's driver) runs
# programs without any extra loop. The family specifics (which VAE, de-normalisation, fps, conditioning) come from
# the engine's media chain (`optimized.serving.families.media_chain`).

import json as _json
import time as _time
import threading as _threading
from dataclasses import fields as _fields, is_dataclass as _is_dataclass
from pathlib import Path as _Path

PROGRAM_EVENT_KINDS = ("request.accepted", "request.stage", "progress", "request.completed", "request.failed",
                       "request.cancelled")
TERMINAL = ("completed", "failed", "cancelled")


@dataclass(frozen=True)
class VideoEvent:
    """A program-level event (what fvgen's progress bars and the server's SSE stream show)."""
    kind: str                                      # one of PROGRAM_EVENT_KINDS
    request_id: str                                # the program's id
    data: dict = field(default_factory=dict)       # progress: {stage, step, total}; stage: {stage}; failed: {error}
    wall_time: float = field(default_factory=_time.time)

    def to_json(self) -> dict:
        return {"kind": self.kind, "request_id": self.request_id, "time": self.wall_time, **self.data}


@dataclass
class VideoResult:
    frames: Any                                    # uint8 [F, H, W, 3]
    audio: Any                                     # float [channels, N] in [-1, 1], or None
    latents: dict                                  # the denoise loop's final latents by modality
    timings: dict                                  # seconds per stage + total
    request_id: str
    seed: int | None
    weights_version: str | None
    fps: float
    sample_rate: int | None = None
    media_weights_version: str | None = None       # the VAE's, when it is not part of the model's weights
    request: Any = None
    paths: dict = field(default_factory=dict)      # artifact kind -> path written
    mux_audio: bool = False                        # the MP4 carries the audio track (the media chain's choice)

    def sidecar(self) -> dict:
        """The JSON sidecar written beside the artifacts."""
        return {"request_id": self.request_id, "seed": self.seed, "weights_version": self.weights_version,
                "media_weights_version": self.media_weights_version, "fps": self.fps,
                "sample_rate": self.sample_rate, "frames": list(self.frames.shape), "timings": self.timings,
                "request": describe(self.request), "request_type": type(self.request).__name__}


def describe(value: Any) -> Any:
    """A request as JSON: dataclasses field by field, small integer tensors as lists, other tensors by shape,
    dtype and content hash."""
    import hashlib

    import torch
    if _is_dataclass(value) and not isinstance(value, type):
        return {f.name: describe(getattr(value, f.name)) for f in _fields(value)}
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() and value.numel() <= 4096:
            return value.tolist()
        data = value.detach().cpu().contiguous()
        digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return {"tensor": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
                "sha256": digest[:16]}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class VideoProgram:
    def __init__(self, engine: "Engine", request: Any, *, program_id: str, out: Any = None, image: Any = None):
        from optimized.serving.families import adapter_for, media_chain
        self.engine, self.request, self.id, self.out, self.image = engine, request, program_id, out, image
        self.media = media_chain(engine)
        self.adapter = adapter_for(engine) if getattr(engine.family, "media", None) is None else None
        # pinned at start: a program in flight across update_weights(policy="finish") runs and is labelled on the
        # weights it started with (its denoise kernel holds that instance; the media chain its VAE)
        self.weights_version = getattr(engine.model, "weights_version", None)
        self.denoise_loop: str | None = None
        self.denoise_kernel: Any = None
        self.status = "waiting"                    # waiting | running | completed | failed | cancelled
        self.stage: str | None = None
        self.stage_request: str | None = None
        self.error: str | None = None
        self.value: VideoResult | None = None
        self.timings: dict = {}
        self.events: list[VideoEvent] = []
        self._listeners: list[Callable[[VideoEvent], Any]] = []
        self._t0 = _time.perf_counter()
        self._stage_t0 = self._t0
        self._cancel = False
        self._latents: dict | None = None
        self.done = _threading.Event()
        if out is not None:
            check_out_path(out)

    # ---- events
    def subscribe(self, fn: Callable[[VideoEvent], Any], replay: bool = True) -> Callable[[], None]:
        """fn(event) for this program's events (those already emitted first, unless replay=False), on the thread
        that drives the engine; an exception in fn is contained (the program and other listeners go on)."""
        for ev in list(self.events) if replay else ():
            try:
                fn(ev)
            except Exception:  # noqa: BLE001 - a listener's failure is its own
                pass
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def _emit(self, kind: str, **data: Any) -> None:
        ev = VideoEvent(kind, self.id, data)
        self.events.append(ev)
        for fn in list(self._listeners):
            try:
                fn(ev)
            except Exception:  # a listener's failure is its own; the program and the scheduler go on
                pass

    # ---- stages
    def start(self) -> "VideoProgram":
        from optimized.runtime.scheduler import RequestRejected
        try:
            self.denoise_loop = self.engine.family.loop_for(self.request)
        except TypeError as e:
            raise RequestRejected(str(e)) from None
        self.engine.admit(self.request, VIDEO_PHASES)   # bounds, limits, peak bytes: before anything is allocated
        self.denoise_kernel = self.engine.loop(self.denoise_loop)
        _router(self.engine).programs[self.id] = self
        self._emit("request.accepted", stages=self.stage_names())
        try:
            if self._needs_encode():
                self._submit("encode", self.media.encode_kernel,
                             self.media.encode_request(f"{self.id}/encode", self.image, self.request))
            else:
                self._submit_denoise()
        except Exception:
            _router(self.engine).programs.pop(self.id, None)
            raise
        return self

    def stage_names(self) -> list[str]:
        return (["encode"] if self._needs_encode() else []) + ["denoise", "decode"]

    def _needs_encode(self) -> bool:
        return self.image is not None and self.media.encode_kernel is not None

    def _submit(self, stage: str, kernel: Any, loop_request: Any) -> None:
        rid = f"{self.id}/{stage}"
        self.engine.scheduler.submit(kernel, loop_request, rid)
        self.stage, self.stage_request, self._stage_t0 = stage, rid, _time.perf_counter()
        self._emit("request.stage", stage=stage, total=self._total(stage, loop_request))

    def _submit_denoise(self) -> None:
        job = self.engine.family.make_job(self.denoise_loop, self.request)
        self._submit("denoise", self.denoise_kernel, job)   # admitted at start (sizes do not change on encode)

    def _total(self, stage: str, loop_request: Any) -> int | None:
        req = getattr(loop_request, "request", loop_request)
        if stage == "denoise":
            return getattr(req, "num_steps", None)
        lat = getattr(req, "latents", None)
        if lat is not None:
            n = getattr(req, "chunk_frames", 1)
            return -(-lat.shape[2] // n)
        video = getattr(req, "video", None)
        if video is not None:
            return -(-(1 + (video.shape[2] - 1) // 4) // getattr(req, "chunk_frames", 1))
        return None

    def on_event(self, ev: Any) -> None:
        """Called by the engine's router with every event of this program's current stage request."""
        if ev.request_id != self.stage_request:
            return
        if ev.kind == "trace.step":
            self._emit("progress", stage=self.stage, step=int(ev.data.get("step", 0)) + 1,
                       phase=ev.data.get("phase"))
        elif ev.kind == "request.admitted" and self.status == "waiting":
            self.status = "running"
        elif ev.kind == "request.completed":
            self.timings[self.stage] = _time.perf_counter() - self._stage_t0
            self._next(self.engine.scheduler.take_result(ev.request_id))   # the program owns its stages' results
        elif ev.kind in ("request.failed", "request.cancelled"):
            self.engine.scheduler.forget(ev.request_id)
            self._end("cancelled" if ev.kind == "request.cancelled" else "failed", ev.data.get("error"))

    def _next(self, result: Any) -> None:
        if self._cancel:
            return self._end("cancelled")
        if self.stage == "encode":
            self.request = self.media.condition(self.request, result)
            return self._submit_denoise()
        if self.stage == "denoise":
            self._latents = result["latents"]
            vision = self._latents["vision"]
            return self._submit("decode", self.media.decode_kernel,
                                self.media.decode_request(f"{self.id}/decode", vision))
        self._finish(result)

    def _finish(self, video: Any) -> None:
        from optimized.runtime.artifacts import to_uint8_frames
        audio = self.media.decode_audio(self._latents)
        self.timings["total"] = _time.perf_counter() - self._t0
        seed_of = self.adapter.seed_of if self.adapter is not None else (lambda r: getattr(r, "seed", None))
        self.value = VideoResult(
            frames=to_uint8_frames(video), audio=audio, latents=self._latents, timings=dict(self.timings),
            request_id=self.id, seed=seed_of(self.request), weights_version=self.weights_version,
            fps=self.media.fps(self.request), sample_rate=self.media.sample_rate,
            media_weights_version=self.media.weights_version, request=self.request,
            mux_audio=bool(getattr(self.media, "mux_audio", False)))
        if self.out is not None:
            t = _time.perf_counter()
            self.value.paths = write_video_artifacts(self.value, self.out)
            self.value.timings["write"] = _time.perf_counter() - t
        self._end("completed")

    def _end(self, status: str, error: str | None = None) -> None:
        if self.status in TERMINAL:
            return
        self.status, self.error = status, error
        _router(self.engine).programs.pop(self.id, None)
        self._emit(f"request.{status}", **({"error": error} if error else {}),
                   **({"timings": self.value.timings} if self.value is not None else {}))
        self.done.set()

    def fail(self, error: str) -> None:
        if self.stage_request is not None:
            rec = self.engine.scheduler.records.get(self.stage_request)
            if rec is not None and rec.status not in TERMINAL:
                self.engine.scheduler.cancel(self.stage_request)
        self._end("failed", error)

    # ---- control
    def cancel(self) -> None:
        """Stops at the current stage's next step boundary; no later stage is submitted."""
        self._cancel = True
        if self.stage_request in self.engine.scheduler.records and self.status not in TERMINAL:
            self.engine.scheduler.cancel(self.stage_request)   # a finished stage's record is already forgotten

    def result(self, max_ticks: int = 10_000_000) -> VideoResult:
        """Drive the engine until this program ends (sync engines only: an AsyncEngine's driver thread owns the
        scheduler there, wait on `done` instead)."""
        sched = self.engine.scheduler
        for _ in range(max_ticks):
            if self.done.is_set():
                break
            if sched.idle:
                self.fail("the scheduler went idle before the program ended")
                break
            sched.tick()
        if self.status != "completed":
            raise RuntimeError(f"video request {self.id} {self.status}" + (f": {self.error}" if self.error else ""))
        return self.value


class _Router:
    """One bus subscription per engine: events of stage requests go to their program."""

    def __init__(self, engine: "Engine"):
        self.programs: dict[str, VideoProgram] = {}
        self.ids = iter(range(1 << 62))
        engine.subscribe(self._route)

    def _route(self, ev: Any) -> None:
        rid = ev.request_id
        if rid is None or "/" not in rid:
            return
        prog = self.programs.get(rid.rsplit("/", 1)[0])
        if prog is None:
            return
        try:
            prog.on_event(ev)
        except Exception as e:  # a failing stage transition fails its own program, never the scheduler
            prog.fail(f"{type(e).__name__}: {e}")


def _router(engine: "Engine") -> _Router:
    router = engine.__dict__.get("_video_router")
    if router is None:
        router = engine.__dict__["_video_router"] = _Router(engine)
    return router


def start_video(engine: "Engine", request: Any, *, out: Any = None, image: Any = None,
                request_id: str | None = None) -> VideoProgram:
    """Submit [encode] -> denoise -> decode for `request` (the family's generation request; `image` [3, H, W] in
    [-1, 1] for families that condition on encoded latents). Raises ValueError (RequestRejected) at once for an
    invalid request, an unusable `out`, or a missing media component."""
    pid = request_id or f"video-{next(_router(engine).ids)}"
    if "/" in pid:
        raise ValueError(f"request id {pid!r}: '/' is reserved for stage ids")
    if pid in _router(engine).programs:
        raise ValueError(f"request id {pid!r} already in use")
    return VideoProgram(engine, request, program_id=pid, out=out, image=image).start()


def generate_video(engine: "Engine", request: Any, out: Any = None, *, image: Any = None,
                   request_id: str | None = None) -> VideoResult:
    return start_video(engine, request, out=out, image=image, request_id=request_id).result()


# ---------------------------------------------------------------------------------------------- artifacts on disk
def check_out_path(out: Any, *, not_inside: Any = None) -> _Path:
    """Refuse an output the writers cannot produce, before any compute: an existing target, a place that cannot be
    written (probed with a temp file in its nearest existing directory), a target inside `not_inside` (a model
    directory), or an MP4 without the optional `video` extra."""
    import os
    import tempfile

    from optimized.runtime.artifacts import ffmpeg_exe
    p = _Path(out)
    if p.exists():
        raise ValueError(f"out: {p} already exists; refusing to overwrite")
    if p.suffix.lower() == ".mp4" and ffmpeg_exe() is None:
        raise ValueError("out: writing MP4 needs the optional `video` extra (imageio-ffmpeg): "
                         "pip install -e '.[video]'; or give a directory for PNG frames")
    if p.suffix.lower() not in ("", ".mp4"):
        raise ValueError(f"out: {p} must end in .mp4 or name a directory (PNG frames), got {p.suffix!r}")
    if not_inside is not None:
        model = _Path(not_inside).resolve()
        if p.resolve() == model or model in p.resolve().parents:
            raise ValueError(f"out: {p} is inside the model directory {not_inside}; write outputs elsewhere")
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise NotADirectoryError(f"{parent} is not a directory")
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".fv-write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"out: {p} cannot be written ({e.strerror or e}); nothing was run") from None
    return p


def write_video_artifacts(result: VideoResult, out: Any) -> dict:
    """Write the result atomically. `OUT.mp4`: the MP4, then `OUT.wav` (audio, if any), then the sidecar
    `OUT.json`, each by temp file + rename. A directory: `frame_00000.png ...`, `audio.wav`, `video.json` written
    into a hidden temp directory renamed to OUT at the end (all or nothing)."""
    import os
    import shutil
    import tempfile

    import torch

    from optimized.runtime import artifacts
    p = check_out_path(out)
    video = result.frames.permute(3, 0, 1, 2).float() / 127.5 - 1.0   # back to [-1, 1]: to_uint8 is then exact
    sidecar = _json.dumps(result.sidecar(), indent=2, sort_keys=True).encode()
    if p.suffix.lower() == ".mp4":
        has_audio = result.audio is not None and bool(result.sample_rate)
        if has_audio and result.mux_audio:   # the WAV first (lossless, kept), then the MP4 with it muxed in
            paths = {"audio": str(artifacts.write_wav(torch.as_tensor(result.audio), p.with_suffix(".wav"),
                                                      result.sample_rate))}
            try:
                paths = {"video": str(write_mp4_with_audio(video, p, result.fps, p.with_suffix(".wav"))), **paths}
            except BaseException:
                p.with_suffix(".wav").unlink(missing_ok=True)   # all or nothing: no WAV without its MP4
                raise
        else:
            paths = {"video": str(artifacts.write_mp4(video, p, fps=result.fps))}
            if has_audio:
                paths["audio"] = str(artifacts.write_wav(result.audio, p.with_suffix(".wav"), result.sample_rate))
        paths["sidecar"] = str(artifacts._atomic_write_bytes(p.with_suffix(".json"), sidecar))
        return paths
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _Path(tempfile.mkdtemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp"))
    try:
        artifacts.honour_umask(tmp, directory=True)   # mkdtemp's 0700 would outlive the rename
        for i, rgb in enumerate(result.frames):
            (tmp / f"frame_{i:05d}.png").write_bytes(artifacts.png_bytes(rgb))
        if result.audio is not None and result.sample_rate:
            artifacts.write_wav(torch.as_tensor(result.audio), tmp / "audio.wav", result.sample_rate)
        (tmp / "video.json").write_bytes(sidecar)
        os.replace(tmp, p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    out_paths = {"frames": str(p), "sidecar": str(p / "video.json")}
    if (p / "audio.wav").exists():
        out_paths["audio"] = str(p / "audio.wav")
    return out_paths


def write_mp4_with_audio(video: Any, path: Any, fps: float, wav: Any) -> _Path:
    """The H.264 MP4 (artifacts.write_mp4, into a hidden temp file beside `path`) with the WAV's track muxed in as
    AAC by the ffmpeg binary imageio-ffmpeg ships (video stream copied); renamed to `path` at the end, nothing left
    at `path` or beside it on failure."""
    import os
    import subprocess
    import tempfile

    from optimized.runtime import artifacts
    path = _Path(path)
    fd, silent = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.video.", suffix=".mp4")
    os.close(fd)
    fd, muxed = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".mp4")
    os.close(fd)
    try:
        os.unlink(silent)
        artifacts.write_mp4(video, silent, fps=fps)
        cmd = [artifacts.ffmpeg_exe(), "-y", "-loglevel", "error", "-i", silent, "-i", str(wav), "-map", "0:v:0",
               "-map", "1:a:0", "-c:v", "copy", "-c:a", "aac", "-b:a", "128k", muxed]
        proc = subprocess.run(cmd, capture_output=True, check=False)
        if proc.returncode != 0:
            raise artifacts.ArtifactError(f"ffmpeg (audio mux) failed: {proc.stderr.decode(errors='replace')[-500:]}")
        artifacts.honour_umask(muxed)
        os.replace(muxed, path)
    except BaseException:
        _Path(muxed).unlink(missing_ok=True)
        raise
    finally:
        _Path(silent).unlink(missing_ok=True)
    return path
