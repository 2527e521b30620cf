"""The parameter server as a real process: SIGTERM writes a final checkpoint, and a restart
resumes version, weights and Adam state."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from amprl.common.channels import wait_until_serving
from amprl.wire.compressed import encode
from amprl.paramserver.checkpoint import CheckpointManager
from amprl.paramserver.client import ParameterClient
from amprl.paramserver.store import ParameterStore


class PSProcess:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> str:
        port_file = self.run_dir / "paramserver.port"
        port_file.unlink(missing_ok=True)
        self.log = open(self.run_dir / "paramserver.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "amprl.paramserver", "--host", "127.0.0.1", "--port", "0",
             "--port-file", str(port_file), "--run-dir", str(self.run_dir), "--id", "paramserver",
             "--set", "paramserver.checkpoint_interval_s=3600", "--set", "paramserver.lr=0.01"],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "AMPRL_SET": ""})
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"paramserver did not start:\n{self.output()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        address = f"127.0.0.1:{self.port}"
        wait_until_serving(address, timeout_s=30)
        return address

    def output(self) -> str:
        return (self.run_dir / "paramserver.log").read_text(errors="replace")

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=30)
        self.log.close()
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None:
            self.log.close()


@pytest.fixture
def ps_process(tmp_path):
    p = PSProcess(tmp_path)
    yield p
    p.kill()


def grads(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [encode(n, torch.randn(s, generator=g), "fp32") for n, s in shapes.items()]


def test_sigterm_writes_a_final_checkpoint_and_a_restart_resumes(ps_process, tmp_path):
    address = ps_process.start()
    with ParameterClient(address, "learner-0") as client:
        version, initial = client.pull()
        assert version == 0
        shapes = {n: tuple(t.shape) for n, t in initial.items()}
        for v in range(3):
            assert client.push(v, grads(shapes, v)).version == v + 1
        _, before = client.pull()
    assert ps_process.terminate() == 0, ps_process.output()

    ckpt_dir = tmp_path / "checkpoints"
    files = CheckpointManager(ckpt_dir).files()
    assert [v for v, _ in files] == [3]
    state = CheckpointManager.read(files[0][1])
    assert all(int(s["step"]) == 3 for s in state["optimizer"]["state"].values())

    address = ps_process.start()
    assert "resumed from" in ps_process.output()
    with ParameterClient(address, "learner-0") as client:
        version, after = client.pull()
        assert version == 3
        assert all(torch.equal(before[n], after[n]) for n in before)
        # The next step continues Adam's moments: it matches a store restored from the
        # same checkpoint, and differs from one that kept the weights but lost Adam state.
        client.push(3, grads(shapes, 99))
        _, stepped = client.pull()
        info = client.info()
        assert info.version == 4 and info.checkpoint_version == 3
    ref = ParameterStore({n: torch.zeros(s) for n, s in shapes.items()}, lr=0.01)
    CheckpointManager(ckpt_dir).restore(ref)
    ref.apply(3, {m.name: torch.frombuffer(bytearray(m.data), dtype=torch.float32).view(shapes[m.name])
                  for m in grads(shapes, 99)})
    assert all(torch.allclose(stepped[n], ref.params[n].detach(), atol=1e-7) for n in shapes)
    amnesiac = ParameterStore(before, lr=0.01)
    amnesiac.version = 3
    amnesiac.apply(3, {m.name: torch.frombuffer(bytearray(m.data), dtype=torch.float32).view(shapes[m.name])
                       for m in grads(shapes, 99)})
    assert any(not torch.allclose(stepped[n], amnesiac.params[n].detach(), atol=1e-6) for n in shapes)
    assert ps_process.terminate() == 0
