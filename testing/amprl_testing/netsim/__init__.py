"""Network simulation for tests and benchmarks: a TCP delay relay (``relay``) and Linux
network-namespace topologies (``netns``) that place services on separate "hosts" with real
addresses and real latency on one machine. The pytest fixture lives in ``pytest_plugin``.
"""

__all__ = ["DelayRelay", "Host", "Topology"]


def __getattr__(name: str):
    # Lazy, so that `python -m amprl_testing.netsim.relay` does not import the module twice.
    if name == "DelayRelay":
        from amprl_testing.netsim.relay import DelayRelay
        return DelayRelay
    if name in ("Host", "Topology"):
        from amprl_testing.netsim import netns
        return getattr(netns, name)
    raise AttributeError(f"module 'amprl_testing.netsim' has no attribute {name!r}")
