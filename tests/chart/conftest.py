"""Session fixtures of the chart tests (helpers live in chartkit.py)."""

from __future__ import annotations

import pytest

from chartkit import CHART, VALUE_SETS, helm_python, render_docs


@pytest.fixture(scope="session")
def chart():
    return helm_python.Chart.load(CHART)


@pytest.fixture(scope="session")
def rendered() -> dict[str, tuple[list[dict], str]]:
    """Every value set, rendered once per session: {set id: (objects, NOTES.txt)}."""
    return {key: render_docs(values) for key, values in VALUE_SETS.items()}
