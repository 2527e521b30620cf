"""bench/fleet.py: its raw-reply reader, and the real entry point with a tiny budget (one fleet
size, two-second phases, the real services and load generator)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from amprl.v1 import paramserver_pb2, replay_pb2, tensor_pb2

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_fleet", ROOT / "bench" / "fleet.py")
fleet = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fleet)

PER_N = ["insert_transitions_per_s", "sample_transitions_per_s", "insert_p50_ms", "insert_p99_ms",
         "sample_p99_ms", "health_p99_ms", "info_p99_ms", "resource_exhausted", "errors_other",
         "errors_by_code", "replay_rss_mb", "redis_used_mb", "learner_updates_per_s",
         "learner_updates_ratio_vs_no_pullers", "paramserver_bytes_per_pull",
         "paramserver_cpu_ms_per_pull", "pulls", "pull_interval_s"]


def test_top_fields_reads_a_pull_replys_version_without_parsing_its_tensors():
    reply = paramserver_pb2.PullParametersResponse(
        version=300, last=True, parameters=[tensor_pb2.CompressedTensor(name="w", shape=[2], data=b"\x01" * 4)])
    fields = fleet.top_fields(reply.SerializeToString())
    assert fields[1] == 300 and fields[4] == 1 and 2 not in fields  # unchanged: false, not sent
    unchanged = fleet.top_fields(paramserver_pb2.PullParametersResponse(version=7, unchanged=True,
                                                                        last=True).SerializeToString())
    assert (unchanged[1], unchanged[2], unchanged[4]) == (7, 1, 1)

    sample = replay_pb2.SampleResponse(keys=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[512]), size=9)
    keys = tensor_pb2.Tensor.FromString(bytes(fleet.top_fields(sample.SerializeToString())[2]))
    assert list(keys.shape) == [512]


@pytest.mark.slow
def test_a_tiny_fleet_run_prints_every_figure_for_its_fleet_size():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet.py"), "--fleet-sizes", "4",
                          "--seconds", "2", "--warmup-s", "1", "--atari-transitions", "2000",
                          "--pull-interval-s", "0.5"],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert not [k for k in result if k.endswith("load_generator_error")], out.stderr[-3000:]
    assert [k for k in PER_N if f"{k}_4" not in result] == []
    assert result["cpus"] >= 1 and "fleet.py" in result["command"] and result["date"]
    assert result["settings"]["samples_per_insert"] > 0  # the rate limiter is on
    # 4 actors leave the server's workers free: every kind of call got through
    assert result["insert_transitions_per_s_4"] > 0 and result["sample_transitions_per_s_4"] > 0
    assert result["learner_updates_per_s_4"] > 0 and result["learner_updates_per_s_no_pullers_4"] > 0
    assert result["health_p99_ms_4"] > 0 and result["info_p99_ms_4"] > 0
    assert result["pulls_4"] > 0
    assert result["paramserver_bytes_per_pull_4"] > 3e6  # the Nature CNN in bf16: ~6.6 MB
    assert result["errors_other_4"] == sum(e["count"] for e in result["errors_by_code_4"].values())
    assert result["atari_sample_transitions_per_s_b512"] > 0 and result["atari_transitions_stored"] >= 2000
