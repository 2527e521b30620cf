"""A 10 s partition between an actor and replay: afterwards the actor's inserts go on by
themselves, and every insert replay acknowledged is stored exactly once (nothing lost,
nothing twice), checked against a ledger of what was acknowledged.

Real processes in two network namespaces: Redis and the replay service on "server", a
client on "actor" that inserts as the actor does (the real ReplayClient, numbered chunks,
jittered backoff, resend of what was not acknowledged) and tags every chunk's rewards with
its sequence number, so that what Redis holds can be matched against the ledger. The
partition takes the actor host's link down: packets are dropped both ways while the
connections stay open, and replay's keepalive (1 s here) has to notice.
"""

from __future__ import annotations

import collections
import json
import sys
import textwrap
import time

import pytest

from amprl.common.redis_server import redis_server_binary

REDIS_PORT, REPLAY_PORT = 6379, 7000
T = 8  # transitions per chunk

CLIENT = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from amprl import errors
    from amprl.common.backoff import Backoff
    from amprl.replay.client import ReplayClient
    from amprl_testing.replay import make_chunk, vector_spec

    address, ledger_path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    T = int(sys.argv[4])
    spec = vector_spec()
    client = ReplayClient(address)
    incarnation, seq = 4242, 0
    deadline = time.monotonic() + seconds
    codes = {}
    with open(ledger_path, "a") as ledger:
        while time.monotonic() < deadline:
            seq += 1
            chunk = make_chunk(spec, T, seed=seq, reward_base=seq * 1000)
            backoff = Backoff()
            while time.monotonic() < deadline + 30:  # the last chunk may finish late
                try:
                    client.insert("actor-0", [(chunk, np.ones(T, np.float32), T)], timeout=3,
                                  incarnation=incarnation, first_sequence=seq)
                    ledger.write(f"{seq} {time.time():.3f}\\n")  # acknowledged
                    ledger.flush()
                    break
                except errors.AmprlError as exc:
                    codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1
                    time.sleep(backoff.next())
            time.sleep(0.02)
    print(json.dumps({"chunks": seq, "errors": codes}))
""")

# Reads what Redis holds (from inside the server's namespace) and prints the rewards.
PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from amprl.config import ReplayConfig
    from amprl.replay.storage import ReplayStorage
    from amprl.replay.table import ReplayTable
    from amprl_testing.replay import vector_spec
    storage = ReplayStorage.from_url(sys.argv[1])
    table = ReplayTable(storage, vector_spec(), ReplayConfig(capacity=1_000_000))
    rewards = table.get(np.arange(table.oldest_key, table.next_key))["rewards"]
    print(json.dumps({"rewards": rewards.tolist(), "missing": table.missing}))
""")


@pytest.mark.slow
@pytest.mark.netns
def test_a_partition_between_an_actor_and_replay_loses_nothing_and_stores_nothing_twice(
        netns_topology, tmp_path):
    topo = netns_topology(["server", "actor"])
    server, actor = topo["server"], topo["actor"]
    py = sys.executable
    redis = server.exec([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(REDIS_PORT),
                         "--save", "", "--appendonly", "yes", "--dir", str(tmp_path)])
    server.wait_port(REDIS_PORT, "127.0.0.1", proc=redis)
    redis_url = f"redis://127.0.0.1:{REDIS_PORT}/0"
    replay = server.exec([py, "-m", "amprl.cli", "replay", "--spec-json", json.dumps(
        {"frame_shape": [4], "frame_dtype": "float32", "frame_stack": 1, "discrete": True,
         "num_actions": 3})], env={  # amprl_testing.replay.vector_spec
        "AMPRL_HOST": server.address, "AMPRL_PORT": str(REPLAY_PORT), "AMPRL_REDIS_URL": redis_url,
        "AMPRL_SET": "replay.capacity=1000000;replay.min_size_to_sample=1;replay.keepalive_s=1;"
                     "replay.max_abs_reward=1e12"})
    server.wait_port(REPLAY_PORT, proc=replay)
    ledger = tmp_path / "ledger.txt"
    client = actor.exec([py, "-c", CLIENT, f"{server.address}:{REPLAY_PORT}", str(ledger), "30",
                         str(T)])

    def acked() -> list[tuple[int, float]]:
        if not ledger.exists():
            return []
        lines = [line.split() for line in ledger.read_text().splitlines()]
        return [(int(f[0]), float(f[1])) for f in lines if len(f) == 2]  # a line half written: later

    deadline = time.monotonic() + 30
    while len(acked()) < 20:
        assert time.monotonic() < deadline, topo.read_log(client)
        time.sleep(0.2)
    with actor.partitioned():
        time.sleep(10)
        during = len(acked())
    healed = time.time()
    assert client.wait(90) == 0, topo.read_log(client)
    report = json.loads(topo.read_log(client).strip().splitlines()[-1])

    ledger_seqs = [s for s, _ in acked()]
    after = [s for s, t in acked() if t > healed]
    assert len(after) >= 20, f"the actor did not resume: {report}, {len(after)} acknowledged after"
    first_after = min(t for s, t in acked() if t > healed)
    # Keepalive and backoff bring it back: the first acknowledgement within 30 s of healing.
    assert first_after - healed < 30, first_after - healed
    assert len(set(ledger_seqs)) == len(ledger_seqs)  # the client acknowledged each once

    held = json.loads(server.run([py, "-c", PROBE, redis_url], timeout=60).stdout.strip()
                      .splitlines()[-1])
    # every transition's reward carries its chunk's sequence number (seq * 1000 + 0..T-1)
    copies = collections.Counter(int(r) // 1000 for r in held["rewards"])
    assert held["missing"] == 0
    twice = {seq: n for seq, n in copies.items() if n != T}
    assert not twice, f"chunks stored twice (or torn): {twice}"
    stored = set(copies)
    lost = set(ledger_seqs) - stored
    assert not lost, f"acknowledged but not stored: {sorted(lost)[:10]}"
    # what was stored but never acknowledged can only be the last call, cut off at the end
    assert len(stored - set(ledger_seqs)) <= 1
    assert during >= 20 and report["chunks"] > len(ledger_seqs) - 1
