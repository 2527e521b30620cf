"""ParameterStore: Adam steps, the staleness rule, subset pushes and input validation."""

import copy
import threading

import pytest
import torch
from torch import nn

from amprl.errors import FailedPrecondition, InvalidArgument
from amprl.paramserver.store import ParameterStore, Step
from amprl.paramserver.weights import VersionedWeights


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Module()
    m.actor = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    m.critic = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 1))
    return m


def grads_for(store: ParameterStore, seed: int = 1, names=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in store.shapes.items()
            if names is None or n in names}


def weights(store: ParameterStore) -> dict[str, torch.Tensor]:
    return store.snapshot()[1]


def optimizer_state(store: ParameterStore) -> dict:
    return copy.deepcopy(store.optimizer.state_dict()["state"])


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].keys() == b[k].keys()
        for kk in a[k]:
            assert torch.equal(a[k][kk], b[k][kk]), (k, kk)


def test_apply_is_one_adam_step_and_advances_the_version():
    model = tiny_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-8)
    store = ParameterStore.from_model(model, lr=1e-2)
    for step in range(3):
        grads = grads_for(store, seed=step)
        result = store.apply(step, grads, learner_id="learner-0", batch_size=32)
        assert (result.version, result.staleness, result.scale, result.scaled) == (step + 1, 0, 1.0, False)
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
    for n, p in ref.named_parameters():
        assert torch.allclose(weights(store)[n], p.detach(), atol=1e-7), n
    info = store.info()
    assert info["version"] == 3 and info["pushes_applied"] == 3 and info["transitions_trained"] == 96


@pytest.mark.parametrize("staleness_scaling", [False, True])
def test_apply_reads_the_gradients_and_never_writes_them(staleness_scaling):
    # the store steps with the caller's tensors as .grad (no copy): a learner's
    # a local replica (learner.sync: local_replica) passes its compressor's decoded gradients, which must stay as sent
    store = ParameterStore.from_model(tiny_model(), lr=1e-2, staleness_scaling=staleness_scaling)
    names = list(store.shapes)
    for step in range(3):
        grads = grads_for(store, seed=step)
        kept = {n: g.clone() for n, g in grads.items()}
        store.apply(max(0, step - 1), grads, preconditioned={names[0]}, trusted=step == 2)
        assert all(torch.equal(grads[n], kept[n]) for n in grads), step
        assert all(p.grad is None for p in store.params.values())


def test_linear_lr_schedule_matches_adam_with_the_same_per_step_lr_and_survives_a_restore():
    model = tiny_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    store = ParameterStore.from_model(model, lr=1e-2, lr_final=1e-3, lr_decay_versions=4)
    assert [store.lr_at(v) for v in (0, 2, 4, 9)] == pytest.approx([1e-2, 5.5e-3, 1e-3, 1e-3])
    for step in range(6):
        grads = grads_for(store, seed=step)
        store.apply(step, grads)
        opt.param_groups[0]["lr"] = 1e-2 + (1e-3 - 1e-2) * min(1.0, step / 4)
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        if step == 2:  # a server restarted from a checkpoint continues the schedule
            resumed = ParameterStore.from_model(tiny_model(), lr=1e-2, lr_final=1e-3, lr_decay_versions=4)
            resumed.load_state_dict(store.state_dict())
            store = resumed
    for n, p in ref.named_parameters():
        assert torch.allclose(weights(store)[n], p.detach(), atol=1e-7), n
    assert ParameterStore.from_model(tiny_model(), lr=1e-2, lr_final=-1, lr_decay_versions=4).lr_at(9) == 1e-2


def test_stale_gradient_within_the_bound_is_applied_as_sent():
    store = ParameterStore.from_model(tiny_model(), max_staleness=2)
    for v in range(3):
        store.apply(v, grads_for(store, v))
    result = store.apply(1, grads_for(store, 9))
    assert (result.staleness, result.scale, result.scaled, result.version) == (2, 1.0, False, 4)
    assert store.info()["max_staleness"] == 2


def test_stale_gradient_is_scaled_by_one_over_one_plus_staleness():
    a = ParameterStore.from_model(tiny_model(), max_staleness=4, staleness_scaling=True, lr=1e-2)
    b = ParameterStore.from_model(tiny_model(), max_staleness=4, staleness_scaling=False, lr=1e-2)
    for store in (a, b):
        for v in range(3):
            store.apply(v, grads_for(store, v))
    g = grads_for(a, 7)
    result = a.apply(0, g)  # staleness 3
    assert result.scaled and result.scale == pytest.approx(0.25) and result.staleness == 3
    b.apply(3, {n: t * 0.25 for n, t in g.items()})
    for n in a.shapes:
        assert torch.allclose(weights(a)[n], weights(b)[n], atol=1e-7)
    assert a.info()["pushes_scaled"] == 1 and a.info()["pushes_applied"] == 3


