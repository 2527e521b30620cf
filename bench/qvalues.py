"""The Q-values a DQN run's final weights hold in the states their greedy policy visits.

    python bench/qvalues.py runs/cartpole-dqn-20261205-041500 [RUN ...] [--episodes 10]

For each run folder: builds the network of the run's resolved ``config.yaml``, loads the
newest checkpoint in ``checkpoints/``, plays ``--episodes`` greedy episodes (env seeds
``--seed`` + i, apart from the evaluator's) and prints one JSON line per run: the greedy
mean return, the mean and largest max_a Q over the visited states, and the median action
gap (best minus second-best Q).

What it is for: telling a policy that ended low because its Q-function diverged from one
that is merely under-trained. With rewards of at most r per step and discount gamma, no
Q-value can exceed r / (1 - gamma) (CartPole: 100 at gamma 0.99, 200 at the default
config's 0.995); a mean far above that bound is over-estimation
(bench/results/cartpole-adam-eps-sweep.json), a mean well below it with a low return is a
policy that has not learnt yet.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from amprl.config import load_config  # noqa: E402
from amprl.envs.factory import env_spec  # noqa: E402
from amprl.envs.episodes import play  # noqa: E402
from amprl.paramserver.__main__ import checkpoint_dir  # noqa: E402
from amprl.paramserver.checkpoint import CheckpointManager  # noqa: E402
from amprl.algos import build_model  # noqa: E402


class RecordingGreedy:
    """Greedy actions of ``model`` that also keep max_a Q and the action gap of every
    observation they act on (the states the greedy policy visits)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.max_q: list[float] = []
        self.gaps: list[float] = []

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            q = self.model(torch.as_tensor(np.ascontiguousarray(obs))).float()
        top = q.topk(min(2, q.shape[1]), dim=1).values
        self.max_q.extend(top[:, 0].tolist())
        self.gaps.extend((top[:, 0] - top[:, -1]).tolist())
        return q.argmax(dim=1).numpy()


def load_final_model(run_dir: Path):
    """(config, env spec, model with the newest checkpoint's weights, checkpoint version)."""
    cfg = load_config(str(run_dir / "config.yaml"), [])
    if cfg.algo != "dqn":
        raise SystemExit(f"{run_dir}: algo {cfg.algo}; this script reads DQN Q-networks")
    ckpt_dir = checkpoint_dir(cfg, str(run_dir))
    files = CheckpointManager(ckpt_dir).files()
    if not files:
        raise SystemExit(f"{run_dir}: no checkpoint in {ckpt_dir}")
    state = CheckpointManager.read(files[0][1])
    spec = env_spec(cfg.env)
    model = build_model(cfg, spec)
    model.load_state_dict(state["params"], strict=True)
    model.eval()
    return cfg, spec, model, state["version"]


def q_report(run_dir: Path, episodes: int, seed: int) -> dict:
    cfg, spec, model, version = load_final_model(run_dir)
    policy = RecordingGreedy(model)
    returns = play(policy, spec, cfg.env, episodes, seed)
    return {"run": str(run_dir), "checkpoint_version": version, "episodes": episodes,
            "greedy_mean_return": round(float(np.mean(returns)), 1),
            "mean_max_q": round(float(np.mean(policy.max_q)), 2),
            "largest_max_q": round(float(np.max(policy.max_q)), 2),
            "median_action_gap": round(float(np.median(policy.gaps)), 4),
            "states": len(policy.max_q)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run folders written by amprl run")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=10_000, help="env seed of the first episode")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for run in args.runs:
        print(json.dumps(q_report(run, args.episodes, args.seed)), flush=True)


if __name__ == "__main__":
    main()
