"""An actor that keeps a ledger: inserts numbered, tagged chunks into replay as an actor
does (the real ReplayClient, one incarnation, sequence numbers, jittered backoff, the same
chunk resent until replay acknowledges it) and appends a line per event to a ledger file:

    A <seq> <unix time>             replay acknowledged chunk <seq> (it must be stored once)
    E <error name> <unix time> <message>   an insert failed (it is resent)

Every transition of chunk <seq> carries reward (seq * 64 + j) * 2**-24, j = 0..T-1: exact in
float32 and below 1, so a reader of Redis can tell these chunks from an environment's
(CartPole's n-step rewards are >= 1) and count the copies of each.

    python ledger_insert.py REPLAY_ADDRESS LEDGER_PATH [--rate CHUNKS_PER_S]

Runs until SIGTERM, then finishes the chunk in hand (acknowledged or not) and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

import numpy as np

from amprl import errors
from amprl.common.backoff import Backoff
from amprl.envs.spec import EnvSpec
from amprl.replay.client import ReplayClient
from amprl_testing.replay import make_chunk

T = 8  # transitions per chunk (at most 64: see the reward tag)
TAG = 2.0 ** -24


def tag_of(reward: float) -> tuple[int, int]:
    """(seq, j) of a tagged reward."""
    v = int(round(float(reward) / TAG))
    return v // 64, v % 64


def cartpole_spec() -> EnvSpec:
    return EnvSpec((4,), np.dtype(np.float32), 1, True, num_actions=2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("ledger")
    p.add_argument("--rate", type=float, default=20.0)
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = ReplayClient(args.address)
    spec = cartpole_spec()
    incarnation, seq = int(time.time() * 1000) % (2**31) + 1, 0
    with open(args.ledger, "a", buffering=1) as ledger:
        while not stop.is_set():
            seq += 1
            chunk = make_chunk(spec, T, seed=seq)
            chunk.rewards[:] = ((seq * 64 + np.arange(T)) * TAG).astype(np.float32)
            backoff = Backoff()
            while True:
                try:
                    client.insert("actor-ledger", [(chunk, np.ones(T, np.float32), T)],
                                  timeout=5, incarnation=incarnation, first_sequence=seq)
                    ledger.write(f"A {seq} {time.time():.3f}\n")
                    break
                except errors.AmprlError as exc:
                    message = str(exc).replace("\n", " ")[:300]
                    ledger.write(f"E {type(exc).__name__} {time.time():.3f} {message}\n")
                    if stop.wait(backoff.next()):
                        break
            stop.wait(1.0 / args.rate)
    client.close()


if __name__ == "__main__":
    main()
