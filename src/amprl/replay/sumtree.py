"""A vectorized sum-tree (and min-tree) over a fixed number of leaves.

Leaf i holds a non-negative weight (p_i^alpha in replay); every inner node holds the sum
(and the min over positive weights) of its children; the root holds the total. A batch
update writes the leaves and recomputes their ancestors level by level; a batch sample walks
all B uniform draws down the tree together. Both loop once per tree level, never per element.

The tree is K-ary (K = 32 by default) rather than binary: per level NumPy does a few
operations on [B, K] blocks, and a 1M-leaf tree has 4 levels instead of 20, which makes a
batch update or sample several times faster in Python (each NumPy call costs microseconds
however small its array). Inner nodes are recomputed from their children, never adjusted by
deltas, so float64 rounding cannot drift over millions of updates.
"""

from __future__ import annotations

import numpy as np


class SumTree:
    """Sum and min over ``capacity`` leaves: O(log N) batch update and batch sample."""

    def __init__(self, capacity: int, arity: int = 32):
        if capacity < 1:
            raise ValueError(f"capacity ({capacity}) must be a positive integer")
        if arity < 2:
            raise ValueError(f"arity ({arity}) must be >= 2")
        self.capacity = int(capacity)
        self.arity = k = int(arity)
        # Level sizes, leaves last; each level is padded to a multiple of K so that it can be
        # viewed as [parents, K]. The root level has one node.
        sizes = [-(-self.capacity // k) * k]
        while sizes[0] > k:
            parents = sizes[0] // k
            sizes.insert(0, -(-parents // k) * k)
        self._sums = [np.zeros(1)] + [np.zeros(n) for n in sizes]
        self._mins = [np.full(1, np.inf)] + [np.full(n, np.inf) for n in sizes]
        # Nodes of level d that have children ([parents, K] blocks of level d + 1).
        self._parents = [n // k for n in sizes]

    @property
    def total(self) -> float:
        return float(self._sums[0][0])

    @property
    def min(self) -> float:
        """Smallest positive leaf weight (inf when every leaf is empty)."""
        return float(self._mins[0][0])

    @property
    def depth(self) -> int:
        return len(self._sums) - 1

    def get(self, leaves: np.ndarray) -> np.ndarray:
        return self._sums[-1][leaves]

    def values(self) -> np.ndarray:
        """All leaf weights, [capacity] (a view)."""
        return self._sums[-1][:self.capacity]

    def update(self, leaves: np.ndarray, values: np.ndarray) -> None:
        """Sets ``leaves`` to ``values`` (>= 0; 0 empties a leaf). With a leaf given twice
        the last value wins."""
        leaves = np.asarray(leaves, dtype=np.int64).ravel()
        values = np.asarray(values, dtype=np.float64).ravel()
        if leaves.size == 0:
            return
        if leaves.shape != values.shape:
            raise ValueError(f"{leaves.size} leaves but {values.size} values")
        if leaves.min() < 0 or leaves.max() >= self.capacity:
            raise IndexError(f"leaf outside [0, {self.capacity})")
        if not (np.isfinite(values).all() and values.min() >= 0):
            raise ValueError("leaf values must be finite and >= 0")
        self._sums[-1][leaves] = values
        self._mins[-1][leaves] = np.where(values > 0, values, np.inf)
        nodes = leaves
        for d in range(self.depth - 1, -1, -1):
            # Repeated parents are harmless: each gets the same value twice.
            nodes = nodes // self.arity
            children = self._sums[d + 1].reshape(-1, self.arity)
            self._sums[d][nodes] = children[nodes].sum(axis=1)
            self._mins[d][nodes] = self._mins[d + 1].reshape(-1, self.arity)[nodes].min(axis=1)

    def rebuild(self, values: np.ndarray) -> None:
        """Replaces every leaf at once (used when the table is rebuilt from Redis)."""
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (self.capacity,):
            raise ValueError(f"expected {self.capacity} values, got shape {values.shape}")
        if not (np.isfinite(values).all() and (values >= 0).all()):
            raise ValueError("leaf values must be finite and >= 0")
        self._sums[-1][:] = 0.0
        self._sums[-1][:self.capacity] = values
        self._mins[-1][:] = np.inf
        self._mins[-1][:self.capacity] = np.where(values > 0, values, np.inf)
        for d in range(self.depth - 1, -1, -1):
            n = self._parents[d]
            self._sums[d][:] = 0.0
            self._mins[d][:] = np.inf
            self._sums[d][:n] = self._sums[d + 1].reshape(-1, self.arity).sum(axis=1)
            self._mins[d][:n] = self._mins[d + 1].reshape(-1, self.arity).min(axis=1)

    def find(self, targets: np.ndarray) -> np.ndarray:
        """Leaf i with prefix_sum(i) <= target < prefix_sum(i + 1), per target in
        [0, total) (a target that rounding pushes past a node's last child takes that child)."""
        u = np.array(targets, dtype=np.float64, copy=True).ravel()
        nodes = np.zeros(u.shape, dtype=np.int64)
        rows = np.arange(u.size)
        for d in range(self.depth):
            children = self._sums[d + 1].reshape(-1, self.arity)[nodes]  # [B, K]
            cum = np.cumsum(children, axis=1)
            pick = np.minimum((cum <= u[:, None]).sum(axis=1), self.arity - 1)
            u -= cum[rows, pick] - children[rows, pick]
            nodes = nodes * self.arity + pick
            if d + 1 < self.depth:
                np.minimum(nodes, self._parents[d + 1] - 1, out=nodes)
        return nodes

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Draws ``n`` leaves with replacement, leaf i with probability w_i / total."""
        total = self.total
        if not total > 0:
            raise ValueError("cannot sample from an empty tree")
        leaves = self.find(rng.random(n) * total)
        # Rounding can walk a draw into an empty leaf (one ulp past a node's sum); redraw
        # those few rather than bias the others.
        bad = self._sums[-1][leaves] <= 0
        while bad.any():
            leaves[bad] = self.find(rng.random(int(bad.sum())) * total)
            bad = self._sums[-1][leaves] <= 0
        return leaves
