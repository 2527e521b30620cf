"""``amprl fetch --evaluator HOST:PORT DIR``: a live run's results, as a run folder.

On a cluster the evaluator keeps a run's results on its volume and serves them over gRPC
(reach it with ``kubectl port-forward``; with mutual TLS, dial with the operator
certificate: ``--certs DIR`` as ``amprl certs DIR`` makes it, or AMPRL_TLS_CERT_DIR).
This writes them into DIR the way ``amprl run`` lays out its run folder:

    DIR/eval.jsonl     every evaluation (EvaluatorService.Info)
    DIR/best/          best.json, config.yaml, weights-v<N>.pt: the best-scoring weights
                       with the config that rebuilds their network (GetBestPolicy)
    DIR/config.yaml    the experiment config (the same as best/config.yaml)
    DIR/summary.json   once the run has finished: its summary (Info.summary_json)
    DIR/end.json       the run's state: phase, stop reason, env steps, wall time

so that ``amprl plot DIR``, ``amprl export DIR -o policy.pt`` and ``amprl enjoy DIR`` use
it as they use a local run's folder. The run's newest weights are the parameter server's:
``amprl export --paramserver HOST:PORT --config DIR/config.yaml -o final.pt``.
Prints one JSON line: what was written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from amprl import errors
from amprl.common import runend

EVAL_FIELDS = ("param_version", "mean_return", "std_return", "episodes", "env_steps",
               "wall_seconds", "unix_time")
"""An eval.jsonl row's keys, as the evaluator writes them."""


def _write(path: Path, text: str | bytes) -> None:
    """Writes ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if isinstance(text, bytes):
        tmp.write_bytes(text)
    else:
        tmp.write_text(text)
    os.replace(tmp, path)


def fetch(address: str, out: Path) -> dict[str, Any]:
    """Writes the results of the evaluator at ``address`` into ``out`` (module docstring);
    returns what was written."""
    import io

    import torch

    from amprl.evaluator.client import EvaluatorClient

    with EvaluatorClient(address) as client:
        info = client.info()
        try:
            best = client.best_policy()
        except errors.NotFound:
            best = None
    rows = [{k: getattr(e, k) for k in EVAL_FIELDS} for e in info.evaluations]
    _write(out / "eval.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    state = info.run_state
    _write(out / "end.json", json.dumps({
        "phase": runend.phase_name(state.phase), "reason": runend.REASONS.get(state.stop_reason, ""),
        "env_steps": state.env_steps, "wall_seconds": round(state.wall_seconds, 3),
        "ended_unix_time": state.ended_unix_time}, indent=2) + "\n")
    written: dict[str, Any] = {"output": str(out), "evaluations": len(rows),
                               "phase": runend.phase_name(state.phase), "best": None, "summary": False}
    if best is not None:
        name = f"weights-v{best.evaluation.param_version}.pt"
        buffer = io.BytesIO()
        torch.save(best.weights, buffer)
        _write(out / "best" / name, buffer.getvalue())
        _write(out / "best" / "config.yaml", best.config_yaml)
        _write(out / "config.yaml", best.config_yaml)
        record = {k: getattr(best.evaluation, k) for k in EVAL_FIELDS}
        _write(out / "best" / "best.json",
               json.dumps({**record, "weights": name, "config": "config.yaml"}, indent=1) + "\n")
        for old in (out / "best").glob("weights-v*.pt"):
            if old.name != name:
                old.unlink()
        written["best"] = {"param_version": best.evaluation.param_version,
                           "mean_return": best.evaluation.mean_return, "weights": f"best/{name}"}
    if info.summary_json:
        _write(out / "summary.json", json.dumps(json.loads(info.summary_json), indent=2) + "\n")
        written["summary"] = True
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="amprl fetch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", type=Path, metavar="DIR", help="the folder to write (made if missing)")
    p.add_argument("--evaluator", required=True, metavar="HOST:PORT",
                   help="the evaluator's address, e.g. localhost:50055 through kubectl port-forward")
    p.add_argument("--certs", type=Path, default=None, metavar="DIR",
                   help="mutual TLS with DIR/operator (a folder made by `amprl certs DIR`)")
    args = p.parse_args(argv)
    if args.certs is not None:
        from amprl.launch.status import use_certificate
        use_certificate(args.certs / "operator")
    try:
        written = fetch(args.evaluator, args.output)
    except errors.Unavailable as exc:
        print(f"amprl fetch: the evaluator at {args.evaluator} does not answer: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(written), flush=True)
    return 0
