"""Training-free sparse attention: its kinds (filled in by the sparse-attention work)."""

from __future__ import annotations

from manifests.accel import AccelKind

KINDS: tuple[AccelKind, ...] = ()
