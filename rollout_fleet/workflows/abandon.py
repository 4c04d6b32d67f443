"""How a workflow gives up on a group: :class:`GroupAbandoned`, which the worker shell turns into a drop (recorded
in the dropped stream with its reason) or a hand-back (the prompt goes back to the dispatch)."""

from __future__ import annotations

DROP, HAND_BACK = "drop", "hand_back"


class GroupAbandoned(Exception):
    """A group that will not be produced: ``action`` is drop (recorded with ``reason``) or hand_back."""

    def __init__(self, reason: str, action: str, detail: str = "") -> None:
        self.reason, self.action, self.detail = reason, action, detail
        super().__init__(f"{reason} ({action}): {detail}")
