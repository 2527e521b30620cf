"""The learner's push window, gradient accumulation and re-sync, against a fake parameter
server whose pushes complete only when the test says so (no gRPC, no threads started)."""

from __future__ import annotations

import concurrent.futures
import copy
import threading

import pytest
import torch

from amprl import errors
from amprl.common.supervise import ThreadDied
from amprl.wire.compressed import decode, encode
from amprl.config import load_config
from amprl.envs.factory import env_spec
from amprl.learner.learner import LOG_WINDOW, Learner
from amprl.rl.batch import Batch


class FakePS:
    """Records pushes; each returns a future the test resolves."""

    def __init__(self, weights: dict[str, torch.Tensor], version: int = 7):
        self.weights = weights
        self.version = version
        self.pushes: list[tuple[int, dict, int, concurrent.futures.Future]] = []
        self.pulls: list[int] = []

    def push_future(self, base_version, msgs, batch_size=0, timeout=None, return_weights=False,
                    more_steps=()):
        assert not more_steps  # multi-step pushes: tests/integration/learner (a real server)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        self.pushes.append((base_version, {m.name: decode(m) for m in msgs}, batch_size, fut))
        return fut

    def pull(self, have_version=0, timeout=None, **_):
        self.pulls.append(have_version)
        if have_version == self.version and have_version != 0:
            return self.version, None
        return self.version, {k: v.clone() for k, v in self.weights.items()}

    def reply(self, i: int, version: int | None = None):
        class Reply:
            pass
        r = Reply()
        self.version = version if version is not None else self.version + 1
        r.version = self.version
        r.incarnation = 1  # one server life throughout
        r.staleness = 0
        r.weights = []  # a real reply's repeated field: empty unless return_weights
        self.pushes[i][3].set_result(r)


def _learner(*overrides) -> tuple[Learner, FakePS]:
    cfg = load_config(None, ["learner.batch_size=8", "learner.device=cpu", "network.hidden_sizes=[16]",
                             *overrides])
    spec = env_spec(cfg.env)
    learner = Learner(cfg, spec, replay=None, paramserver=None, device="cpu")
    ps = FakePS({n: p.detach().clone() for n, p in learner.model.named_parameters()})
    use_ps(learner, ps)
    learner.weights.version = ps.version
    return learner, ps


def use_ps(learner: Learner, ps) -> None:
    """The learner's weight sync and push window talk to ``ps`` (a fake parameter server)."""
    learner.ps = learner.weights.ps = learner.pushes.ps = ps


def _batch(learner: Learner, seed: int) -> tuple[Batch, object]:
    g = torch.Generator().manual_seed(seed)  # CartPole: 4 observations, 2 actions
    return Batch(obs=torch.randn(8, 4, generator=g), actions=torch.randint(0, 2, (8,), generator=g), rewards=torch.randn(8, generator=g),
                 discounts=torch.full((8,), 0.97), next_obs=torch.randn(8, 4, generator=g),
                 weights=torch.ones(8)), list(range(8))


def _grads(learner: Learner, item) -> dict[str, torch.Tensor]:
    """The clipped gradient one update on ``item`` produces (computed on a scratch copy)."""
    learner.update(item)
    return {n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None}


def test_auto_window_is_half_the_staleness_bound():
    learner, _ = _learner("learner.max_pushes_in_flight=0", "paramserver.max_staleness=32")
    assert learner.window == 16
    learner, _ = _learner("learner.max_pushes_in_flight=0", "paramserver.max_staleness=1")
    assert learner.window == 1
    learner, _ = _learner("learner.max_pushes_in_flight=3")
    assert learner.window == 3


def test_each_batch_is_its_own_push_while_the_window_has_room():
    learner, ps = _learner("learner.max_pushes_in_flight=4", "learner.max_batches_per_push=8")
    for i in range(4):
        learner.update(_batch(learner, i))
    assert len(ps.pushes) == 4 and learner.stats.updates == 4
    assert [p[0] for p in ps.pushes] == [7] * 4 and [p[2] for p in ps.pushes] == [8] * 4


