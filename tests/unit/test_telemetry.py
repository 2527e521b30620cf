"""The series registry (``amprl.common.telemetry``) and its two sinks, Prometheus
(``amprl.common.metrics``) and TensorBoard (``amprl.common.tensorboard``), as plain Python:
a made-up service's stats read through both, the text exposition parsed back, the event
files read back with TensorBoard's own reader."""

from __future__ import annotations

import itertools
import time
import urllib.request
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from amprl.common import metrics, tensorboard
from amprl.common.bootstrap import ServiceProcess
from amprl.common.telemetry import Kind, Series, Telemetry, prometheus_name, tensorboard_tag


@dataclass
class Stats:
    updates: int = 0
    loss: float | None = None
    rejected: int = 0
    bytes_by_encoding: dict = field(default_factory=dict)
    reads: int = 0


def make_telemetry(stats: Stats, **extra) -> Telemetry[Stats]:
    def snapshot() -> Stats:
        stats.reads += 1
        return Stats(stats.updates, stats.loss, stats.rejected, dict(stats.bytes_by_encoding))

    return Telemetry("learner", snapshot=snapshot, step=lambda s: s.updates, series=[
        Series("updates", "Updates made.", Kind.THROUGHPUT, lambda s: s.updates),
        Series("loss", "Mean loss.", Kind.GAUGE, lambda s: s.loss),
        Series("rejected", "Pushes rejected.", Kind.COUNTER, lambda s: s.rejected),
        Series("bytes", "Bytes by encoding.", Kind.THROUGHPUT, lambda s: s.bytes_by_encoding,
               label="encoding"),
    ], **extra)


def scrape(registry) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a registry's text exposition."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# -- the registry -----------------------------------------------------------------------


def test_a_reading_takes_one_snapshot_for_every_series_and_leaves_out_those_without_a_value():
    stats = Stats(updates=7, rejected=2, bytes_by_encoding={"bf16": 100})
    t = make_telemetry(stats)
    reading = t.read()
    assert stats.reads == 1 and reading.step == reading.revision == 7
    values = {s.name: v for s, v in reading.values}
    assert values == {"updates": {"": 7.0}, "rejected": {"": 2.0}, "bytes": {"bf16": 100.0}}  # no loss yet


def test_a_series_that_fails_is_left_out_and_named_while_the_others_are_read():
    t = Telemetry("actor", snapshot=lambda: {"a": 1.0}, step=lambda d: 3, series=[
        Series("good", "A figure.", Kind.GAUGE, lambda d: d["a"]),
        Series("bad", "A figure that raises.", Kind.GAUGE, lambda d: d["missing"]),
    ])
    reading = t.read()
    assert [s.name for s, _ in reading.values] == ["good"]
    assert len(t.errors) == 1 and t.errors[0].startswith("bad: KeyError")


@pytest.mark.parametrize("bad", [
    dict(name="Loss"), dict(name="2fast"), dict(name="updates_total"), dict(name="q-max"),
    dict(name="bytes", label="Encoding"),
])
def test_series_names_are_prometheus_safe_and_a_counter_gets_its_total_from_the_sink(bad):
    with pytest.raises(ValueError):
        Series(**{"name": "x", "help": "h", "kind": Kind.GAUGE, "read": lambda s: 0.0, **bad})


def test_a_service_cannot_declare_a_series_twice():
    s = Series("loss", "h", Kind.GAUGE, lambda s: 0.0)
    with pytest.raises(ValueError, match="named twice"):
        Telemetry("learner", snapshot=lambda: None, step=lambda s: 0, series=[s, s])


def test_names_in_each_sink():
    s = Series("bytes", "h", Kind.THROUGHPUT, lambda s: {}, label="encoding")
    assert prometheus_name("paramserver", s) == "amprl_paramserver_bytes"
    assert tensorboard_tag("paramserver", s, "bf16", rate=True) == "paramserver/bytes_per_s/bf16"
    assert tensorboard_tag("learner", Series("loss", "h", Kind.GAUGE, lambda s: 0.0)) == "learner/loss"


# -- Prometheus -------------------------------------------------------------------------


def test_prometheus_serves_gauges_and_counters_with_their_labels_and_the_service_info():
    stats = Stats(updates=12, loss=0.5, rejected=3, bytes_by_encoding={"bf16": 2048, "fp32": 64})
    got = scrape(metrics.registry_for(make_telemetry(stats), "learner-0"))
    assert got[("amprl_learner_updates_total", ())] == 12
    assert got[("amprl_learner_loss", ())] == 0.5
    assert got[("amprl_learner_rejected_total", ())] == 3
    assert got[("amprl_learner_bytes_total", (("encoding", "bf16"),))] == 2048
    assert got[("amprl_learner_bytes_total", (("encoding", "fp32"),))] == 64
    assert got[("amprl_service_info", (("id", "learner-0"), ("service", "learner")))] == 1
    assert any(name == "process_cpu_seconds_total" for name, _ in got)  # the process's own


