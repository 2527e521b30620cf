"""Checkpoints: atomic files, resume of weights + Adam + version, keep N, corruption."""

import time

import pytest
import torch
from torch import nn

from amprl.errors import ConfigError
from amprl.paramserver.checkpoint import MAGIC, CheckpointManager, PeriodicCheckpointer
from amprl.paramserver.store import ParameterStore


def model(seed=0, width=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def grads(store, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in store.shapes.items()}


def trained_store(steps=3):
    store = ParameterStore.from_model(model(), lr=1e-2)
    for v in range(steps):
        store.apply(v, grads(store, v))
    return store


def test_resume_restores_weights_adam_state_and_version(tmp_path):
    store = trained_store(3)
    mgr = CheckpointManager(tmp_path, keep=2)
    path = mgr.save(store)
    assert path.name == "ckpt-000000000003.amprl" and store.checkpoint_version == 3
    fresh = ParameterStore.from_model(model(), lr=1e-2)
    assert CheckpointManager(tmp_path).restore(fresh) == 3
    assert fresh.version == 3 and fresh.checkpoint_version == 3
    # Continuing both gives identical weights only if the Adam moments and step counts
    # came back too.
    store.apply(3, grads(store, 42))
    fresh.apply(3, grads(fresh, 42))
    a, b = store.snapshot()[1], fresh.snapshot()[1]
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_resume_restores_the_momentum_of_preconditioned_steps(tmp_path):
    store = ParameterStore.from_model(model(), lr=1e-2)
    names = set(store.shapes)
    for v in range(3):
        store.apply(v, grads(store, v), preconditioned=names)
    CheckpointManager(tmp_path).save(store)
    fresh = ParameterStore.from_model(model(), lr=1e-2)
    CheckpointManager(tmp_path).restore(fresh)
    store.apply(3, grads(store, 42), preconditioned=names)
    fresh.apply(3, grads(fresh, 42), preconditioned=names)
    a, b = store.snapshot()[1], fresh.snapshot()[1]
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_resume_keeps_this_runs_learning_rate(tmp_path):
    CheckpointManager(tmp_path).save(trained_store(1))
    fresh = ParameterStore.from_model(model(), lr=5e-4)
    CheckpointManager(tmp_path).restore(fresh)
    assert fresh.optimizer.param_groups[0]["lr"] == 5e-4


def test_the_file_is_written_atomically_and_checksummed(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(trained_store(1))
    assert path.read_bytes()[:8] == MAGIC
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    # A crash mid-write leaves only a hidden .tmp, which restore ignores and save removes.
    (tmp_path / ".ckpt-000000000009.amprl.tmp").write_bytes(b"partial")
    fresh = ParameterStore.from_model(model())
    assert mgr.restore(fresh) == 1
    store = trained_store(2)
    mgr.save(store)
    assert not list(tmp_path.glob("*.tmp"))


def test_only_the_newest_n_are_kept(tmp_path):
    store = ParameterStore.from_model(model())
    mgr = CheckpointManager(tmp_path, keep=2)
    for v in range(4):
        store.apply(v, grads(store, v))
        mgr.save(store)
    assert [v for v, _ in mgr.files()] == [4, 3]


def test_an_unchanged_version_is_not_written_twice(tmp_path):
    store = trained_store(1)
    mgr = CheckpointManager(tmp_path)
    assert mgr.save(store) is not None
    assert mgr.save(store) is None
    assert mgr.save(store, force=True) is not None


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    store = ParameterStore.from_model(model(), lr=1e-2)
    mgr = CheckpointManager(tmp_path, keep=3)
    store.apply(0, grads(store, 0))
    mgr.save(store)
    at_v1 = store.snapshot()[1]
    store.apply(1, grads(store, 1))
    newest = mgr.save(store)
    raw = bytearray(newest.read_bytes())
    if damage == "truncate":
        newest.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "flip":
        raw[len(raw) - 100] ^= 0xFF
        newest.write_bytes(bytes(raw))
    elif damage == "empty":
        newest.write_bytes(b"")
    else:
        newest.write_bytes(b"not a checkpoint at all" * 10)
    fresh = ParameterStore.from_model(model(), lr=1e-2)
    assert mgr.restore(fresh) == 1
    restored = fresh.snapshot()[1]
    assert all(torch.equal(at_v1[n], restored[n]) for n in at_v1)


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    fresh = ParameterStore.from_model(model())
    assert CheckpointManager(tmp_path / "missing").restore(fresh) is None
    assert fresh.version == 0


def test_a_checkpoint_of_another_model_is_a_config_error(tmp_path):
    CheckpointManager(tmp_path).save(trained_store(1))
    other = ParameterStore.from_model(model(width=16))
    with pytest.raises(ConfigError, match="another model"):
        CheckpointManager(tmp_path).restore(other)


def test_periodic_checkpointer_saves_while_running(tmp_path):
    store = trained_store(1)
    mgr = CheckpointManager(tmp_path)
    p = PeriodicCheckpointer(mgr, store, interval_s=0.05).start()
    try:
        deadline = time.monotonic() + 5
        while not mgr.files() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        p.stop()
    assert [v for v, _ in mgr.files()] == [1]


def test_periodic_checkpointer_also_saves_after_a_number_of_versions(tmp_path):
    """With a version interval, a checkpoint follows every few versions long before the
    seconds interval is up: the loss bound is whichever comes first."""
    store = trained_store(1)
    mgr = CheckpointManager(tmp_path, keep=10)
    p = PeriodicCheckpointer(mgr, store, interval_s=3600, interval_versions=2).start()
    try:
        time.sleep(0.6)
        assert mgr.files() == []  # one version is not yet two
        store.apply(1, grads(store, 1))
        store.apply(2, grads(store, 2))
        deadline = time.monotonic() + 5
        while not mgr.files() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        p.stop()
    assert [v for v, _ in mgr.files()] == [3]
