"""Checks on the values clients send the replay table: priorities and rewards.

Plain functions of arrays and bounds, apart from the table's state, so that an insert, a
group of inserts and a priority update refuse a bad value with one wording of its error.
"""

from __future__ import annotations

import numpy as np

from amprl.errors import InvalidArgument
from amprl.rl.transitions import Chunk


def validate_priorities(priorities: np.ndarray, n: int, name: str,
                        max_priority: float = float("inf")) -> np.ndarray:
    """``priorities`` as float32 [n], each finite, > 0 and <= ``max_priority``."""
    p = np.asarray(priorities)
    if p.dtype != np.float32:
        raise InvalidArgument(f"{name}: dtype {p.dtype}, expected float32")
    if p.shape != (n,):
        raise InvalidArgument(f"{name}: shape {list(p.shape)}, expected [{n}]")
    if not (np.isfinite(p.sum()) or np.isfinite(p).all()):
        raise InvalidArgument(f"{name}: NaN or infinite priority; priorities must be finite and > 0")
    if n and p.min() <= 0:
        raise InvalidArgument(f"{name}: priority {float(p.min())!r} <= 0; priorities must be "
                              f"|delta| + epsilon > 0")
    if n and p.max() > max_priority:
        raise InvalidArgument(f"{name}: priority {float(p.max()):g} above replay.max_priority "
                              f"({max_priority:g}); one such priority would dominate sampling")
    return p


def check_rewards(rewards: np.ndarray, name: str, max_abs_reward: float) -> None:
    if rewards.size and float(np.abs(rewards).max()) > max_abs_reward:
        raise InvalidArgument(f"{name}: |reward| {float(np.abs(rewards).max()):g} above "
                              f"replay.max_abs_reward ({max_abs_reward:g})")


def first_bad_chunk(items: list[tuple[Chunk, np.ndarray]], max_priority: float,
                    max_abs_reward: float) -> tuple[int, InvalidArgument] | None:
    """(index of the first chunk whose priorities or rewards break the bounds, its error)
    or None. All chunks are checked at once; only a failure looks at them one by one."""
    def check(chunk: Chunk, p: np.ndarray) -> None:
        validate_priorities(p, p.shape[0], "priorities", max_priority)
        check_rewards(chunk.rewards, "chunk.rewards", max_abs_reward)

    try:
        if len(items) == 1:
            check(*items[0])
        else:
            validate_priorities(np.concatenate([p for _, p in items]),
                                sum(p.shape[0] for _, p in items), "priorities", max_priority)
            check_rewards(np.concatenate([c.rewards for c, _ in items]), "chunk.rewards",
                          max_abs_reward)
        return None
    except InvalidArgument as first:
        for i, (chunk, p) in enumerate(items):
            try:
                check(chunk, p)
            except InvalidArgument as exc:
                return i, exc
        return 0, first
