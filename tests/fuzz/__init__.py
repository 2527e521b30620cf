"""Property-based tests of every RPC on live servers: random, mutated and undecodable
requests get an allowed status, the servers stay healthy and refused requests change
nothing (``hypothesis``; see ``harness.py`` and ``protofuzz.py``)."""