def test_too_stale_is_rejected_with_the_current_version_and_changes_nothing():
    store = ParameterStore.from_model(tiny_model(), max_staleness=1)
    for v in range(3):
        store.apply(v, grads_for(store, v))
    before, state = weights(store), optimizer_state(store)
    with pytest.raises(FailedPrecondition, match="too stale") as err:
        store.apply(1, grads_for(store, 5))
    assert err.value.current_version == 3
    with pytest.raises(FailedPrecondition, match="ahead of") as err:
        store.apply(7, grads_for(store, 5))
    assert err.value.current_version == 3
    assert store.version == 3 and store.info()["pushes_rejected_stale"] == 2
    assert all(torch.equal(before[n], weights(store)[n]) for n in before)
    assert_same_state(state, optimizer_state(store))


def test_subset_push_steps_only_the_named_parameters_and_leaves_the_others_adam_state():
    store = ParameterStore.from_model(tiny_model())
    store.apply(0, grads_for(store, 0))  # every parameter has Adam state now
    before, state = weights(store), optimizer_state(store)
    critic = [n for n in store.shapes if n.startswith("critic")]
    store.apply(1, grads_for(store, 1, names=critic))
    after, state_after = weights(store), optimizer_state(store)
    names = list(store.shapes)
    for i, n in enumerate(names):
        if n in critic:
            assert not torch.equal(before[n], after[n]), n
            assert state_after[i]["step"] == state[i]["step"] + 1
        else:
            assert torch.equal(before[n], after[n]), n
            for k in state[i]:
                assert torch.equal(state[i][k], state_after[i][k]), (n, k)
    assert store.version == 2


def test_subset_push_before_any_full_push_creates_no_state_for_absent_parameters():
    store = ParameterStore.from_model(tiny_model())
    critic = [n for n in store.shapes if n.startswith("critic")]
    store.apply(0, grads_for(store, 0, names=critic))
    idx = {n: i for i, n in enumerate(store.shapes)}
    state = store.optimizer.state_dict()["state"]
    assert set(state) == {idx[n] for n in critic}


def _nan(store):
    g = grads_for(store)
    last = list(g)[-1]  # the bad tensor comes after valid ones: nothing may be half-applied
    g[last] = g[last].clone()
    g[last].view(-1)[0] = float("nan")
    return g


def _inf(store):
    g = grads_for(store)
    first = list(g)[0]
    g[first] = torch.full_like(g[first], float("inf"))
    return g


BAD_PUSHES = {
    "unknown name": (lambda s: {**grads_for(s), "critic.9.weight": torch.ones(2)}, "not a parameter"),
    "wrong shape": (lambda s: {**grads_for(s), "actor.0.weight": torch.ones(3, 4)}, "shape"),
    "integer dtype": (lambda s: {**grads_for(s), "actor.0.bias": torch.ones(4, dtype=torch.int64)},
                      "floating-point"),
    "nan": (_nan, "NaN or infinite"),
    "inf": (_inf, "NaN or infinite"),
    "empty": (lambda s: {}, "no gradients"),
}


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_every_bad_push_is_invalid_argument_and_leaves_the_store_untouched(case, steps):
    """Alone, and as the last step of a 3-step push (the good steps before it are not
    applied either)."""
    make, match = BAD_PUSHES[case]
    store = ParameterStore.from_model(tiny_model())
    store.apply(0, grads_for(store, 0))
    before, state = weights(store), optimizer_state(store)
    if steps == 1:
        with pytest.raises(InvalidArgument, match=match):
            store.apply(1, make(store))
    else:
        bad = [Step(grads_for(store, 1)), Step(grads_for(store, 2)), Step(make(store))]
        with pytest.raises(InvalidArgument, match=f"step 2 of 3: .*{match}"):
            store.apply_steps(1, bad)
    assert store.version == 1
    assert all(torch.equal(before[n], weights(store)[n]) for n in before)
    assert_same_state(state, optimizer_state(store))
    assert store.info()["pushes_rejected_invalid"] == 1
    store.apply(1, grads_for(store, 3))  # and it keeps working
    assert store.version == 2


def test_a_multi_step_push_is_the_same_as_its_steps_pushed_one_by_one():
    one_by_one = ParameterStore.from_model(tiny_model(), lr=1e-2, lr_final=1e-3, lr_decay_versions=10)
    together = ParameterStore.from_model(tiny_model(), lr=1e-2, lr_final=1e-3, lr_decay_versions=10)
    steps = [grads_for(one_by_one, seed=k) for k in range(4)]
    steps[2] = {n: g for n, g in steps[2].items() if n.startswith("critic")}  # a critic-only step
    for k, g in enumerate(steps):
        one_by_one.apply(k, g, batch_size=32)
    result = together.apply_steps(0, [Step(g, batch_size=32) for g in steps])
    assert (result.version, result.staleness, result.scaled) == (4, 0, False)
    for n, w in weights(one_by_one).items():
        assert torch.equal(weights(together)[n], w), n  # the lr schedule stepped per version too
    assert_same_state(optimizer_state(one_by_one), optimizer_state(together))
    info = together.info()
    assert info["version"] == 4 and info["pushes_applied"] == 4 and info["transitions_trained"] == 128


