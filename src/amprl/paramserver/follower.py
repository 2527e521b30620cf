"""Pull-only followers: read-only replicas of the parameter server that serve the fleet.

    amprl paramserver --follow paramserver:50056      (or AMPRL_FOLLOW)

Learners push to the main server; actors and the evaluator pull from followers, so the
main server serves one pull per version per follower however large the fleet, and its CPU
stays with the pushes. A follower holds no optimizer and writes no checkpoints: it keeps a
``VersionedWeights`` equal to the main server's newest weights and serves them with the
main server's own servicer (each version encoded and serialized once per encoding) behind
the pull port's face (``PullOnlyServicer``: PushGradients is PERMISSION_DENIED, naming the
main server).

Following: a WatchParameters stream announces each new version, which is pulled once, in
fp32. Each stream starts with a pull of the whole weights (``have_version`` 0): a stream
that opens on a restarted main server gets its weights even when they carry the version
number the follower holds (until replies carry the server's incarnation, the number alone
cannot tell). When the main server refuses the watch (RESOURCE_EXHAUSTED: its limit of
open streams) the follower polls PullParameters every ``poll_s`` instead and asks for the
watch again after ``retry_watch_s``. When the stream or a pull fails (the main server
restarts) it retries with exponential backoff and jitter, and keeps serving the last
weights it holds meanwhile. Until its first weights arrive a follower's health is
NOT_SERVING and its pulls and watches answer UNAVAILABLE.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, NamedTuple

import grpc
from torch import nn

from amprl import errors
from amprl.common import grpcutil
from amprl.common.backoff import Backoff
from amprl.paramserver.client import ParameterClient, VersionWatch
from amprl.paramserver.service import (DEFAULT_MAX_WATCHERS, DEFAULT_MAX_WORKERS, ParameterServer,
                                       create_pull_only_server)
from amprl.paramserver.weights import DEFAULT_LIVE_WINDOW_S, VersionedWeights

log = logging.getLogger(__name__)

DEFAULT_POLL_S = 1.0
"""Pull interval while the main server refuses the watch (an unchanged pull is ~20 bytes)."""
DEFAULT_RETRY_WATCH_S = 30.0
"""How long a follower polls after a refused watch before asking for one again."""
DEFAULT_BACKOFF_S = (0.5, 10.0)
"""First and largest window between failed attempts (``amprl.common.backoff``: each failure
doubles it, each wait is half of it plus jitter, so followers that lost the main server
together do not come back together)."""
DEFAULT_PULL_TIMEOUT_S = 30.0
"""Deadline of one pull from the main server (it waits for the connection meanwhile)."""


class _WatchRefused(Exception):
    """The main server answered WatchParameters with RESOURCE_EXHAUSTED."""


class Follower:
    """Keeps ``weights`` equal to the newest weights of the server at ``main_address``.

    A background thread (``start``) follows the main server as the module docstring says;
    ``ready`` is set, and ``on_ready`` called, once the first weights are held. Every
    failed call is retried; one that retrying cannot mend (the main server's weights do not
    fit this model: ConfigError) is kept in ``error`` and reported to ``on_fatal``, and the
    thread ends.
    """

    def __init__(self, main_address: str, weights: VersionedWeights, *, client_id: str = "follower",
                 poll_s: float = DEFAULT_POLL_S, retry_watch_s: float = DEFAULT_RETRY_WATCH_S,
                 backoff_s: tuple[float, float] = DEFAULT_BACKOFF_S,
                 pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
                 max_message_bytes: int = grpcutil.DEFAULT_MAX_MESSAGE_BYTES,
                 on_ready: Callable[[], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.main_address = main_address
        self.weights = weights
        self.client = ParameterClient(main_address, client_id, timeout_s=pull_timeout_s,
                                      max_message_bytes=max_message_bytes)
        self.poll_s = poll_s
        self.retry_watch_s = retry_watch_s
        self.pull_timeout_s = pull_timeout_s
        self.on_ready = on_ready
        self.on_fatal = on_fatal
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.pulls = 0
        """Pulls that brought weights (one per version followed, plus one per reconnection)."""
        self._stop = threading.Event()
        self._backoff = Backoff(base_s=backoff_s[0], cap_s=backoff_s[1])
        self._watch: VersionWatch | None = None
        self._thread = threading.Thread(target=self._run, name="ps-follow", daemon=True)

    def start(self) -> "Follower":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops following (the weights held stay as they are)."""
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.cancel()
        self.client.close()  # ends a pull in flight
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._follow()
        except Exception as exc:  # noqa: BLE001 - reported to on_fatal; the thread ends
            if self._stop.is_set():
                return  # the channel closed under a call: stopping, not failing
            self.error = exc
            log.error("following %s failed for good: %s", self.main_address, exc)
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _follow(self) -> None:
        poll_until = 0.0  # monotonic time before which the watch is not asked for again
        resync = True  # the next poll asks for the whole weights (after a failure)
        while not self._stop.is_set():
            try:
                if time.monotonic() < poll_until:
                    self._pull(resync)
                    resync = False
                    self._stop.wait(self.poll_s)
                    continue
                self._watch_versions()
                raise errors.Unavailable("the watch stream ended (the server is stopping)")
            except _WatchRefused as exc:
                log.info("%s refused the watch (%s): polling every %.1fs for %.0fs",
                         self.main_address, exc, self.poll_s, self.retry_watch_s)
                poll_until = time.monotonic() + self.retry_watch_s
                resync = True
            except (errors.Unavailable, errors.DeadlineExceeded, errors.ResourceExhausted,
                    grpc.RpcError) as exc:
                if self._stop.is_set():
                    return
                wait = self._backoff.next()
                log.warning("lost %s (%s): serving version %d meanwhile, retrying in %.1fs",
                            self.main_address, _describe(exc), self.weights.version, wait)
                resync = True
                self._stop.wait(wait)

    def _pull(self, whole: bool) -> None:
        """Pulls the main server's weights unless they are the ones held (``whole``: in
        any case, as after a reconnection)."""
        whole = whole or not self.ready.is_set()
        version, incarnation, weights = self.client.pull_versioned(
            0 if whole else self.weights.version, 0 if whole else self.weights.incarnation,
            encoding="fp32", timeout=self.pull_timeout_s)
        self._backoff.reset()
        if weights is None:
            return
        try:
            # the main server's incarnation is passed on, so the fleet tells its lives apart
            self.weights.replace(version, weights, incarnation or None)
        except errors.InvalidArgument as exc:
            raise errors.ConfigError(f"the weights of {self.main_address} do not fit this "
                                     f"follower's model ({exc}); give it the main server's "
                                     f"experiment config") from None
        self.pulls += 1
        log.debug("following %s: version %d", self.main_address, version)
        if not self.ready.is_set():
            log.info("following %s: holding version %d, serving", self.main_address, version)
            self.ready.set()
            if self.on_ready is not None:
                self.on_ready()

    def _watch_versions(self) -> None:
        """Pulls each version the main server announces until the stream ends (returns)
        or fails (raises).

        The stream is opened with ``have_version`` 0, so its first message comes at once,
        and answered with a whole pull: the call waits for the connection, and a stream
        that opens on a restarted main server gets that server's weights even when they
        carry the version number held.
        """
        self._watch = watch = self.client.watch(0)
        first = True
        try:
            while not self._stop.is_set():
                try:
                    version = watch.next(timeout=0.5)
                except errors.ResourceExhausted as exc:
                    raise _WatchRefused(str(exc)) from None
                if version is not None and (first or version != self.weights.version):
                    self._pull(whole=first)
                    first = False
                elif version is None and watch.done:
                    return
        finally:
            self._watch = None
            watch.cancel()


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class FollowerServer(NamedTuple):
    """A started follower: its server (``ParameterServer``: port, weights, servicer) and
    the thread following the main server."""

    server: ParameterServer
    follower: Follower

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stops following, ends watch streams, then stops the server."""
        self.follower.stop()
        self.server.stop(grace_s)


def create_follower(model: nn.Module, main_address: str, *, client_id: str = "follower",
                    host: str = "0.0.0.0", port: int = 0,
                    live_window_s: float = DEFAULT_LIVE_WINDOW_S,
                    max_message_bytes: int = grpcutil.DEFAULT_MAX_MESSAGE_BYTES,
                    max_workers: int = DEFAULT_MAX_WORKERS, max_watchers: int = DEFAULT_MAX_WATCHERS,
                    on_fatal: Callable[[BaseException], None] | None = None,
                    **timing) -> FollowerServer:
    """Starts a follower of ``main_address`` serving on ``host:port`` (0 = any free port).

    ``model`` gives the names and shapes (its values are never served: the first weights
    served are the main server's). ``timing``: Follower's ``poll_s``, ``retry_watch_s``,
    ``backoff_s``, ``pull_timeout_s``.
    """
    weights = VersionedWeights.from_model(model, live_window_s=live_window_s)
    follower = Follower(main_address, weights, client_id=client_id,
                        max_message_bytes=max_message_bytes, on_fatal=on_fatal, **timing)
    try:
        server = create_pull_only_server(
            weights, ready=follower.ready, host=host, port=port,
            max_message_bytes=max_message_bytes, max_workers=max_workers,
            max_watchers=max_watchers,
            refusal=(f"PushGradients is not served here: this is a pull-only follower of the "
                     f"parameter server at {main_address}; learners push to that server's "
                     f"main port (--port / AMPRL_PORT)"),
            not_ready=f"this follower of {main_address} holds no weights yet; retry shortly")
    except BaseException:
        follower.client.close()
        raise
    follower.on_ready = lambda: grpcutil.set_health(server.server, serving=True)
    follower.start()
    return FollowerServer(server, follower)


__all__ = ["Follower", "FollowerServer", "create_follower"]
