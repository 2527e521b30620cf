"""pytest fixtures for multi-host tests: services in separate network namespaces.

Enabled by ``pytest_plugins = ["amprl_testing.netsim.pytest_plugin"]`` in ``tests/conftest.py``.
``netns_topology`` is a factory; every topology it makes is torn down after the test,
whether the test passed, failed or raised::

    @pytest.mark.netns
    def test_learner_talks_to_ps_over_a_slow_link(netns_topology):
        topo = netns_topology(["ps", "learner"])
        ps = topo["ps"].exec([sys.executable, "-m", "amprl.paramserver",
                              "--host", topo["ps"].address, "--port", "50051"])
        topo["ps"].wait_port(50051, proc=ps)
        ps_addr = topo.delay("learner", "ps", 50051, delay_ms=150)  # 300 ms round trip
        learner = topo["learner"].exec([sys.executable, "-m", "amprl.learner"],
                                       env={"AMPRL_PARAMSERVER_ADDRESS": ps_addr})
        ...

The fixture skips the test when namespaces cannot be made (not root, no ``ip``); with
``AMPRL_REQUIRE_NETNS=1`` it fails instead, for machines where these tests must run. When a
test fails, the tail of each started process's log is added to the report.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator, Sequence

import pytest

from amprl_testing.netsim import netns

_TOPOLOGIES = pytest.StashKey[list]()
_support: list[str | None] = []  # cached check_supported() result, once per session


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "netns: needs root and Linux network namespaces")


def require_netns() -> None:
    """Skips (or, with AMPRL_REQUIRE_NETNS=1, fails) the test if namespaces are unavailable."""
    if not _support:
        reason = netns.check_supported()
        _support.append(reason)
        if reason is None:
            netns.sweep_stale()  # namespaces left by runs that were SIGKILLed
    reason = _support[0]
    if reason is not None:
        if os.environ.get("AMPRL_REQUIRE_NETNS") == "1":
            pytest.fail(f"AMPRL_REQUIRE_NETNS=1 but {reason}")
        pytest.skip(reason)


@pytest.fixture
def netns_topology(request: pytest.FixtureRequest) -> Iterator[Callable[..., netns.Topology]]:
    """Factory: ``netns_topology(["ps", "learner"], subnet="10.231.0") -> Topology``."""
    require_netns()
    made: list[netns.Topology] = []
    request.node.stash[_TOPOLOGIES] = made

    def make(hosts: Sequence[str], **kwargs) -> netns.Topology:
        topo = netns.Topology(hosts, **kwargs)
        made.append(topo)
        return topo.create()

    yield make
    errors = []
    for topo in reversed(made):
        try:
            topo.close()
        except Exception as e:  # close the others first, then report
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed and call.when == "call":
        for topo in item.stash.get(_TOPOLOGIES, []):
            logs = topo.logs()
            if logs:
                report.sections.append((f"process logs of {topo.id}", logs))
    return report