def test_a_full_window_averages_the_next_batches_into_one_push_without_waiting():
    learner, ps = _learner("learner.max_pushes_in_flight=1", "learner.max_batches_per_push=8")
    learner.update(_batch(learner, 0))  # fills the window
    expected = []
    for i in (1, 2, 3):
        expected.append(_grads(learner, _batch(learner, i)))  # no push: the window is full
        learner.weights.version += 1  # new weights arrived meanwhile: base must stay the oldest
    assert len(ps.pushes) == 1 and learner.stats.updates == 4
    ps.reply(0)
    learner.update(_batch(learner, 4))  # a slot is free: 4 batches go out as one push
    assert len(ps.pushes) == 2
    base, grads, items, _ = ps.pushes[1]
    assert base == 7 and items == 32
    last = {n: p.grad for n, p in learner.model.named_parameters()}
    for name, g in grads.items():
        mean = (sum(e[name] for e in expected) + last[name]) / 4
        torch.testing.assert_close(g, mean)
    assert learner.stats.batches_per_push == pytest.approx(5 / 2)


def test_max_batches_per_push_1_waits_for_a_slot(monkeypatch):
    learner, ps = _learner("learner.max_pushes_in_flight=1", "learner.max_batches_per_push=1")
    learner.update(_batch(learner, 0))
    waited = []
    monkeypatch.setattr(learner.pushes, "drain", lambda keep: (waited.append(keep), ps.reply(0)))
    learner.update(_batch(learner, 1))
    assert waited == [0] and len(ps.pushes) == 2 and ps.pushes[1][2] == 8


def test_a_stale_rejection_resyncs_to_the_servers_weights_even_a_lower_version():
    learner, ps = _learner("learner.grad_encoding=onebit", "learner.onebit_min_elements=1")
    learner.update(_batch(learner, 0))
    residuals = learner.compressor.residuals
    assert residuals and learner.compressor.residual_norm() > 0
    moments = learner.compressor.second_moments  # onebit_precondition is on by default
    assert learner.compressor.precondition and set(moments) == set(residuals)
    # the server restarted from an older checkpoint: version 3 with other weights
    ps.weights = {n: torch.full_like(w, 0.5) for n, w in ps.weights.items()}
    ps.version = 3
    ps.pushes[0][3].set_exception(errors.FailedPrecondition("ahead", current_version=3))
    assert learner.stats.stale_rejections == 1 and learner.weights.want_pull.is_set()
    t = threading.Thread(target=learner.weights.pull_loop, daemon=True)  # the real pull thread
    t.start()
    for _ in range(50):
        if learner.weights.pending is not None:
            break
        t.join(0.1)
    learner._stop.set()
    t.join(2)
    assert ps.pulls == [0]  # a full pull, whatever the replica holds
    learner.swap_in_weights()
    assert learner.version == 3 and learner.stats.server_rollbacks == 1 and learner.stats.resyncs == 1
    assert all(bool((p == 0.5).all()) for p in learner.model.parameters())
    assert learner.compressor.residuals is residuals and learner.compressor.residual_norm() > 0
    assert learner.compressor.second_moments is moments and moments


def test_a_failed_push_frees_its_slot_and_asks_for_a_resync():
    learner, ps = _learner("learner.max_pushes_in_flight=1")
    learner.update(_batch(learner, 0))
    ps.pushes[0][3].set_exception(errors.Unavailable("connection reset"))
    assert learner.stats.push_errors == 1 and learner.weights.resync.is_set()
    learner.update(_batch(learner, 1))  # the window has room again: pushed at once
    assert len(ps.pushes) == 2 and ps.pushes[1][2] == 8


class ApplyingPS(FakePS):
    """Replies to each push at once, as a server that applies it: new weights, version + 1."""

    def push_future(self, base_version, msgs, batch_size=0, timeout=None, return_weights=False,
                    more_steps=()):
        fut = super().push_future(base_version, msgs, batch_size, timeout, more_steps=more_steps)
        self.weights = {n: w - 0.01 * self.pushes[-1][1][n] for n, w in self.weights.items()}
        self.reply(len(self.pushes) - 1)
        return fut


