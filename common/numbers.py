"""Numbers stored as text (Redis hashes and streams) read back as numbers."""

from __future__ import annotations


def parse_number(raw: bytes | str) -> float | int | str:
    """A stored number as an int or a float (the text itself when it is neither): how every reader of the
    metrics streams and the counters hashes turns Redis' strings back into numbers."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text
