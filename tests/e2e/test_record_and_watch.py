"""End to end: what a short CartPole `amprl run` records. While it runs, every service's
`/metrics` (listed in services.json) is scraped over HTTP and holds its series with sane
values; once it has stopped, RUN/tb/ holds one folder of TensorBoard event files per
service with the named tags, read back with TensorBoard's own reader."""

from __future__ import annotations

import json
import math
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow

SERVICES = ["replay", "paramserver", "learner", "actor-0", "actor-1", "evaluator"]


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted labels: value}} of one GET /metrics."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(got: dict, name: str, **labels) -> float:
    return got[name][tuple(sorted(labels.items()))]


def rpcs(got: dict, method: str, code: str = "OK") -> float:
    return sum(v for labels, v in got.get("grpc_server_handled_total", {}).items()
               if dict(labels)["grpc_method"] == method and dict(labels)["grpc_code"] == code)


def live_enough(m: dict[str, dict]) -> bool:
    """Every figure the checks below read has moved past its start."""
    try:
        return (value(m["learner"], "amprl_learner_updates_total") >= 60
                and value(m["evaluator"], "amprl_evaluator_evaluations_total") >= 1
                and rpcs(m["paramserver"], "PushGradients") > 0 and rpcs(m["replay"], "Sample") > 0)
    except KeyError:
        return False


@pytest.fixture(scope="module")
def recorded(amprl_run_module, tmp_path_factory):
    """(the last scrape of every service during the run, its services.json, the run folder)."""
    run_dir = tmp_path_factory.mktemp("record-and-watch") / "run"
    run = amprl_run_module.start(["configs/cartpole-dqn.yaml", "--run-dir", str(run_dir),
                                  "--set", "run.total_env_steps=8000", "--set", "run.max_wall_seconds=120",
                                  "--set", "evaluator.interval_s=1", "--progress-interval", "5"])
    deadline = time.monotonic() + 180
    while not (run_dir / "services.json").exists():
        assert run.alive() and time.monotonic() < deadline, f"the services never came up:\n{run.log()[-3000:]}"
        time.sleep(0.2)
    services = json.loads((run_dir / "services.json").read_text())
    while True:
        assert run.alive() and time.monotonic() < deadline, f"the run ended before it had trained:\n{run.log()[-3000:]}"
        scraped = {name: scrape(s["metrics"]) for name, s in services.items()}
        if live_enough(scraped):
            break
        time.sleep(0.5)
    code, out = amprl_run_module.finish(run, timeout_s=240)
    assert code == 0, out[-4000:]
    return scraped, services, run_dir


def test_every_service_lists_its_metrics_url_and_names_itself_there(recorded):
    scraped, services, _ = recorded
    assert list(services) == SERVICES
    for name, got in scraped.items():
        assert services[name]["metrics"].startswith("http://127.0.0.1:"), name
        (labels,) = got["amprl_service_info"]
        assert dict(labels)["id"] == name.replace("learner", "learner-0"), labels
        assert value(got, "process_cpu_seconds_total") > 0
        assert value(got, "process_resident_memory_bytes") > 10e6


def test_the_learner_and_the_parameter_server_show_training_with_sane_figures(recorded):
    scraped, _, _ = recorded
    lr, ps = scraped["learner"], scraped["paramserver"]
    assert math.isfinite(value(lr, "amprl_learner_loss")) and value(lr, "amprl_learner_loss") >= 0
    q_mean, q_max = value(lr, "amprl_learner_q_mean"), value(lr, "amprl_learner_q_max")
    assert q_max >= q_mean and q_max < 1 / (1 - 0.995) + 1  # r = 1 per step: Q <= 1 / (1 - gamma)
    assert value(lr, "amprl_learner_grad_norm") > 0
    assert value(lr, "amprl_learner_loss_scale") == 0  # fp32: no GradScaler
    assert value(lr, "amprl_learner_skipped_nonfinite_total") == 0
    assert value(lr, "amprl_learner_push_stale_rejections_total") == 0
    assert value(lr, "amprl_learner_pushes_applied_total") > 0
    # scraped moments apart, and a local_replica learner runs ahead of the server by design
    assert value(ps, "amprl_paramserver_version") > 0 and value(lr, "amprl_learner_param_version") > 0
    assert value(ps, "amprl_paramserver_pushes_applied_total") > 0
    assert value(ps, "amprl_paramserver_pushes_rejected_norm_total") == 0
    assert 0 < value(ps, "amprl_paramserver_push_norm_bound") < math.inf
    # the config pushes bf16 (grad_encoding), small tensors too; weights go out in fp32
    assert value(ps, "amprl_paramserver_gradient_bytes_received_total", encoding="bf16") > 0
    assert value(ps, "amprl_paramserver_weight_bytes_sent_total", encoding="fp32") > 0
    assert value(ps, "amprl_paramserver_learners_live") == 1 and value(ps, "amprl_paramserver_actors_live") == 2
    assert rpcs(ps, "PushGradients") > 0 and rpcs(ps, "PullParameters") > 0
    assert sum(v for labels, v in ps["grpc_server_handling_seconds_count"].items()
               if dict(labels)["grpc_method"] == "PushGradients") >= rpcs(ps, "PushGradients")