def test_prometheus_reads_the_stats_at_each_scrape():
    stats = Stats(updates=1)
    registry = metrics.registry_for(make_telemetry(stats), "learner-0")
    assert scrape(registry)[("amprl_learner_updates_total", ())] == 1
    stats.updates = 5
    assert scrape(registry)[("amprl_learner_updates_total", ())] == 5


def test_a_failing_snapshot_still_serves_the_process_and_rpc_series(caplog):
    def broken():
        raise RuntimeError("stats gone")

    t = Telemetry("replay", snapshot=broken, step=lambda s: 0,
                  series=[Series("size", "h", Kind.GAUGE, lambda s: 0.0)])
    got = scrape(metrics.registry_for(t, "replay"))
    assert not any(name.startswith("amprl_replay") for name, _ in got)
    assert ("amprl_service_info", (("id", "replay"), ("service", "replay"))) in got
    assert "reading the replay series failed" in caplog.text


@pytest.mark.parametrize("text, port", [("off", "off"), ("ANY", "any"), ("9090", 9090), (" 1 ", 1)])
def test_metrics_port_is_off_any_or_a_number(text, port):
    assert metrics.parse_port(text) == port


@pytest.mark.parametrize("text", ["0", "-1", "65536", "", "on", "90.5"])
def test_a_bad_metrics_port_names_the_choices(text):
    with pytest.raises(ValueError, match="off .*any .*port number"):
        metrics.parse_port(text)


def test_the_metrics_server_binds_any_free_port_and_stops(tmp_path):
    server = metrics.MetricsServer.start(make_telemetry(Stats(updates=4)), host="127.0.0.1",
                                         port="any", instance="learner-0")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        assert "amprl_learner_updates_total 4.0" in body
    finally:
        server.stop()


# -- TensorBoard ------------------------------------------------------------------------


