"""The algorithms, one folder each (Acme's agents are the model): its config section
(``config.py``), networks (``networks.py``), losses (``losses.py``), the learner's side
(``learning.py``, an ``amprl.core.Algorithm``), the actors' and the evaluator's side
(``acting.py``: ``amprl.core.Behaviour`` and ``Policy``), and ``builder.py``, which makes
them for a run. What the algorithms share (network blocks, ``Batch``, target networks, the
acting fast path, exploration and seeds) is in ``amprl.rl``.

``ALGOS`` is the registry: the learner, actors, evaluator and parameter server get the parts
of ``cfg.algo`` from it instead of branching on the name. Another algorithm is a folder like
``dqn/``, a line in ``ALGOS``, and its section in ``ExperimentConfig``, named after it
(``algo`` lists the names; tests/unit/algos/test_registry.py checks they agree).

This module and each ``config.py`` import no torch, so loading a config stays light; a
builder is imported when first asked for. The config package's sections import each
``config.py``, so ``amprl.config`` is imported here first, whichever of the two a program
imports first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, cast

import amprl.config  # noqa: F401  (first: see above)
from amprl.algos.dqn.config import DQNConfig
from amprl.algos.td3.config import TD3Config
from amprl.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from amprl.config import ExperimentConfig
    from amprl.core import Algorithm, Behaviour, Policy
    from amprl.envs.spec import EnvSpec


class Builder(Protocol):
    """What an algorithm's ``builder.py`` gives, as module functions."""

    def build_model(self, cfg: ExperimentConfig, spec: EnvSpec) -> torch.nn.Module: ...

    def make_learner(self, cfg: ExperimentConfig, model: torch.nn.Module,
                     device: torch.device) -> Algorithm: ...

    def make_behaviour(self, cfg: ExperimentConfig, spec: EnvSpec, model: torch.nn.Module,
                       actor_id: str, rng: np.random.Generator) -> Behaviour: ...

    def make_greedy_policy(self, model: torch.nn.Module) -> Policy: ...


class Entry(NamedTuple):
    config: type
    """The config section's dataclass; its key in the experiment YAML is the algorithm's name."""
    builder: str
    """The module of the algorithm's ``Builder`` (imported on first use: it needs torch)."""
    actions: Literal["discrete", "continuous"]
    """The action space it acts in (``check_action_space``)."""


ALGOS: dict[str, Entry] = {
    "dqn": Entry(DQNConfig, "amprl.algos.dqn.builder", "discrete"),
    "td3": Entry(TD3Config, "amprl.algos.td3.builder", "continuous"),
}


def check_action_space(algo: str, spec: EnvSpec, env_id: str = "") -> None:
    """ConfigError, naming an algorithm that fits, where ``algo`` cannot act in the action
    space of ``spec`` (the environment ``env_id``)."""
    wants = ALGOS[algo].actions
    has = "discrete" if spec.discrete else "continuous"
    if wants != has:
        fits = [name for name, entry in ALGOS.items() if entry.actions == has]
        env = f"env.id {env_id!r}" if env_id else "the environment"
        raise ConfigError(f"algo: {algo} needs a {wants} action space, and {env} has {has} "
                          f"actions" + (f"; use algo: {fits[0]}" if fits else ""))


def builder(name: str) -> Builder:
    """The builder of algorithm ``name``."""
    if name not in ALGOS:
        raise ValueError(f"algo: unknown algorithm {name!r} (known: {', '.join(ALGOS)})")
    return cast(Builder, importlib.import_module(ALGOS[name].builder))


def build_model(cfg: ExperimentConfig, spec: EnvSpec) -> torch.nn.Module:
    """The network of ``cfg.algo`` for ``spec``; deterministic given ``torch.manual_seed``.

    The one constructor every process calls, so the learner, the actors, the evaluator and
    the parameter server agree on the architecture and on the parameter names (the
    parameter server's wire names).
    """
    return builder(cfg.algo).build_model(cfg, spec)
