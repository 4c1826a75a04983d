"""The one way a negative control is planted: replace an attribute at a seam the runtime declares, restore it on exit.

`owner` is a module, a class (a method for every instance) or an object; `make(original)` returns the replacement.
Every family's faults.py, parity/parallel_faults.py, parity/graph_faults.py and the shared rollout faults use it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def patched(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """`owner.name = make(original)` until exit, even when the body raises."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)
