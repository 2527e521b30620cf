"""The faults of issue 32 against one running system, one after another; prints ONE JSON
object with a key per fault, each holding what it cost.

    python bench/faults.py [--faults kill_actor,partition_learner_paramserver,...]
                           [--partition-s 10] [--keep DIR]

The system and the faults are those of the fault suite (tests/faults/harness.py): on
loopback, a redis-server (AOF, appendfsync per replay.durability), replay, the parameter
server (checkpoints every 2 s), a learner, an evaluator and a CartPole actor as OS
processes, plus a ledger actor and a ledger learner that record every insert and push
acknowledged to them. Per fault:

  recovered_s        from the fault's end (restart, heal) until parameter version, env
                     steps and the ledger actor's inserts all advanced again
  lost_acknowledged  acknowledged chunks not in Redis
  duplicated         chunks stored more than once
  applied_twice      pushes applied beyond those acknowledged (or unknown, in flight)
  stalled            training did not resume within 60 s
  notes              per fault: exit codes, how far versions went back, errors seen ...

Faults (the default is all, in this order): kill_actor, kill_evaluator, kill_learner,
kill_replay, kill_paramserver, partition_learner_paramserver, partition_actor_replay,
partition_replies_* (the same links, only the replies cut: a one-way partition whose
requests are acted on and resent), kill_redis_everysec, kill_redis_always, redis_tail_lost (the AOF's last second cut: a
machine crash under everysec), redis_full, sigterm_<service> for each service, and
control_redis_wiped (Redis back without its data: the ledger must see a loss).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import testing_path  # noqa: E402,F401  (amprl_testing on the path)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "faults"))
from harness import FaultSystem  # noqa: E402

SERVICES = ("actor", "evaluator", "learner", "paramserver", "replay")


def faults(partition_s: float) -> dict:
    def durability(mode, then):
        def run(system):
            if system.durability != mode:
                system.restart_replay(mode)
            return then(system)
        return run

    table = {f"kill_{s}": (lambda s: lambda system: system.kill(s))(s)
             for s in ("actor", "evaluator", "learner", "replay")}
    table["kill_paramserver"] = lambda system: system.kill_paramserver()
    table["partition_learner_paramserver"] = lambda system: system.partition("learner-paramserver", partition_s)
    table["partition_actor_replay"] = lambda system: system.partition("actor-replay", partition_s)
    table["partition_replies_learner_paramserver"] = lambda system: system.partition(
        "learner-paramserver", partition_s, direction="down")
    table["partition_replies_actor_replay"] = lambda system: system.partition(
        "actor-replay", partition_s, direction="down")
    table["kill_redis_everysec"] = durability("everysec", lambda system: system.kill_redis())
    table["kill_redis_always"] = durability("always", lambda system: system.kill_redis())
    table["redis_tail_lost"] = durability("everysec", lambda system: system.kill_redis(cut_tail_s=1.0))
    table["redis_full"] = lambda system: system.redis_full()
    for s in SERVICES:
        table[f"sigterm_{s}"] = (lambda s: lambda system: system.sigterm(s))(s)
    table["control_redis_wiped"] = lambda system: system.kill_redis(wipe=True)
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="", help="comma-separated subset, in the order given")
    p.add_argument("--partition-s", type=float, default=10.0)
    p.add_argument("--keep", default="", help="keep the run folder (logs, ledgers) here")
    args = p.parse_args(argv)
    table = faults(args.partition_s)
    names = [n for n in args.faults.split(",") if n] or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown faults {unknown}; known: {', '.join(table)}")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="amprl-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    out: dict = {"date": time.strftime("%Y-%m-%d"), "partition_s": args.partition_s}
    t0 = time.monotonic()
    system = FaultSystem(root)
    try:
        system.start()
        out["startup_s"] = round(time.monotonic() - t0, 1)
        for name in names:
            result = table[name](system)
            out[name] = result.as_dict()
            print(f"{name}: {json.dumps(result.as_dict())}", file=sys.stderr, flush=True)
    finally:
        system.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