def test_pull_lag_0_trains_every_batch_on_the_weights_its_previous_push_made():
    learner, _ = _learner("learner.sync=synchronous", "learner.max_pushes_in_flight=1")
    ps = ApplyingPS(learner.ps.weights, version=7)
    use_ps(learner, ps)
    for i in range(3):
        learner.update(_batch(learner, i))
        assert learner.version == ps.version == 8 + i  # pulled before the next update
        for n, p in learner.model.named_parameters():
            torch.testing.assert_close(p.detach(), ps.weights[n])
    assert [p[0] for p in ps.pushes] == [7, 8, 9]  # staleness 0 at the server
    assert ps.pulls == [7, 8, 9] and not learner.weights.want_pull.is_set()


class ReplyingPS(ApplyingPS):
    """ApplyingPS whose replies carry the weights they made when asked (return_weights)."""

    def push_future(self, base_version, msgs, batch_size=0, timeout=None, return_weights=False,
                    more_steps=()):
        fut = super().push_future(base_version, msgs, batch_size, timeout, more_steps=more_steps)
        if return_weights:
            fut.result().weights = [encode(n, w, "fp32") for n, w in self.weights.items()]
        return fut


def test_pull_lag_0_loads_the_weights_from_the_push_reply_without_a_pull():
    learner, _ = _learner("learner.sync=synchronous", "learner.max_pushes_in_flight=1")
    ps = ReplyingPS(learner.ps.weights, version=7)
    use_ps(learner, ps)
    for i in range(3):
        learner.update(_batch(learner, i))
        assert learner.version == ps.version == 8 + i
        for n, p in learner.model.named_parameters():
            torch.testing.assert_close(p.detach(), ps.weights[n])
    assert [p[0] for p in ps.pushes] == [7, 8, 9] and ps.pulls == []


def test_overlapped_pushes_ask_for_their_weights_and_the_replies_replace_the_pulls():
    learner, _ = _learner("learner.pull_lag_versions=1", "learner.max_pushes_in_flight=2")
    ps = ReplyingPS(learner.ps.weights, version=7)
    use_ps(learner, ps)
    asked = []
    push_future = ps.push_future
    ps.push_future = lambda *a, **k: (asked.append(k.get("return_weights")), push_future(*a, **k))[1]
    for i in range(3):
        learner.swap_in_weights()  # what step() does before each update
        learner.update(_batch(learner, i))
    learner.swap_in_weights()
    assert asked == [True, True, True] and ps.pulls == [] and not learner.weights.want_pull.is_set()
    assert learner.version == ps.version == 10
    for n, p in learner.model.named_parameters():
        torch.testing.assert_close(p.detach(), ps.weights[n])


def test_one_push_at_a_time_asks_for_weights_and_the_others_wait_for_it_instead_of_pulling():
    learner, ps = _learner("learner.pull_lag_versions=1", "learner.max_pushes_in_flight=4")
    asked = []
    push_future = ps.push_future
    ps.push_future = lambda *a, **k: (asked.append(k.get("return_weights")), push_future(*a, **k))[1]
    for i in range(3):
        learner.update(_batch(learner, i))
    assert asked == [True, False, False]
    ps.reply(1)  # a push that did not ask: the weights are on their way with push 0
    assert not learner.weights.want_pull.is_set()
    ps.reply(0)  # the reply came without weights (a model over one message): pull
    assert learner.weights.want_pull.is_set() and ps.pulls == []
    learner.update(_batch(learner, 3))
    assert asked == [True, False, False, True]


