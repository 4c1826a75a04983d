"""Typed, validated contracts shared by reference/ and optimized/: architecture configs and variants,
checkpoint manifests and parity contracts. Stdlib only (plus torch dtypes where needed)."""

from manifests.errors import ManifestError

__all__ = ["ManifestError"]
