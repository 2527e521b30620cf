"""--init-weights: a parameter server that starts from another run's weights (a state
dict from best/, or a checkpoint file), and refuses another network's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amprl.config import load_config
from amprl.errors import ConfigError
from amprl.paramserver.__main__ import init_weights
from amprl.paramserver.checkpoint import CheckpointManager, read_weights
from amprl.paramserver.service import build_store


def net(hidden: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def test_weights_come_from_a_state_dict_or_a_checkpoint_file(tmp_path):
    torch.manual_seed(1)
    source = net()
    torch.save({n: p.detach() for n, p in source.named_parameters()}, tmp_path / "weights-v7.pt")
    store = build_store(load_config(None, []), source)
    path = CheckpointManager(tmp_path / "ckpt").save(store)
    for file in (tmp_path / "weights-v7.pt", path):
        target = net()
        init_weights(target, str(file))
        for (name, p), q in zip(target.named_parameters(), source.parameters()):
            assert torch.equal(p, q), (file.name, name)


def test_another_networks_weights_are_a_config_error_naming_the_file(tmp_path):
    torch.save({n: p.detach() for n, p in net(8).named_parameters()}, tmp_path / "w.pt")
    with pytest.raises(ConfigError, match="--init-weights .*w.pt: not this config's network"):
        init_weights(net(4), str(tmp_path / "w.pt"))


def test_a_file_that_is_not_weights_is_a_config_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="notes.txt"):
        read_weights(tmp_path / "notes.txt")
    with pytest.raises(ConfigError, match="cannot read weights"):
        read_weights(tmp_path / "missing.pt")
