"""AMPRL_LOG_FORMAT=json: every log line of a service is one JSON object."""

import json
import logging
import os
import subprocess
import sys

from amprl.common.cli import JsonFormatter


def test_a_record_becomes_one_json_object_with_its_traceback():
    try:
        raise ValueError("bad value")
    except ValueError:
        record = logging.getLogger("amprl.replay").makeRecord(
            "amprl.replay", logging.ERROR, __file__, 1, "insert failed: %s", ("boom",),
            sys.exc_info())
    line = JsonFormatter("replay").format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert out["service"] == "replay" and out["level"] == "ERROR"
    assert out["logger"] == "amprl.replay" and out["message"] == "insert failed: boom"
    assert "ValueError: bad value" in out["exception"]
    assert out["time"].endswith("+00:00")


def test_a_service_started_with_the_json_format_logs_json_lines(tmp_path):
    # a bad config is reported as a log line too (and the process exits with status 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPRL_")}
    env.update(AMPRL_LOG_FORMAT="json", AMPRL_SET="paramserver.lr=-1")
    result = subprocess.run([sys.executable, "-m", "amprl.cli", "paramserver", "--port", "0"],
                            env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    records = [json.loads(line) for line in lines]  # every line is JSON, no traceback
    assert records[-1]["level"] == "ERROR" and records[-1]["service"] == "paramserver"
    assert "paramserver.lr: -1.0 must be > 0" in records[-1]["message"]
