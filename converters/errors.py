"""The one exception type of the conversion engine."""

from __future__ import annotations


class ConversionError(Exception):
    """Any refusal or failure of a conversion. The message is one line and names the file and key(s)."""

    def __init__(self, msg: str):
        # One line, always: the CLI prints it as `fvconvert: error: <msg>`.
        super().__init__(" ".join(str(msg).split("\n")).strip())

    @property
    def msg(self) -> str:
        return self.args[0]


class ParityCheckFailed(ConversionError):
    """The parity post-check on the converted weights failed (fvconvert exits 1: a parity failure, not bad input)."""


def name_some(items, limit: int = 5) -> str:
    """`'a', 'b', 'c' and 7 more` — keeps error lines readable when many keys are involved."""
    items = list(items)
    shown = ", ".join(repr(x) for x in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
