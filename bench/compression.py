"""Bytes on the wire of one gradient push, 1-bit vs fp32, and codec speed.

Prints one JSON object:
  bytes_ratio_onebit_vs_fp32_{cartpole,td3,atari}  whole serialized PushGradientsRequest
      with the 1-bit encoding (error feedback, default block size and dense threshold)
      divided by the same request in fp32. Target for td3 and atari: <= 1/30.
  push_bytes_{fp32,onebit}_<model>, num_parameters_<model>, num_tensors_<model>
  encode_decode_ms_per_1m_elements[_<device>]  1-bit encode + decode of a 1M-element
      tensor (median of repeats), on CPU (and CUDA when present).

Models come from ``amprl.algos.build_model`` when it exists, else from the reference
definitions below (same layer sizes): CartPole dueling MLP 4-128-128 with 2 actions, TD3
actor + twin critics 256x256 for HalfCheetah (obs 17, act 6), Atari Nature-CNN dueling DQN
(4x84x84 input, 6 actions).

    python bench/compression.py [--block-size N] [--min-elements N] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from amprl.compression import DEFAULT_BLOCK_SIZE, DEFAULT_MIN_ELEMENTS  # noqa: E402
from amprl.v1 import paramserver_pb2  # noqa: E402
from amprl.wire.compressed import ErrorFeedback, decode, encode  # noqa: E402


class DuelingHead(nn.Module):
    def __init__(self, width: int, hidden: int, num_actions: int):
        super().__init__()
        if hidden:
            self.value = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))
            self.advantage = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(),
                                           nn.Linear(hidden, num_actions))
        else:
            self.value = nn.Linear(width, 1)
            self.advantage = nn.Linear(width, num_actions)

    def forward(self, h):
        a = self.advantage(h)
        return self.value(h) + a - a.mean(dim=-1, keepdim=True)


def reference_cartpole() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         DuelingHead(128, 0, 2))


def reference_td3(obs: int = 17, act: int = 6, hidden: int = 256) -> nn.Module:
    def mlp(i, o):
        return nn.Sequential(nn.Linear(i, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                             nn.ReLU(), nn.Linear(hidden, o))
    m = nn.Module()
    m.actor = nn.Sequential(mlp(obs, act), nn.Tanh())
    m.critic1 = mlp(obs + act, 1)
    m.critic2 = mlp(obs + act, 1)
    return m


def reference_atari(num_actions: int = 6) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(),
        DuelingHead(3136, 512, num_actions))


def project_models() -> dict[str, nn.Module] | None:
    """The project's own models, if amprl.algos.build_model exists."""
    try:
        import numpy as np

        from amprl.algos import build_model
        from amprl.config import config_from_dict
        from amprl.envs.spec import EnvSpec
    except ImportError:
        return None
    try:
        cartpole = build_model(config_from_dict({}), EnvSpec((4,), np.dtype(np.float32), 1, True, 2))
        td3 = build_model(config_from_dict({"algo": "td3", "env": {"id": "HalfCheetah-v5"},
                                            "network": {"hidden_sizes": [256, 256]}}),
                          EnvSpec((17,), np.dtype(np.float32), 1, False, action_dim=6,
                                  action_low=(-1.0,) * 6, action_high=(1.0,) * 6))
        atari = build_model(config_from_dict({"env": {"id": "ALE/Pong-v5", "frame_stack": 4}}),
                            EnvSpec((84, 84), np.dtype(np.uint8), 4, True, 6))
    except Exception as exc:  # noqa: BLE001 - a model still in progress: fall back, say so
        print(f"note: amprl.algos.build_model failed ({exc}); using reference models",
              file=sys.stderr)
        return None
    return {"cartpole": cartpole, "td3": td3, "atari": atari}


def push_bytes(model: nn.Module, encoding: str, block_size: int, min_elements: int) -> int:
    ef = ErrorFeedback(encoding, block_size=block_size, min_elements=min_elements)
    grads = {name: torch.randn_like(p) * 1e-3 for name, p in model.named_parameters()}
    ef.encode(grads)  # a second step, so residuals are in play as in training
    msgs = ef.encode(grads)
    req = paramserver_pb2.PushGradientsRequest(learner_id="learner-0", base_version=123_456,
                                               gradients=msgs, batch_size=256)
    return req.ByteSize()


def codec_ms(device: str, repeats: int, block_size: int) -> float:
    x = torch.randn(1_000_000, device=device)
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        y = decode(encode("w", x, "onebit", block_size), device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # warm-up
            times.append((time.perf_counter() - t) * 1000)
        del y
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--min-elements", type=int, default=DEFAULT_MIN_ELEMENTS)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (the learner's default deploy.learner_torch_threads is 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = project_models()
    out: dict = {"models": "amprl.algos" if models else "reference (bench/compression.py)",
                 "block_size": args.block_size, "min_elements": args.min_elements}
    models = models or {"cartpole": reference_cartpole(), "td3": reference_td3(),
                        "atari": reference_atari()}
    for key, model in models.items():
        fp32 = push_bytes(model, "fp32", args.block_size, args.min_elements)
        one = push_bytes(model, "onebit", args.block_size, args.min_elements)
        out[f"bytes_ratio_onebit_vs_fp32_{key}"] = round(one / fp32, 5)
        out[f"bytes_ratio_inverse_{key}"] = round(fp32 / one, 2)
        out[f"push_bytes_fp32_{key}"] = fp32
        out[f"push_bytes_onebit_{key}"] = one
        out[f"num_parameters_{key}"] = sum(p.numel() for p in model.parameters())
        out[f"num_tensors_{key}"] = len(list(model.parameters()))
    out["torch_threads"] = torch.get_num_threads()
    out["encode_decode_ms_per_1m_elements"] = round(codec_ms("cpu", args.repeats, args.block_size), 3)
    if torch.cuda.is_available():
        out["encode_decode_ms_per_1m_elements_cuda"] = round(
            codec_ms("cuda", args.repeats, args.block_size), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
