"""Where a video program splits into roles, and each role's stage on its own engine. Names no family.

The split is read from the program, not written per family: `VideoProgram.stage_names()` is the program's own
stage list for a request ("encode" only when the request has an image the media chain encodes, then "denoise",
"decode"), and `VIDEO_PHASES` (denoise, decode, artifact) orders the phases around the denoise loop:

    encoder    every stage before "denoise": admission + the media chain's image encode and conditioning (a
               pass-through for a request without an image). Text encoding is NOT here: every served family's
               denoise loop encodes its prompt itself, through its text CacheStore (its phase declarations put it
               inside "denoise"); moving it out would change the families' loops.
    denoiser   "denoise": the family's loop for the request (`family.loop_for` / `make_job`), to final latents
    decoder    every phase after "denoise" (decode, artifact): the chunked VAE decode to uint8 frames + the sound
               decoder's audio

Each stage runs the co-located VideoProgram's calls in the same order with the same kernels, on the role's own
engine and scheduler (`_run_on`): same weights (same variant + seed), same inputs -> the same bytes on CPU fp32.
Stage values are plain dicts of tensors and request dataclasses (what `transfer.pack` cuts into a manifest):

    gateway -> encoder    {"request": request, "image": image | None}
    encoder -> denoiser   {"request": conditioned request}
    denoiser -> decoder   {"latents": {modality: tensor}, "fps": float, "seed": int | None}
    decoder -> gateway    {"frames": uint8 [F, H, W, 3], "audio": tensor | None}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optimized.programs import VIDEO_PHASES, VideoProgram

ROLES = ("encoder", "denoiser", "decoder")
DENOISE = "denoise"


def role_of_stage(stage: str) -> str:
    """A program stage's role, by its place around the denoise loop (VIDEO_PHASES orders what follows it)."""
    if stage == DENOISE:
        return "denoiser"
    if stage in VIDEO_PHASES[VIDEO_PHASES.index(DENOISE) + 1:]:
        return "decoder"
    return "encoder"                  # what precedes the loop ("encode", and any stage a program adds before it)


@dataclass(frozen=True)
class StageSplit:
    program_stages: tuple[str, ...]   # the program's own stage list for this request
    roles: tuple[tuple[str, tuple[str, ...]], ...]   # (role, its program stages), every role once, in ROLES order

    def stages_of(self, role: str) -> tuple[str, ...]:
        return dict(self.roles)[role]


def split_program(engine: Any, request: Any, image: Any = None) -> StageSplit:
    """The roles `request`'s video program runs on `engine` (a role with no program stage is a pass-through)."""
    stages = tuple(VideoProgram(engine, request, program_id="split", image=image).stage_names())
    by_role = {r: tuple(s for s in stages if role_of_stage(s) == r) for r in ROLES}
    by_role["decoder"] = by_role["decoder"] + tuple(p for p in VIDEO_PHASES if role_of_stage(p) == "decoder"
                                                    and p not in by_role["decoder"])   # + artifact
    return StageSplit(stages, tuple(by_role.items()))


def _run_on(engine: Any, kernel: Any, loop_request: Any, rid: str) -> Any:
    """One loop request on this role's own scheduler, to completion (the program's stage request)."""
    sched = engine.scheduler
    rec = sched.submit(kernel, loop_request, rid)
    sched.run_until(lambda: rec.status not in ("waiting", "running"))
    if rec.status != "completed":
        err = next((e.data.get("error") for e in reversed(rec.events) if e.data.get("error")), rec.status)
        sched.forget(rid)
        raise RuntimeError(f"{rid} {rec.status}: {err}")
    return sched.take_result(rid)


def encoder_stage(engine: Any, value: dict, request_id: str) -> dict:
    """Admission (the co-located program's `start`) + image encode and conditioning (its "encode" stage)."""
    from optimized.serving.families import media_chain
    request, image = value["request"], value.get("image")
    engine.family.loop_for(request)                   # a request the family has no loop for: refused here
    engine.admit(request, VIDEO_PHASES)
    media = media_chain(engine)
    if image is not None and media.encode_kernel is not None:
        rid = f"{request_id}/encode"
        encoded = _run_on(engine, media.encode_kernel, media.encode_request(rid, image, request), rid)
        request = media.condition(request, encoded)
    return {"request": request}


def denoiser_stage(engine: Any, value: dict, request_id: str) -> dict:
    from optimized.serving.families import adapter_for, media_chain
    request = value["request"]
    entry = engine.family
    loop = entry.loop_for(request)
    result = _run_on(engine, engine.loop(loop), entry.make_job(loop, request), f"{request_id}/{DENOISE}")
    # as VideoProgram: the adapter's seed_of only for a family without media hooks (upstream of this module)
    seed_of = adapter_for(engine).seed_of if getattr(entry, "media", None) is None else \
        (lambda r: getattr(r, "seed", None))
    return {"latents": result["latents"], "fps": float(media_chain(engine).fps(request)), "seed": seed_of(request)}


def decoder_stage(engine: Any, value: dict, request_id: str) -> dict:
    from optimized.runtime.artifacts import to_uint8_frames
    from optimized.serving.families import media_chain
    media, latents = media_chain(engine), value["latents"]
    rid = f"{request_id}/decode"
    video = _run_on(engine, media.decode_kernel, media.decode_request(rid, latents["vision"]), rid)
    return {"frames": to_uint8_frames(video), "audio": media.decode_audio(latents)}


STAGE_OF_ROLE = {"encoder": encoder_stage, "denoiser": denoiser_stage, "decoder": decoder_stage}
NEXT_ROLE = {"gateway": "encoder", "encoder": "denoiser", "denoiser": "decoder", "decoder": "gateway"}
