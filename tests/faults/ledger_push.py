"""A learner that keeps a ledger: pulls the newest weights and pushes a small numbered
gradient computed "on" them, through the real ParameterClient (which numbers each push and
resends it on UNAVAILABLE until its deadline), appending a line per event:

    V <incarnation> <version> <unix time>   a pull saw this version of that server life
    S <seq> <unix time>                     push <seq> is about to be sent
    A <seq> <incarnation> <version> <repeat 0|1> <unix time>   applied (acknowledged)
    R <seq> <unix time>                     refused (stale): not applied
    U <seq> <unix time> <error>             fate unknown (the client gave up on it)

The server counts the steps it applied per learner id (Info.steps_applied_by_learner); for
one server life that count must lie between the pushes acknowledged and those plus the ones
whose fate is unknown or still in flight: more means a push was applied twice.

    python ledger_push.py PARAMSERVER_ADDRESS LEDGER_PATH [--pull-from ADDRESS] [--rate PUSHES_PER_S]

Pulls go to --pull-from (default: the same address), so a link cut on the push path
catches a push, not a pull, in flight.

Runs until SIGTERM, then finishes the push in hand and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

import torch

from amprl import errors
from amprl.paramserver.client import ParameterClient
from amprl.wire.compressed import encode

LEARNER_ID = "learner-ledger"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("ledger")
    p.add_argument("--pull-from", default="")
    p.add_argument("--rate", type=float, default=5.0)
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = ParameterClient(args.address, LEARNER_ID, timeout_s=60)
    puller = ParameterClient(args.pull_from, LEARNER_ID, timeout_s=60) if args.pull_from else client
    version, incarnation, shapes = 0, 0, {}
    seq = 0
    with open(args.ledger, "a", buffering=1) as ledger:
        while not stop.is_set():
            try:
                pulled = puller.pull_versioned(version, incarnation, timeout=30)
            except errors.AmprlError as exc:
                ledger.write(f"E pull {time.time():.3f} {type(exc).__name__}\n")
                stop.wait(0.5)
                continue
            version, incarnation = pulled.version, pulled.incarnation
            if pulled.weights is not None:
                shapes = {n: w.shape for n, w in pulled.weights.items()}
            ledger.write(f"V {incarnation} {version} {time.time():.3f}\n")
            # tiny gradients: the ledger's pushes barely move the weights the learner trains
            grads = [encode(n, torch.full(s, 1e-6), "fp32") for n, s in shapes.items()]
            seq += 1  # the client's own numbering: one per push call, from 1
            ledger.write(f"S {seq} {time.time():.3f}\n")
            try:
                reply = client.push(version, grads, batch_size=1, timeout=60)
                ledger.write(f"A {seq} {reply.incarnation} {reply.version} {int(reply.repeat)} "
                             f"{time.time():.3f}\n")
            except errors.FailedPrecondition:
                ledger.write(f"R {seq} {time.time():.3f}\n")
            except errors.AmprlError as exc:
                ledger.write(f"U {seq} {time.time():.3f} {type(exc).__name__}\n")
            stop.wait(1.0 / args.rate)
    client.close()
    puller.close()


if __name__ == "__main__":
    main()