def test_a_multi_step_push_is_judged_stale_once_on_its_base_version():
    store = ParameterStore.from_model(tiny_model(), max_staleness=2, staleness_scaling=True)
    for v in range(2):
        store.apply(v, grads_for(store, v))
    # computed on version 0 (its steps on 0, 1, 2): staleness 2 for every step, all scaled 1/3
    result = store.apply_steps(0, [Step(grads_for(store, k)) for k in range(5)])
    assert (result.version, result.staleness, result.scale) == (7, 2, 1 / 3)
    assert store.info()["pushes_scaled"] == 5
    with pytest.raises(FailedPrecondition) as err:  # base 4 at version 7: staleness 3
        store.apply_steps(4, [Step(grads_for(store, k)) for k in range(2)])
    assert err.value.current_version == 7 and store.version == 7


def test_concurrent_pushes_are_each_applied_once():
    store = ParameterStore.from_model(tiny_model(), max_staleness=1000)
    errors = []

    def learner(k):
        try:
            for i in range(25):
                store.apply(store.version, grads_for(store, k * 100 + i), learner_id=f"learner-{k}")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=learner, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.version == 100 and store.info()["pushes_applied"] == 100
    assert store.info()["learners_live"] == 4


def test_live_clients_count_recent_callers_and_open_watches(monkeypatch):
    store = ParameterStore.from_model(tiny_model(), live_window_s=10.0)
    clock = [1000.0]
    monkeypatch.setattr("amprl.paramserver.store.time.monotonic", lambda: clock[0])
    store.note_client("actor-0")
    store.note_client("actor-1")
    store.note_client("evaluator")
    store.watch_started("actor-2")
    store.apply(0, grads_for(store), learner_id="learner-0")
    assert store.live_clients() == (4, 3, 1)
    clock[0] += 11.0  # only the open watch is still live
    assert store.live_clients() == (1, 1, 0)
    store.watch_ended("actor-2")
    assert store.live_clients() == (1, 1, 0)  # it just left: seen within the window
    clock[0] += 11.0
    assert store.live_clients() == (0, 0, 0)


def test_wait_for_version_wakes_on_apply_and_on_close():
    store = ParameterStore.from_model(tiny_model())
    seen = []
    t = threading.Thread(target=lambda: seen.append(store.wait_for_version(0, timeout=10)))
    t.start()
    store.apply(0, grads_for(store))
    t.join(timeout=5)
    assert seen == [1]
    store.close()
    assert store.wait_for_version(1, timeout=10) == 1  # returns at once once closed


def test_preconditioned_gradients_take_a_momentum_step_without_a_second_moment():
    """m <- b1 m + (1 - b1) u;  p <- p - lr m / (1 - b1^t), momentum and count kept apart
    from Adam's; the parameters sent plain in the same push take Adam's step."""
    store = ParameterStore.from_model(tiny_model(), lr=1e-2)
    pre = {n for n in store.shapes if n.endswith("weight")}
    m = {n: torch.zeros(s) for n, s in store.shapes.items()}
    for step in range(3):
        w0, u = weights(store), grads_for(store, seed=step)
        store.apply(step, u, preconditioned=pre)
        w1 = weights(store)
        for n in pre:
            m[n] = 0.9 * m[n] + 0.1 * u[n]
            torch.testing.assert_close(w1[n], w0[n] - 1e-2 * m[n] / (1 - 0.9 ** (step + 1)))
    for i, name in enumerate(store.shapes):  # state is keyed by parameter index
        state = optimizer_state(store)[i]
        if name in pre:
            assert set(state) == {"step", "precond_step", "precond_avg"}
            assert float(state["precond_step"]) == 3 and float(state["step"]) == 0
        else:
            assert "precond_avg" not in state and float(state["step"]) == 3


def test_a_plain_gradient_after_preconditioned_ones_starts_adam_afresh():
    """A run resumed with another encoding: Adam's moments start from zero for a parameter
    that had only momentum steps (no KeyError, no stale count in the bias correction)."""
    model = tiny_model()
    store = ParameterStore.from_model(model, lr=1e-2)
    store.apply(0, grads_for(store, seed=0), preconditioned=set(store.shapes))
    ref = copy.deepcopy(tiny_model())
    ref.load_state_dict({n: w for n, w in weights(store).items()})
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-8)
    g = grads_for(store, seed=1)
    store.apply(1, g)
    for n, p in ref.named_parameters():
        p.grad = g[n].clone()
    opt.step()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(weights(store)[n], p.detach())