def test_a_pull_older_than_the_weights_a_reply_brought_is_not_swapped_in():
    learner, _ = _learner("learner.pull_lag_versions=1", "learner.max_pushes_in_flight=2")
    ps = ReplyingPS(learner.ps.weights, version=7)
    use_ps(learner, ps)
    learner.update(_batch(learner, 0))  # the reply brings version 8
    assert learner.weights.pending[0] == 8
    ps.version = 7  # a pull served before that push was applied, completing after it
    ps.pull = lambda have_version=0, timeout=None, **_: (7, {k: v.clone() for k, v in ps.weights.items()})
    learner.weights.want_pull.set()
    t = threading.Thread(target=learner.weights.pull_loop, daemon=True)
    t.start()
    while learner.weights.want_pull.is_set():
        t.join(0.05)
    learner._stop.set()
    t.join(2)
    assert learner.weights.pending[0] == 8
    learner.swap_in_weights()
    assert learner.version == 8 and learner.stats.server_rollbacks == 0


def test_a_reply_older_than_the_loaded_weights_is_neither_swapped_in_nor_a_rollback():
    learner, ps = _learner("learner.pull_lag_versions=1", "learner.max_pushes_in_flight=2")
    learner.weights.version = 9  # a pull brought version 9 before the reply of the push that made 8

    class Reply:
        version, staleness = 8, 0
        weights = [encode(n, w, "fp32") for n, w in ps.weights.items()]
    assert learner.weights.offer_weights(Reply())  # no pull needed: the replica is newer
    assert learner.weights.pending is None
    learner.swap_in_weights()
    assert learner.version == 9 and learner.stats.server_rollbacks == 0


def test_a_reply_offered_while_newer_weights_are_being_loaded_is_not_a_rollback():
    """The update loop has taken version 10 from the pending slot but not yet set its
    version (it is copying the weights in) when a callback offers the reply that made 8."""
    learner, ps = _learner("learner.pull_lag_versions=1", "learner.max_pushes_in_flight=2")
    weights = {n: w.clone() for n, w in ps.weights.items()}
    learner.weights.pending = (10, weights)

    class Reply:
        version, staleness = 8, 0
        weights = [encode(n, w, "fp32") for n, w in ps.weights.items()]
    load = learner.weights.load
    offered = []

    def load_while_a_reply_arrives(version, w):
        offered.append(learner.weights.offer_weights(Reply()))  # self.version is still 7 here
        load(version, w)
    learner.weights.load = load_while_a_reply_arrives
    learner.swap_in_weights()
    assert offered == [True] and learner.version == 10
    assert learner.weights.pending is None  # the older reply was not queued behind them
    learner.swap_in_weights()
    assert learner.version == 10 and learner.stats.server_rollbacks == 0


@pytest.mark.parametrize("override, key", [("learner.max_batches_per_push=0", "learner.max_batches_per_push"),
                                           ("learner.max_pushes_in_flight=-1", "learner.max_pushes_in_flight"),
                                           ("learner.push_timeout_s=0", "learner.push_timeout_s"),
                                           ("learner.pull_lag_versions=0", "learner.pull_lag_versions"),
                                           ("learner.steps_per_push=0", "learner.steps_per_push"),
                                           ("learner.steps_per_push=65", "learner.steps_per_push"),
                                           # several steps per call need the replica's own steps
                                           ("learner.steps_per_push=4", "learner.sync: local_replica"),
                                           ("learner.pull_lag_versions=0", "learner.sync: synchronous"),
                                           ("learner.apply_locally=true", "replaced by learner.sync")])
def test_window_settings_out_of_range_fail_at_load_naming_the_key(override, key):
    with pytest.raises(errors.ConfigError, match=key):
        load_config(None, [override])


@pytest.mark.parametrize("limit", [1e-3, 1e6])
def test_the_pushed_gradient_is_clipped_to_the_norm_limit_and_the_pre_clip_norm_recorded(limit):
    learner, ps = _learner("learner.max_pushes_in_flight=4", f"learner.grad_clip_norm={limit}")
    item = _batch(learner, 3)
    ref = copy.deepcopy(learner.model)  # the same update by hand, with torch's own clipping
    batch, _ = item
    loss, _ = learner.algo.loss(batch, 0)
    loss.backward()
    for (name, p), (_, q) in zip(learner.model.named_parameters(), ref.named_parameters()):
        q.grad = p.grad.detach().clone()
        p.grad = None
    expected_norm = float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), limit))
    learner.update(item)
    _, pushed, _, _ = ps.pushes[-1]
    assert learner.stats.grad_norm == pytest.approx(expected_norm, rel=1e-6)
    total = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in pushed.values()])))
    assert total == pytest.approx(min(limit, expected_norm), rel=1e-5)
    for name, q in ref.named_parameters():
        torch.testing.assert_close(pushed[name], q.grad, rtol=1e-6, atol=1e-9)