def read_events(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_writes_each_series_at_the_step_and_rates_between_writes(tmp_path):
    clock = itertools.count(start=100.0, step=2.0)  # each write two seconds after the last
    stats = Stats(updates=10, loss=1.5, rejected=1, bytes_by_encoding={"onebit": 1000})
    writer = tensorboard.TensorBoardWriter(make_telemetry(stats), tmp_path / "tb" / "learner-0",
                                           clock=lambda: next(clock))
    assert writer.write()
    stats.updates, stats.loss, stats.bytes_by_encoding = 30, 0.5, {"onebit": 5000}
    assert writer.write()
    writer.close()
    events = read_events(tmp_path / "tb" / "learner-0")
    assert events["learner/loss"] == [(10, 1.5), (30, 0.5)]
    assert events["learner/rejected"] == [(10, 1.0), (30, 1.0)]  # a counter: its total
    assert events["learner/updates_per_s"] == [(30, pytest.approx(10.0))]  # (30 - 10) / 2 s
    assert events["learner/bytes_per_s/onebit"] == [(30, pytest.approx(2000.0))]
    assert "learner/updates" not in events  # a throughput is shown as its rate


def test_tensorboard_writes_nothing_while_the_step_stands_still(tmp_path):
    stats = Stats(updates=3, loss=1.0)
    writer = tensorboard.TensorBoardWriter(make_telemetry(stats), tmp_path)
    assert writer.write()
    stats.loss = 2.0
    assert not writer.write()  # a learner waiting for replay: no second value at step 3
    writer.close()
    assert read_events(tmp_path)["learner/loss"] == [(3, 1.0)]


def test_tensorboard_takes_a_new_revision_at_the_same_step_and_its_wall_time(tmp_path):
    evals = [(0, 9.0, 1_700_000_000.0)]  # (env steps, return, unix time)
    t = Telemetry("evaluator", snapshot=lambda: list(evals), step=lambda e: e[-1][0],
                  walltime=lambda e: e[-1][2], revision=lambda e: len(e),
                  series=[Series("return_mean", "h", Kind.GAUGE, lambda e: e[-1][1])])
    writer = tensorboard.TensorBoardWriter(t, tmp_path)
    assert writer.write()
    evals.append((0, 20.0, 1_700_000_060.0))  # the final evaluation, actors already stopped
    assert writer.write()
    assert not writer.write()
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    got = [(e.step, e.value, e.wall_time) for e in acc.Scalars("evaluator/return_mean")]
    assert got == [(0, 9.0, 1_700_000_000.0), (0, 20.0, 1_700_000_060.0)]


def test_tensorboard_survives_a_failing_read_and_writes_on_the_periodic_thread(tmp_path, caplog):
    stats = Stats(updates=1, loss=1.0)
    fail = {"now": True}

    def snapshot():
        if fail["now"]:
            raise RuntimeError("not yet")
        return Stats(stats.updates, stats.loss)

    t = Telemetry("learner", snapshot=snapshot, step=lambda s: s.updates,
                  series=[Series("loss", "h", Kind.GAUGE, lambda s: s.loss)])
    writer = tensorboard.TensorBoardWriter(t, tmp_path, every_s=0.05)
    assert not writer.write()
    assert "reading the learner series failed" in caplog.text
    fail["now"] = False
    writer.start()
    deadline = time.monotonic() + 10
    while writer._last is None and time.monotonic() < deadline:
        time.sleep(0.02)
    writer.close()
    assert read_events(tmp_path)["learner/loss"] == [(1, 1.0)]


# -- the process ------------------------------------------------------------------------


@pytest.mark.parametrize("argv, env, instance", [
    ([], {}, "replay"),                                    # the host name is not a name here
    (["--id", "actor-3"], {}, "actor-3"),
    ([], {"AMPRL_ID": "myrun-amprl-actor-7d9f"}, "myrun-amprl-actor-7d9f"),  # the pod name
])
def test_a_process_records_under_its_id_or_its_service_name(argv, env, instance, monkeypatch):
    monkeypatch.delenv("AMPRL_ID", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    proc = ServiceProcess("replay", "test")
    proc.parse(argv)
    assert proc.instance == instance


def test_the_metrics_port_flag_refuses_a_bad_value(capsys, monkeypatch):
    monkeypatch.setenv("AMPRL_METRICS_PORT", "sometimes")
    with pytest.raises(SystemExit) as exc:
        ServiceProcess("learner", "test").parse([])
    assert exc.value.code == 2 and "off (no /metrics), any" in capsys.readouterr().err
    monkeypatch.delenv("AMPRL_METRICS_PORT")
    assert ServiceProcess("learner", "test").parse([]).metrics_port == "off"
    assert ServiceProcess("learner", "test").parse(["--metrics-port", "9100"]).metrics_port == 9100


@pytest.mark.parametrize("tensorboard_mode", ["on", "off"])
def test_a_process_records_while_it_serves_where_its_flags_say(tmp_path, tensorboard_mode):
    proc = ServiceProcess("learner", "test")
    port_file = tmp_path / "metrics.port"
    proc.parse(["--id", "learner-0", "--run-dir", str(tmp_path), "--host", "127.0.0.1",
                "--metrics-port", "any", "--metrics-port-file", str(port_file),
                "--tensorboard", tensorboard_mode])
    proc.attach(object(), 50053, make_telemetry(Stats(updates=2, loss=0.25)))
    try:
        port = int(port_file.read_text())
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "amprl_learner_loss 0.25" in body and 'id="learner-0"' in body
    finally:
        proc.metrics.stop()
        if proc.tensorboard is not None:
            proc.tensorboard.close()
    folder = tmp_path / "tb" / "learner-0"
    if tensorboard_mode == "on":
        assert read_events(folder)["learner/loss"] == [(2, 0.25)]
    else:
        assert proc.tensorboard is None and not folder.exists()


def test_a_metrics_port_in_use_ends_the_process_with_one_line(caplog):
    taken = metrics.MetricsServer.start(None, host="127.0.0.1", port="any", instance="x")
    stopped = []
    try:
        proc = ServiceProcess("replay", "test")
        proc.parse(["--host", "127.0.0.1", "--metrics-port", str(taken.port)])
        with pytest.raises(SystemExit) as exc:
            proc.attach(SimpleNamespace(stop=lambda grace: stopped.append(grace)), 50051,
                        make_telemetry(Stats()))
    finally:
        taken.stop()
    assert exc.value.code == 2 and stopped == [0]
    assert f"--metrics-port {taken.port} (AMPRL_METRICS_PORT): cannot serve /metrics" in caplog.text


def test_a_restarted_process_writes_beside_the_earlier_one_not_over_it(tmp_path):
    from amprl.common import tensorboard

    first = tensorboard.run_folder(tmp_path, "actor-0")
    assert first == tmp_path / "tb" / "actor-0"
    first.mkdir(parents=True)
    (first / "events.out.tfevents.1.host.1").write_bytes(b"")
    second = tensorboard.run_folder(tmp_path, "actor-0")
    assert second == first / "restart-1"
    second.mkdir()
    (second / "events.out.tfevents.2.host.2").write_bytes(b"")
    assert tensorboard.run_folder(tmp_path, "actor-0") == first / "restart-2"