def test_momentum_steps_are_affine_in_the_gradient_and_adam_steps_are_not():
    """What lets error feedback work through the optimizer: from one state, a momentum
    step's weights are affine in the gradient, W(g1 + g2) + W(0) = W(g1) + W(g2), so what a
    1-bit gradient gets wrong now and its residual brings later add up as the true gradients
    would. Adam's steps (normalised by the gradient's own second moment) are not."""
    base = ParameterStore.from_model(tiny_model(), lr=1e-2)
    names = set(base.shapes)
    for step in range(2):
        base.apply(base.version, grads_for(base, seed=step), preconditioned=names)
        base.apply(base.version, grads_for(base, seed=step + 10))
    g1, g2 = grads_for(base, seed=5), grads_for(base, seed=6)
    cases = {"g1": g1, "g2": g2, "sum": {n: g1[n] + g2[n] for n in names},
             "zero": {n: torch.zeros_like(g1[n]) for n in names}}

    def after(g, preconditioned):
        s = ParameterStore.from_model(tiny_model(), lr=1e-2)
        s.load_state_dict(base.state_dict())
        s.apply(s.version, g, preconditioned=preconditioned)
        return weights(s)

    for preconditioned, affine in ((names, True), (set(), False)):
        w = {k: after(g, preconditioned) for k, g in cases.items()}
        gap = max(float((w["sum"][n] + w["zero"][n] - w["g1"][n] - w["g2"][n]).abs().max())
                  for n in names)
        assert (gap < 1e-6) == affine, (preconditioned, gap)


def test_a_learners_replica_stepped_by_the_rule_matches_the_server(tmp_path):
    """learner.sync: local_replica: the learner steps its model's own weights with the server's
    OptimizerRule (no copy) and lands exactly where the store does, 1-bit momentum steps and
    the lr schedule included."""
    from amprl.rl.optimizer import OptimizerRule

    model = tiny_model()
    store = ParameterStore.from_model(copy.deepcopy(model), lr=1e-2, lr_final=1e-3,
                                      lr_decay_versions=4)
    params = dict(model.named_parameters())
    rule = OptimizerRule(params, lr=1e-2, lr_final=1e-3, lr_decay_versions=4)
    pointers = {n: p.data_ptr() for n, p in params.items()}
    for step in range(6):
        grads = grads_for(store, seed=step)
        precond = {next(iter(grads))} if step % 2 else set()
        store.apply(step, grads, preconditioned=precond)
        rule.step(grads, step, preconditioned=precond)
    for name, p in model.named_parameters():
        assert p.data_ptr() == pointers[name]  # stepped in place
        assert torch.equal(p.detach(), store.params[name].detach()), name
        assert p.grad is None


def test_every_change_of_the_weights_gets_a_new_revision():
    store = ParameterStore.from_model(tiny_model(), lr=1e-2)
    assert store.snapshot().revision == 0
    result = store.apply(0, grads_for(store), snapshot=True)
    assert result.revision == store.revision == store.snapshot().revision == 1
    store.load_state_dict(store.state_dict())
    assert store.revision == 2 and store.version == 1


def test_versioned_weights_take_a_followed_servers_weights_whole():
    # a follower's only write: any version, up or down, even the number it holds
    follower = VersionedWeights.from_model(tiny_model())
    source = weights(ParameterStore.from_model(tiny_model(seed=5)))
    follower.replace(7, source)
    assert (follower.version, follower.revision) == (7, 1)
    assert all(torch.equal(weights(follower)[n], source[n]) for n in source)
    follower.replace(3, weights(ParameterStore.from_model(tiny_model())))
    follower.replace(3, source)
    assert (follower.version, follower.revision) == (3, 3)
    assert all(torch.equal(weights(follower)[n], source[n]) for n in source)
    assert not hasattr(follower, "optimizer")
    info = follower.info()
    assert info["version"] == 3 and info["pushes_applied"] == 0


@pytest.mark.parametrize("change", ["missing", "unknown", "shape"])
def test_weights_of_another_model_are_refused_and_change_nothing(change):
    follower = VersionedWeights.from_model(tiny_model())
    before = weights(follower)
    other = {n: torch.ones_like(t) for n, t in before.items()}
    if change == "missing":
        other.pop("critic.2.bias")
    elif change == "unknown":
        other["critic.9.weight"] = torch.ones(1)
    else:
        other["actor.0.weight"] = torch.ones(3, 4)
    with pytest.raises(InvalidArgument, match="critic.2.bias|critic.9.weight|actor.0.weight"):
        follower.replace(1, other)
    assert (follower.version, follower.revision) == (0, 0)
    assert all(torch.equal(weights(follower)[n], before[n]) for n in before)