def test_replay_actors_and_evaluator_show_their_figures(recorded):
    scraped, _, _ = recorded
    rp = scraped["replay"]
    assert 0 < value(rp, "amprl_replay_size") <= value(rp, "amprl_replay_inserted_total")
    assert value(rp, "amprl_replay_capacity") == 100_000
    assert value(rp, "amprl_replay_sampled_total") > 0
    # an actor counts once its first chunk is stored, which the rate limiter may still hold
    assert 1 <= value(rp, "amprl_replay_actors_live") <= 2
    assert value(rp, "amprl_replay_rate_limiter_sample_wait_seconds_total") >= 0
    assert value(rp, "amprl_replay_redis_used_memory_bytes") > 0
    assert rpcs(rp, "Sample") > 0 and rpcs(rp, "UpdatePriorities") > 0
    for actor in ("actor-0", "actor-1"):
        a = scraped[actor]
        assert value(a, "amprl_actor_env_steps_total") > 0
        assert 0 <= value(a, "amprl_actor_epsilon") <= 1
    ev = scraped["evaluator"]
    assert value(ev, "amprl_evaluator_return_mean") >= 8  # CartPole never ends in under 8 steps
    assert value(ev, "amprl_evaluator_wall_seconds") > 0


TAGS = {
    "learner-0": ["learner/loss", "learner/q_mean", "learner/q_max", "learner/grad_norm",
                  "learner/loss_scale", "learner/skipped_nonfinite", "learner/push_staleness",
                  "learner/push_stale_rejections", "learner/updates_per_s"],
    "replay": ["replay/size", "replay/inserted_per_s", "replay/sampled_per_s",
               "replay/rate_limiter_sample_wait_seconds", "replay/rate_limiter_waiting_inserts"],
    "actor-0": ["actor/env_steps_per_s", "actor/episode_return"],
    "actor-1": ["actor/env_steps_per_s", "actor/episode_return"],
    "evaluator": ["evaluator/return_mean", "evaluator/wall_seconds"],
    "paramserver": ["paramserver/version", "paramserver/pushes_applied_per_s",
                    "paramserver/pushes_rejected_norm", "paramserver/push_norm_bound",
                    "paramserver/gradient_bytes_received_per_s/bf16"],
}


def events(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def test_tensorboard_has_each_service_with_the_named_tags_on_its_step_axis(recorded):
    _, _, run_dir = recorded
    assert sorted(p.name for p in (run_dir / "tb").iterdir()) == sorted(TAGS)
    for folder, tags in TAGS.items():
        acc = events(run_dir / "tb" / folder)
        missing = set(tags) - set(acc.Tags()["scalars"])
        assert not missing, f"{folder}: {sorted(missing)} not in {sorted(acc.Tags()['scalars'])}"
    learner = events(run_dir / "tb" / "learner-0")
    steps = [e.step for e in learner.Scalars("learner/grad_norm")]
    assert steps == sorted(set(steps)) and steps[-1] > 0  # versions, one point per step
    assert all(e.value > 0 for e in learner.Scalars("learner/updates_per_s"))
    actor = events(run_dir / "tb" / "actor-0")
    assert all(e.value > 0 for e in actor.Scalars("actor/env_steps_per_s"))


def test_tensorboard_has_every_evaluation_at_its_env_steps_and_wall_time(recorded):
    _, _, run_dir = recorded
    history = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    written = events(run_dir / "tb" / "evaluator").Scalars("evaluator/return_mean")
    assert [(e.step, e.value) for e in written] == [(h["env_steps"], pytest.approx(h["mean_return"]))
                                                     for h in history]
    assert [e.wall_time for e in written] == [pytest.approx(h["unix_time"]) for h in history]
