"""CartPole trains with the parameter server 150 ms (one way) from the learner.

Two network namespaces: "ps" holds the parameter server alone; "learner" holds Redis,
replay, the learner, the actors and the evaluator (``bench/wanrun.py --paramserver``, run
inside the namespace). Every connection to the server crosses a DelayRelay in the switch
namespace adding 150 ms each way: a 300 ms round trip on real sockets between real
interfaces. Nothing in the host namespace dials a namespace address: Info is asked from
inside "learner".

Bounds (configs/cartpole-dqn-wan.yaml: sync: local_replica, a window of 48 pushes):
  * a push round trip through the relay takes >= 300 ms (the delay is real);
  * versions advance at >= 5/s (training progresses) and at most window / RTT = 48 / 0.3
    = 160/s (+25% slack): the window bounds optimizer steps per round trip;
  * every push is applied at staleness 0 (the learner computes each gradient on the
    weights the server will hold when it arrives) and none is rejected;
  * the greedy policy learns: its eval return reaches 150 (untrained: ~9-10) within 240 s
    of training. ``bench/cartpole.py --config configs/cartpole-dqn-wan.yaml --rtt-ms 300``
    measures solving (475).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from amprl.config import dump_config, load_config

ROOT = Path(__file__).resolve().parents[3]
ONE_WAY_MS = 150
PS_PORT = 50051
THRESHOLD = 150.0

_TIME_INFO = """
import sys, time
from amprl.paramserver.client import ParameterClient
with ParameterClient(sys.argv[1], client_id="probe") as c:
    c.info(timeout=30)                      # connect first
    t = time.monotonic(); info = c.info(timeout=30)
    print((time.monotonic() - t) * 1000, info.version)
"""


_INFO_JSON = """
import sys
from google.protobuf.json_format import MessageToDict
from amprl.paramserver.client import ParameterClient
import json
with ParameterClient(sys.argv[1], client_id="probe") as c:
    print(json.dumps(MessageToDict(c.info(timeout=30), preserving_proto_field_name=True)))
"""


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(290)
def test_cartpole_learns_with_a_300ms_round_trip_to_the_parameter_server(netns_topology, tmp_path):
    cfg = load_config(ROOT / "configs/cartpole-dqn-wan.yaml", [
        f"run.target_return={THRESHOLD}", "run.stop_at_target=true", "run.max_wall_seconds=240",
        "paramserver.checkpoint_interval_s=0"])
    dump_config(cfg, tmp_path / "config.yaml")
    window = cfg.learner.max_pushes_in_flight or cfg.paramserver.max_staleness // 2
    topo = netns_topology(["ps", "learner"])
    ps = topo["ps"].exec([sys.executable, "-m", "amprl.paramserver", "--config", str(tmp_path / "config.yaml"),
                          "--run-dir", str(tmp_path / "ps"), "--host", topo["ps"].address,
                          "--port", str(PS_PORT)])
    topo["ps"].wait_port(PS_PORT, proc=ps, timeout=120)
    ps_addr = topo.delay("learner", "ps", PS_PORT, delay_ms=ONE_WAY_MS)

    rtt_ms, _ = topo["learner"].run([sys.executable, "-c", _TIME_INFO, ps_addr], timeout=90).stdout.split()
    assert float(rtt_ms) >= 2 * ONE_WAY_MS

    run_dir = tmp_path / "run"
    driver = topo["learner"].exec([sys.executable, str(ROOT / "bench/wanrun.py"), str(tmp_path / "config.yaml"),
                                   "--run-dir", str(run_dir), "--paramserver", ps_addr,
                                   "--progress-interval", "10"], cwd=ROOT)
    assert driver.wait(timeout=360) == 0, topo.read_log(driver)
    summary = json.loads((run_dir / "summary.json").read_text())
    log = topo.read_log(driver)
    assert summary["best_eval_return"] >= THRESHOLD, log
    assert summary["stop_reason"] == "target reached", log
    train_s = summary["wall_seconds"]
    rate = summary["param_version"] / train_s
    assert 5.0 <= rate <= 1.25 * window / (2 * ONE_WAY_MS / 1000), (rate, log)
    assert summary["updates"] >= summary["param_version"]
    assert summary["learner_q_mean"] > 0, summary  # rewards of +1: a trained learner's Q is positive
    info = json.loads(topo["learner"].run([sys.executable, "-c", _INFO_JSON, ps_addr], timeout=90).stdout)
    assert info.get("max_staleness", 0) == 0, info
    assert info.get("pushes_rejected_stale", 0) == 0, info
