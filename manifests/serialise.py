"""JSON <-> frozen config dataclasses, strictly: unknown or missing keys are errors, JSON lists become tuples."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from manifests.errors import ManifestError

C = TypeVar("C")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


def config_from_dict(cls: type[C], d: dict[str, Any], what: str) -> C:
    """Build and validate `cls` from a JSON object; `what` names the config in error messages."""
    if not isinstance(d, dict):
        raise ManifestError(f"{what} config: expected a JSON object")
    fields = dataclasses.fields(cls)
    unknown = sorted(set(d) - {f.name for f in fields})
    if unknown:
        raise ManifestError(f"{what} config: unknown keys {unknown}")
    missing = sorted(f.name for f in fields if f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING and f.name not in d)
    if missing:
        raise ManifestError(f"{what} config: missing keys {missing}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}).validate()


def read_json_object(path, what: str, error: type[Exception] = ManifestError) -> dict[str, Any]:
    """A JSON object from `path`, or one clear `error` naming the file (missing, unreadable, bad JSON, not an object).
    The one JSON-file reader of manifests/ (configs, variants, model_index.json, safetensors indexes)."""
    import json
    from pathlib import Path

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: unreadable {what} ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data