def test_reported_loss_and_mean_q_average_the_last_log_window_and_max_q_is_its_largest():
    learner, ps = _learner("learner.max_pushes_in_flight=4")
    losses, qs, q_maxes = [], [], []
    for i in range(LOG_WINDOW):
        item = _batch(learner, i)
        batch, _ = item
        with torch.no_grad():  # the figures of this update, by hand, on the weights it uses
            q_all = learner.model(batch.obs)
            q = q_all.gather(1, batch.actions.reshape(-1, 1))
            qs.append(float(q.mean()))
            q_maxes.append(float(q.max()))
            losses.append(float(learner.algo.loss(batch, i)[0]))
        assert learner.stats.q_mean == 0.0  # nothing reported before a whole window
        learner.update(item)
        for j, push in enumerate(ps.pushes):  # the server applies each push at once
            if not push[3].done():
                ps.reply(j)
    assert learner.stats.q_mean == pytest.approx(sum(qs) / LOG_WINDOW, rel=1e-5)
    assert learner.stats.q_max == pytest.approx(max(q_maxes), rel=1e-5)
    assert learner.stats.loss == pytest.approx(sum(losses) / LOG_WINDOW, rel=1e-5)


def test_a_push_reply_from_a_new_server_incarnation_resyncs_even_at_a_higher_version():
    learner, ps = _learner()
    learner.update(_batch(learner, 0))
    ps.reply(0)  # incarnation 1: the server's life the learner knows from now on
    assert not learner.weights.resync.is_set()
    learner.update(_batch(learner, 1))
    # the server restarted in between (other weights); its version happens to be higher
    ps.weights = {n: torch.full_like(w, 0.25) for n, w in ps.weights.items()}

    class Reply:
        version, incarnation, weights, staleness = 50, 2, [], 0
    ps.pushes[1][3].set_result(Reply())
    assert learner.weights.resync.is_set() and learner.weights.want_pull.is_set()
    assert learner.stats.pushes_applied == 1  # the new life's reply is not taken as ours


class _Replay:
    """sample raises the errors given, in turn, then a bug."""

    def __init__(self, *errors_first):
        self.errors = list(errors_first)
        self.calls = 0

    def sample(self, batch_size, beta, timeout=None):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        raise RuntimeError("a bug below the prefetch thread")

    def update_priorities(self, keys, priorities, timeout=None):
        pass


def test_a_prefetch_thread_that_died_stops_the_learner_instead_of_leaving_it_idle():
    learner, _ = _learner()
    # a full shard is retried (not fatal); a bug ends the learner with its cause
    learner.feed.replay = _Replay(errors.ResourceExhausted("256 Sample calls are already open"))
    learner.start()
    try:
        with pytest.raises(ThreadDied, match="prefetch thread died: RuntimeError"):
            for _ in range(20):
                learner.step(timeout=0.5)
        assert learner.feed.replay.calls == 2
    finally:
        learner.stop()


def test_readiness_follows_replay_going_away_and_coming_back():
    learner, _ = _learner()
    seen = []
    learner.on_replay = seen.append
    learner.feed.replay = _Replay(errors.Unavailable("connection refused"),
                             errors.Unavailable("connection refused"),
                             errors.DeadlineExceeded("below min size"))
    learner.start()
    try:
        with pytest.raises(ThreadDied):  # the _Replay's closing bug ends the test
            for _ in range(20):
                learner.step(timeout=0.5)
    finally:
        learner.stop()
    assert seen == [False, True]  # once down, once back: no repeats
