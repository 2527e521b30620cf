"""Several "hosts" on one machine: Linux network namespaces joined by a bridge.

A ``Topology`` creates one network namespace per named host plus a "switch" namespace that
holds a Linux bridge. Each host gets one veth whose far end is a port of that bridge, so the
hosts share one subnet (``10.231.0.0/24`` by default: host i is ``.(i+1)``, the switch's
own interface ``wan0`` is ``.254``) and reach each other with real sockets over real
interfaces. Every link is created inside a namespace the topology owns; the host
machine's own namespace gets no interface,
and nothing here sends traffic from it to a namespace address (the rule: only processes
*inside* the namespaces dial namespace addresses). Each topology is a closed world, so
parallel topologies may reuse the same subnet.

Delay between two hosts (kernel ``netem`` is absent here) comes from a user-space
``DelayRelay`` process that ``Topology.delay`` starts in the switch namespace: it listens
on the switch address and forwards to the server's address, adding ``delay_ms`` to each
direction. The client dials the returned relay address instead of the server's::

    client ns "learner"                switch ns                        server ns "ps"
    10.231.0.2  ──veth──>  relay 10.231.0.254:P  (+delay each way) ──veth──>  10.231.0.1:port

    with Topology(["ps", "learner"]) as topo:
        ps = topo["ps"].exec([sys.executable, "-m", "amprl.paramserver",
                              "--host", topo["ps"].address, "--port", "50051"])
        topo["ps"].wait_port(50051, proc=ps)  # a connect from inside "ps"
        ps_addr = topo.delay("learner", "ps", 50051, delay_ms=150)  # "10.231.0.254:41623"
        learner = topo["learner"].exec([sys.executable, "-m", "amprl.learner",
                                        "--paramserver", ps_addr])
        ...
    # leaving the block kills every process it started and deletes every namespace

Traffic that does not go through a relay is not delayed; every host that dials a relay
gets its delay (start one relay per client for different delays). The server sees relayed
peers as the switch address. In-process, ``DelayRelay(..., netns=topo.switch.netns)`` runs
the same relay on a thread inside the switch namespace (no extra process). ``Host.limit_rate`` caps a host's egress with ``tc tbf`` (that qdisc exists
here), and ``DelayRelay``'s own ``rate_mbit`` caps one relayed link.

Clean-up: ``close()`` (also on ``__exit__``, on failure, and at interpreter exit) kills each
started process by its process group, then any process still inside the namespaces, then
deletes the namespaces (which deletes their veths and the bridge) and the temporary
folder. Namespace names are ``amprl-<pid>-<n>-<host>``; ``sweep_stale()`` removes those
whose creating process is dead (a test run killed with SIGKILL), never another live run's.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import json
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

log = logging.getLogger(__name__)

PREFIX = "amprl"
DEFAULT_SUBNET = "10.231.0"  # a /24 inside namespaces the topology owns (RFC 1918)
SWITCH_HOST = 254
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,30}$")
_STALE_RE = re.compile(rf"^{PREFIX}-(\d+)-\d+-")
_CLONE_NEWNET = 0x40000000
_HOST_IFINDEX = 10  # eth0 in every host namespace
_SWITCH_IFINDEX = 20  # wan0 (the switch address) and its bridge end r0 = 21
_PORT_IFINDEX = 100  # bridge port p<i> for host i
_counter = itertools.count()
_live: "weakref.WeakSet[Topology]" = weakref.WeakSet()

T = TypeVar("T")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): "
                           f"{proc.stderr.strip()}")
    return proc


def list_netns() -> list[str]:
    """Names of all network namespaces under /run/netns (``ip netns list``)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(name: str) -> list[int]:
    """PIDs of the processes whose network namespace is ``name``."""
    proc = _ip("netns", "pids", name, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns(name: str) -> None:
    """SIGKILLs whatever still runs in ``name``, then deletes it."""
    for _ in range(3):
        pids = [p for p in netns_pids(name) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _ip("netns", "del", name, check=False)


def sweep_stale() -> list[str]:
    """Deletes ``amprl-<pid>-...`` namespaces left by processes that no longer exist."""
    removed = []
    for name in list_netns():
        m = _STALE_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_netns(name)
            removed.append(name)
    if removed:
        log.warning("removed stale namespaces: %s", ", ".join(removed))
    return removed


def check_supported() -> str | None:
    """``None`` when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid is %d)" % os.geteuid()
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"{PREFIX}-{os.getpid()}-{next(_counter)}-probe"
    proc = _ip("netns", "add", name, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` failed: {proc.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


_libc = None


def enter_netns(name: str) -> None:
    """Moves the *calling thread* into network namespace ``name`` (setns(2)).

    Sockets the thread creates afterwards live there; other threads are unaffected. Use it
    on a thread of its own (``Host.call``), never on one that must return to the host.
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Host:
    """One namespace of a ``Topology``: a name, an address, and processes run inside it."""

    def __init__(self, topo: "Topology", name: str, netns: str, address: str) -> None:
        self.topo = topo
        self.name = name
        self.netns = netns  # the `ip netns` name
        self.address = address  # this host's IPv4 address on the topology's subnet
        self.interface = "eth0"

    def __repr__(self) -> str:
        return f"Host({self.name!r}, netns={self.netns!r}, address={self.address!r})"

    def _argv(self, argv: Sequence[str]) -> list[str]:
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a sequence of strings, not one string")
        return ["ip", "netns", "exec", self.netns, *map(str, argv)]

    @staticmethod
    def _env(env: Mapping[str, str] | None) -> dict[str, str]:
        merged = dict(os.environ)
        # Proxies configured for the outside world would capture in-topology gRPC traffic.
        for key in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy",
                    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            merged.pop(key, None)
        merged.update(env or {})
        return merged

    def exec(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
             **popen_kwargs) -> subprocess.Popen:
        """Starts ``argv`` inside this namespace, in a new process group; returns the Popen.

        ``env`` is added to the current environment (proxy variables removed). stdout and
        stderr go to a log file in the topology's folder (``proc.log_path``) unless given.
        The topology kills the process group on ``close()``.
        """
        topo = self.topo
        topo._require_open()
        log_path = None
        opened = []
        if "stdout" not in popen_kwargs or "stderr" not in popen_kwargs:
            stem = Path(str(argv[0])).name
            idx = next(topo._seq)
            log_path = topo.tmpdir / f"{self.name}-{idx:02d}-{stem}.log"
            f = open(log_path, "wb")
            opened.append(f)
            popen_kwargs.setdefault("stdout", f)
            popen_kwargs.setdefault("stderr", f)
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        try:
            proc = subprocess.Popen(self._argv(argv), env=self._env(env),
                                    start_new_session=True, **popen_kwargs)
        finally:
            for f in opened:
                f.close()
        proc.log_path = log_path  # type: ignore[attr-defined]
        proc.host = self.name  # type: ignore[attr-defined]
        proc.argv = list(map(str, argv))  # type: ignore[attr-defined]
        topo._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True,
            env: Mapping[str, str] | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Runs a short command inside this namespace and returns its captured (text) output.

        Raises ``subprocess.CalledProcessError`` (with stdout/stderr) on a non-zero exit when
        ``check``. On timeout the whole process group is killed.
        """
        proc = self.exec(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                         text=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc, grace_s=0)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        finally:
            self.topo._forget(proc)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def call(self, fn: Callable[..., T], *args, timeout: float | None = 60.0, **kwargs) -> T:
        """Runs ``fn(*args, **kwargs)`` on a new thread inside this namespace; returns its value.

        For in-process socket work in tests (a probe, a raw client). Libraries that open
        sockets from their own threads (gRPC) must run as processes via ``exec`` instead.
        """
        result: list = []

        def target() -> None:
            try:
                enter_netns(self.netns)
                result.append((True, fn(*args, **kwargs)))
            except BaseException as e:  # re-raised on the caller's thread
                result.append((False, e))

        t = threading.Thread(target=target, name=f"netns-{self.name}", daemon=True)
        t.start()
        t.join(timeout)
        if not result:
            raise TimeoutError(f"{fn!r} in {self.name} did not finish in {timeout} s")
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def wait_port(self, port: int, address: str | None = None, *, timeout: float = 20.0,
                  proc: subprocess.Popen | None = None) -> None:
        """Waits until a TCP connect from inside this namespace to ``address:port`` succeeds.

        ``address`` defaults to this host's own. With ``proc``, fails early if it exits.
        """
        address = address or self.address
        deadline = time.monotonic() + timeout

        def probe() -> bool:
            while True:
                try:
                    socket.create_connection((address, port), timeout=1.0).close()
                    return True
                except OSError:
                    if proc is not None and proc.poll() is not None:
                        return False
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.02)

        if not self.call(probe, timeout=timeout + 5):
            why = (f"exited with {proc.returncode}; log: {self.topo.read_log(proc)}"
                   if proc is not None and proc.poll() is not None else f"after {timeout} s")
            raise TimeoutError(f"{address}:{port} not accepting in {self.name}: {why}")

    def set_link(self, up: bool) -> None:
        """Takes this host's interface down or up again. Down, every packet to or from the
        host is dropped while its connections stay open on both ends: a partition (a zone or
        switch gone), which TCP and gRPC keepalives have to notice; up, the host is back
        with the same address, and what survived the partition carries on."""
        self.run(["ip", "link", "set", "dev", self.interface, "up" if up else "down"])

    @contextlib.contextmanager
    def partitioned(self) -> Iterator[None]:
        """``set_link(False)`` for the duration of the block, healed on the way out."""
        self.set_link(False)
        try:
            yield
        finally:
            self.set_link(True)

    def limit_rate(self, rate_mbit: float, burst_bytes: int = 64 * 1024,
                   latency_ms: float = 100.0) -> None:
        """Caps this host's egress on its veth with ``tc tbf`` (a token bucket)."""
        tc = shutil.which("tc") or "tc"
        self.run([tc, "qdisc", "replace", "dev", self.interface, "root", "tbf",
                  "rate", f"{rate_mbit}mbit", "burst", str(burst_bytes),
                  "latency", f"{latency_ms}ms"])


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL it."""
    if grace_s > 0 and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    # The leader may be gone while children in its group live on: kill the group anyway.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        log.error("process %d (%s) survived SIGKILL", proc.pid, proc.args)


class Topology:
    """Named hosts in separate network namespaces on one bridged subnet.

    ``hosts`` are short lowercase names (``"ps"``, ``"learner"``, ``"actor-0"``); host i
    gets ``<subnet>.(i+1)``. Use as a context manager, or call ``create()`` and ``close()``.
    ``topo["ps"]`` is the ``Host`` named "ps"; ``topo.switch`` is the bridge namespace
    (address ``<subnet>.254``) where ``delay`` runs its relays.
    """

    def __init__(self, hosts: Sequence[str], *, subnet: str = DEFAULT_SUBNET) -> None:
        if isinstance(hosts, str):
            raise TypeError("hosts must be a sequence of names, not one string")
        if not hosts or len(hosts) > 200:
            raise ValueError(f"hosts ({len(hosts)}) must hold 1 to 200 names")
        for h in hosts:
            if not _NAME_RE.match(h):
                raise ValueError(f"host name {h!r} must match {_NAME_RE.pattern}")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"host names {list(hosts)} must be unique")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet {subnet!r} must be the first three octets, e.g. 10.231.0")
        self.subnet = subnet
        self.id = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.hosts: dict[str, Host] = {
            h: Host(self, h, f"{self.id}-{h}", f"{subnet}.{i + 1}") for i, h in enumerate(hosts)}
        self.switch = Host(self, "switch", f"{self.id}--switch", f"{subnet}.{SWITCH_HOST}")
        self.switch.interface = "wan0"
        self.tmpdir: Path = Path()
        self.relays: list[tuple[str, str, subprocess.Popen]] = []
        self._procs: list[subprocess.Popen] = []
        self._seq = itertools.count()
        self._created: list[str] = []  # namespaces to delete, in creation order
        self._state = "new"

    def __getitem__(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r}; hosts are {sorted(self.hosts)}") from None

    def __repr__(self) -> str:
        return f"Topology({self.id}, {list(self.hosts.values())})"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch.netns] + [h.netns for h in self.hosts.values()]

    def _require_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"topology {self.id} is {self._state}, not open")

    # -- lifecycle ---------------------------------------------------------------------

    def create(self) -> "Topology":
        if self._state != "new":
            raise RuntimeError(f"topology {self.id} was already created")
        self._state = "creating"
        _live.add(self)
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"{self.id}-"))
        try:
            sw = self.switch.netns
            self._add_netns(sw)
            # Explicit interface indexes: when a veth's index equals its peer's, the kernel
            # treats its carrier event as non-urgent and the bridge port stays down for up
            # to a second (the first SYN or ARP is dropped and retried 1 s later).
            batch = ["link set lo up",
                     "link add br0 type bridge stp_state 0 forward_delay 0",
                     "link set br0 up",
                     # The switch's own address sits on a veth into the bridge, not on br0,
                     # whose carrier also comes up late.
                     f"link add {self.switch.interface} index {_SWITCH_IFINDEX} type veth "
                     f"peer name r0 index {_SWITCH_IFINDEX + 1}",
                     "link set r0 master br0", "link set r0 up",
                     f"addr add {self.switch.address}/24 dev {self.switch.interface}",
                     f"link set {self.switch.interface} up"]
            for i, host in enumerate(self.hosts.values()):
                self._add_netns(host.netns)
                port = f"p{i}"
                # Both ends are created inside namespaces: the machine's own gets nothing.
                _ip("-n", sw, "link", "add", port, "index", str(_PORT_IFINDEX + i), "type",
                    "veth", "peer", "name", host.interface, "index", str(_HOST_IFINDEX),
                    "netns", host.netns)
                batch += [f"link set {port} master br0", f"link set {port} up"]
                self._batch(host.netns, ["link set lo up",
                                         f"addr add {host.address}/24 dev {host.interface}",
                                         f"link set {host.interface} up"])
            self._batch(sw, batch)
            self._wait_links_up()
        except BaseException:
            self.close()
            raise
        self._state = "open"
        return self

    def _wait_links_up(self, timeout_s: float = 3.0) -> None:
        """Waits until every veth reports operstate UP (normally at once)."""
        deadline = time.monotonic() + timeout_s
        while True:
            down = []
            for ns in self.namespaces:
                out = _ip("-n", ns, "-o", "link", "show", "type", "veth").stdout
                down += [f"{ns}:{line.split()[1]}" for line in out.splitlines()
                         if " state UP " not in line]
            if not down:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"links still down after {timeout_s} s: {down}")
            time.sleep(0.01)

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    @staticmethod
    def _batch(netns: str, commands: list[str]) -> None:
        proc = subprocess.run(["ip", "-n", netns, "-batch", "-"], input="\n".join(commands),
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"ip -n {netns} -batch failed: {proc.stderr.strip()}")

    def close(self) -> None:
        """Kills every started process, deletes the namespaces and the temporary folder.

        Safe to call more than once and after a failed ``create``. Raises only if a
        namespace could not be removed.
        """
        if self._state == "closed":
            return
        self._state = "closing"
        procs = [p for p in self._procs if p.poll() is None]
        for p in procs:  # ask all at once, then wait: n processes cost one grace period
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2.0
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self._procs:
            _kill_group(p, grace_s=0)
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        for name in reversed(self._created):
            _kill_netns(name)
        left = set(self._created) & set(list_netns())
        shutil.rmtree(self.tmpdir, ignore_errors=True) if self.tmpdir != Path() else None
        self._procs.clear()
        self._state = "closed"
        _live.discard(self)
        if left:
            raise RuntimeError(f"could not delete namespaces {sorted(left)}")

    def __enter__(self) -> "Topology":
        return self.create() if self._state == "new" else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forget(self, proc: subprocess.Popen) -> None:
        if proc in self._procs and proc.poll() is not None:
            self._procs.remove(proc)

    # -- delay -------------------------------------------------------------------------

    def delay(self, client: str, server: str, port: int, delay_ms: float, *,
              server_address: str | None = None, jitter_ms: float = 0.0,
              rate_mbit: float | None = None, timeout: float = 20.0) -> str:
        """Starts a delay relay toward ``server``'s ``port``; returns ``host:port`` to dial.

        The relay runs as a process in the switch namespace, listening on the switch
        address, and adds ``delay_ms`` to each direction (round trip ``2 * delay_ms``).
        ``client`` only labels the relay (any host can dial it; give each client its own
        relay if its delay should differ). ``server_address`` overrides the server host's.
        """
        self._require_open()
        self[client]
        target = f"{server_address or self[server].address}:{port}"
        argv = [sys.executable, "-m", "amprl_testing.netsim.relay", "--listen",
                f"{self.switch.address}:0", "--target", target, "--delay-ms", str(delay_ms),
                "--jitter-ms", str(jitter_ms)]
        if rate_mbit:
            argv += ["--rate-mbit", str(rate_mbit)]
        log_path = self.tmpdir / f"relay-{next(self._seq):02d}-{client}-to-{server}.log"
        with open(log_path, "wb") as err:
            proc = self.switch.exec(argv, stdout=subprocess.PIPE, stderr=err)
        proc.log_path = log_path  # type: ignore[attr-defined]
        try:
            line = read_line(proc, timeout)
        except TimeoutError:
            line = ""
        try:
            event = json.loads(line)
            address = f"{event['host']}:{event['port']}"
        except (ValueError, KeyError):
            raise RuntimeError(f"relay to {target} did not start (said {line!r}); "
                               f"log: {self.read_log(proc)}") from None
        self.relays.append((client, server, proc))
        return address

    # -- diagnostics -------------------------------------------------------------------

    @staticmethod
    def read_log(proc: subprocess.Popen, max_bytes: int = 4000) -> str:
        path = getattr(proc, "log_path", None)
        if not path:
            return "<no log>"
        try:
            data = Path(path).read_bytes()
        except OSError:
            return "<log gone>"
        return data[-max_bytes:].decode(errors="replace")

    def logs(self, max_bytes: int = 4000) -> str:
        """The tail of every started process's log, one section each (for failure reports)."""
        parts = []
        for path in sorted(self.tmpdir.glob("*.log")) if self.tmpdir != Path() else []:
            try:
                data = path.read_bytes()[-max_bytes:].decode(errors="replace")
            except OSError:
                continue
            parts.append(f"--- {path.name} ---\n{data}")
        return "\n".join(parts)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line of ``proc.stdout`` (a pipe), without the newline, within ``timeout`` s.

    Returns '' at end of file; raises ``TimeoutError`` when no full line came in time. Use
    it for every read of that pipe: it keeps bytes past the line for the next call.
    """
    assert proc.stdout is not None, "start the process with stdout=subprocess.PIPE"
    buf: bytes = getattr(proc, "_netns_linebuf", b"")
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                proc._netns_linebuf = buf  # type: ignore[attr-defined]
                raise TimeoutError(f"no line from {proc.args!r} in {timeout} s (got {buf!r})")
            chunk = os.read(fd, 65536)
            if not chunk:
                proc._netns_linebuf = b""  # type: ignore[attr-defined]
                return buf.decode(errors="replace")
            buf += chunk
    line, buf = buf.split(b"\n", 1)
    proc._netns_linebuf = buf  # type: ignore[attr-defined]
    return line.decode(errors="replace")


@atexit.register
def _close_all() -> None:
    for topo in list(_live):
        try:
            topo.close()
        except Exception as e:  # at exit, report and go on with the others
            log.error("closing %s: %s", topo.id, e)
