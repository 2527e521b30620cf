"""The push ledger: the outcome of each numbered push, so that a resend is answered with
its first outcome instead of being applied twice.

A learner names each push (learner id, its incarnation, the push's sequence) and resends
one whose reply it lost. The store claims the name in the ledger before applying: a name
already settled gets the first outcome (an ApplyResult, or the error it got), a name whose
first try is still being applied waits for that try, and a new name is marked in progress
until the store settles it. It shares the store's lock and condition, so a settled outcome
wakes every resend waiting on it.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

from amprl.errors import Unavailable

MAX_REMEMBERED_PUSHES = 4096
"""Outcomes of numbered pushes kept to answer resends (the oldest forgotten beyond it)."""

_IN_PROGRESS = object()  # a numbered push being applied


class PushLedger:
    """Push id -> outcome, the oldest first (at most ``MAX_REMEMBERED_PUSHES``).

    ``changed`` is the store's condition (its lock guards the ledger too); ``closed`` says
    whether the store has shut down, which ends any wait.
    """

    def __init__(self, changed: threading.Condition, closed: Callable[[], bool]):
        self._changed = changed
        self._closed = closed
        self._outcomes: collections.OrderedDict[tuple, object] = collections.OrderedDict()

    def claim(self, push_id: tuple, wait_s: float) -> object | None:
        """The first outcome of ``push_id``, or None when this is its first try (now in
        progress until ``settle``). A resend racing its first try waits up to ``wait_s``
        for that try's outcome; Unavailable if it is still being applied then."""
        with self._changed:
            self._changed.wait_for(lambda: self._outcomes.get(push_id) is not _IN_PROGRESS
                                   or self._closed(), timeout=wait_s)
            first = self._outcomes.get(push_id)
            if first is _IN_PROGRESS:
                raise Unavailable(f"push {push_id[2]} of {push_id[0]} is still being applied "
                                  f"(its first try); retry for its outcome")
            if first is None:
                self._outcomes[push_id] = _IN_PROGRESS
            return first

    def settle(self, push_id: tuple, outcome: object | None) -> None:
        """Records the outcome of a claimed push (None: not decided, a resend may be
        applied) and wakes the resends waiting for it."""
        with self._changed:
            if outcome is None:
                self._outcomes.pop(push_id, None)
            else:
                self._outcomes[push_id] = outcome
            while len(self._outcomes) > MAX_REMEMBERED_PUSHES:
                self._outcomes.popitem(last=False)
            self._changed.notify_all()
