"""Step / residual caches and the guidance interval: their kinds (knobs to be verified against upstream by the owner)."""

from __future__ import annotations

from manifests.accel import AccelKind, Knob

_DENOISE_LOOPS = ("wan.denoise", "cosmos3.denoise")

KINDS: tuple[AccelKind, ...] = (
    AccelKind(
        name="guidance_interval", exact=False,
        summary="run CFG only on steps whose index lies in [start, end); other steps use the cond branch alone",
        knobs=(Knob("start", 0, int, "first step (0-based) that runs CFG", low=0),
               Knob("end", None, int, "first step that no longer runs CFG (None = until the last)", low=0)),
        cache_key_fields=(), loops=_DENOISE_LOOPS),
)
