"""Test support for AMP-RL, kept out of the runtime package ``amprl``: what the tests and
the benchmarks share.

- ``amprl_testing.netsim``: multi-host tests on one machine (network namespaces, a
  user-space delay relay that can also cut a link, and their pytest fixtures);
- ``amprl_testing.replay``: specs and chunks with known contents for replay tests and
  benchmarks;
- ``amprl_testing.podspec`` and ``amprl_testing.podman_node``: the chart's rendered pod
  specs as podman containers on one network, probed and scaled as a kubelet would
  (``make pod-check``, tests/podman).

Tests get it on their path from ``pyproject.toml`` (pytest's ``pythonpath``) and pass it to
the processes they start (``tests/conftest.py`` sets PYTHONPATH); benchmarks put it on
their path themselves.
"""
