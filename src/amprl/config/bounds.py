"""Ranges declared on config fields: ``capacity: Annotated[int, Bound(ge=1)] = 100_000``.

One declaration serves the loader (``check``: a ConfigError naming the key and the range)
and the chart's JSON schema (``schema``: minimum / exclusiveMinimum / maximum), so the two
cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bound:
    """A numeric range; on a list field it applies to each item (and ``min_items`` to the
    list). ``note`` is added to the error, e.g. what 0 means."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    min_items: int = 0
    note: str = ""

    def holds(self, value: Any) -> bool:
        if isinstance(value, list):
            return len(value) >= self.min_items and all(self._holds(v) for v in value)
        return self._holds(value)

    def _holds(self, v: float) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le))

    def text(self) -> str:
        """The range in words: "must be >= 1", "must be in (0, 1]", ..."""
        low = (f"[{_num(self.ge)}" if self.ge is not None else
               f"({_num(self.gt)}" if self.gt is not None else None)
        if low is not None and self.le is not None:
            rule = f"in {low}, {_num(self.le)}]"
        elif low is not None:
            rule = (f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}")
        else:
            rule = f"<= {_num(self.le)}"
        return f"must be {rule}" + (f" ({self.note})" if self.note else "")

    def error(self, key: str, value: Any) -> str:
        if isinstance(value, list):
            items = f"at least {self.min_items} item(s), " if self.min_items else ""
            return f"{key}: {value!r} must be a list of {items}each {self.text()[len('must be '):]}"
        return f"{key}: {value!r} {self.text()}"

    def schema(self) -> dict:
        """The JSON-schema keywords of this range (for one value)."""
        out: dict = {}
        if self.ge is not None:
            out["minimum"] = self.ge
        if self.gt is not None:
            out["exclusiveMinimum"] = self.gt
        if self.le is not None:
            out["maximum"] = self.le
        return out


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)
