"""Checkpoints of the parameter store: weights + Adam state + version, written atomically.

File ``ckpt-<version, 12 digits>.amprl`` in the checkpoint folder::

    b"AMPRLCK1"              8 bytes, format magic
    sha256(payload)          32 bytes
    payload                  torch.save of ParameterStore.state_dict() (tensors, ints,
                             strings, lists, dicts only)

Writing: payload to ``.<name>.tmp``, fsync, rename over the final name, fsync the folder, so
a crash leaves either the old set of files or the new one, never a half file under a final
name. Reading: the newest file whose magic and hash check out, loaded with
``torch.load(weights_only=True)`` (no arbitrary unpickling, even of local files); a
truncated or corrupted newest file is skipped with a warning and the previous one is used.
Only the ``keep`` newest files stay on disk.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import threading
import time
from pathlib import Path

import torch

from amprl.errors import ConfigError, InvalidArgument
from amprl.paramserver.store import ParameterStore

log = logging.getLogger(__name__)

MAGIC = b"AMPRLCK1"
_NAME = re.compile(r"^ckpt-(\d{12})\.amprl$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves and restores a ParameterStore in one folder, keeping the ``keep`` newest."""

    def __init__(self, directory: str | Path, keep: int = 2):
        if keep < 1:
            raise ConfigError(f"paramserver.checkpoints_kept: {keep} must be >= 1")
        self.directory = Path(directory)
        self.keep = keep
        self._lock = threading.Lock()  # one writer at a time (periodic thread vs shutdown)

    def files(self) -> list[tuple[int, Path]]:
        """(version, path) of the checkpoint files, newest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)

    def save(self, store: ParameterStore, *, force: bool = False) -> Path | None:
        """Writes a checkpoint of ``store`` unless its version is already on disk."""
        with self._lock:
            state = store.state_dict()
            version = state["version"]
            if not force and version == store.checkpoint_version and self.files():
                return None
            buf = io.BytesIO()
            torch.save(state, buf)
            payload = buf.getvalue()
            self.directory.mkdir(parents=True, exist_ok=True)
            final = self.directory / f"ckpt-{version:012d}.amprl"
            tmp = self.directory / f".{final.name}.tmp"
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                f.write(hashlib.sha256(payload).digest())
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            store.checkpoint_version = version
            self._prune()
            log.info("checkpoint %s (version %d, %.1f MiB)", final, version, len(payload) / 2**20)
            return final

    def _prune(self) -> None:
        for _, path in self.files()[self.keep:]:
            try:
                path.unlink()
            except OSError as exc:
                log.warning("could not remove old checkpoint %s: %s", path, exc)
        for p in self.directory.glob(".ckpt-*.tmp"):  # left by a crash mid-write
            p.unlink(missing_ok=True)

    @staticmethod
    def read(path: Path) -> dict:
        """The state in one file; InvalidArgument if it is truncated or corrupted."""
        raw = path.read_bytes()
        if len(raw) < 40 or raw[:8] != MAGIC:
            raise InvalidArgument(f"{path}: not an AMP-RL checkpoint (bad magic or truncated)")
        digest, payload = raw[8:40], raw[40:]
        if hashlib.sha256(payload).digest() != digest:
            raise InvalidArgument(f"{path}: checksum mismatch (truncated or corrupted)")
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable payload is "corrupted"
            raise InvalidArgument(f"{path}: unreadable payload ({exc})") from exc
        if not isinstance(state, dict) or not {"version", "names", "params", "optimizer"} <= set(state):
            raise InvalidArgument(f"{path}: missing fields")
        return state

    def restore(self, store: ParameterStore) -> int | None:
        """Loads the newest valid checkpoint into ``store``; returns its version or None.

        Corrupted files are skipped (newest first). A valid file for a different model
        (other parameter names or shapes) is a ConfigError: the folder belongs to another
        experiment, and starting fresh would later prune its checkpoints.
        """
        for version, path in self.files():
            try:
                state = self.read(path)
            except (OSError, InvalidArgument) as exc:
                log.warning("skipping checkpoint %s: %s", path, exc)
                continue
            try:
                store.load_state_dict(state)
            except InvalidArgument as exc:
                raise ConfigError(f"paramserver.checkpoint_dir: {path} holds another model's "
                                  f"checkpoint ({exc}); use a fresh checkpoint_dir") from exc
            log.info("resumed from %s (version %d)", path, version)
            return store.version
        return None


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The fp32 weights, by parameter name, in a checkpoint file or a state-dict file
    (``RUN/best/weights-v*.pt``; ``torch.load(weights_only=True)``); ConfigError naming
    the file if it is neither."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            is_checkpoint = f.read(len(MAGIC)) == MAGIC
        if is_checkpoint:
            state = CheckpointManager.read(path)
            return {n: state["params"][n].float() for n in state["names"]}
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, InvalidArgument) as exc:
        raise ConfigError(f"{path}: cannot read weights ({exc})") from exc
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises on a foreign file
        raise ConfigError(f"{path}: not a state dict nor a checkpoint ({exc})") from exc
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise ConfigError(f"{path}: not a state dict of tensors")
    return {n: t.float() for n, t in weights.items()}


class PeriodicCheckpointer:
    """A daemon thread that saves every ``interval_s`` seconds, or as soon as
    ``interval_versions`` versions were applied since the last save (whichever comes
    first; 0 turns either trigger off), until ``stop()``."""

    POLL_S = 0.25  # how often the version is looked at when a version interval is set

    def __init__(self, manager: CheckpointManager, store: ParameterStore, interval_s: float,
                 interval_versions: int = 0):
        self.manager = manager
        self.store = store
        self.interval_s = interval_s
        self.interval_versions = interval_versions
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpointer", daemon=True)

    def start(self) -> "PeriodicCheckpointer":
        if self.interval_s > 0 or self.interval_versions > 0:
            self._thread.start()
        return self

    def _run(self) -> None:
        poll = self.POLL_S if self.interval_versions > 0 else self.interval_s
        last_t, last_v = time.monotonic(), self.store.version
        while not self._stop.wait(poll):
            by_time = self.interval_s > 0 and time.monotonic() - last_t >= self.interval_s
            by_versions = (self.interval_versions > 0
                           and self.store.version - last_v >= self.interval_versions)
            if not (by_time or by_versions):
                continue
            last_t, last_v = time.monotonic(), self.store.version
            try:
                self.manager.save(self.store)
            except Exception:  # noqa: BLE001 - a full disk must not kill the server
                log.exception("periodic checkpoint failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
