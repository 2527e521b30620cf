"""Which actors insert into a replay shard: a bounded record of actor id -> last insert."""

from __future__ import annotations

import collections
import time

LIVE_WINDOW_S = 60.0
"""An actor counts as live if it inserted within this many seconds (Info's actors_live)."""

MAX_TRACKED_ACTORS = 16_384
"""Ids remembered at most; beyond it the longest-silent id is forgotten, so a fleet that
churns through pod names (every restart a new one) never grows the map without bound."""


class ActorRegistry:
    """Actor ids by the time of their last stored insert, the most recent last."""

    def __init__(self, live_window_s: float = LIVE_WINDOW_S, max_tracked: int = MAX_TRACKED_ACTORS):
        if live_window_s <= 0:
            raise ValueError(f"live_window_s ({live_window_s}) must be > 0")
        if max_tracked < 1:
            raise ValueError(f"max_tracked ({max_tracked}) must be >= 1")
        self.live_window_s = float(live_window_s)
        self.max_tracked = int(max_tracked)
        self._last: collections.OrderedDict[str, float] = collections.OrderedDict()

    def saw(self, actor_id: str, now: float | None = None) -> None:
        self._last[actor_id] = time.monotonic() if now is None else now
        self._last.move_to_end(actor_id)
        while len(self._last) > self.max_tracked:
            self._last.popitem(last=False)

    @property
    def seen(self) -> int:
        """Distinct ids remembered (at most ``max_tracked``)."""
        return len(self._last)

    def live(self, now: float | None = None) -> int:
        """Ids that inserted within the live window."""
        cutoff = (time.monotonic() if now is None else now) - self.live_window_s
        count = 0
        for t in reversed(self._last.values()):  # newest first: stop at the first stale one
            if t < cutoff:
                break
            count += 1
        return count
