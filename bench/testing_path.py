"""Imported first by the benchmarks that use ``amprl_testing`` (``testing/``: test support
shared with the tests, not part of the installed package): puts it on this process's path
and on that of the processes the benchmark starts."""

import os
import sys
from pathlib import Path

TESTING = str(Path(__file__).resolve().parent.parent / "testing")
if TESTING not in sys.path:
    sys.path.insert(0, TESTING)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTING, os.environ.get("PYTHONPATH", "")]))
