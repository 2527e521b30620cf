"""Bounded updates: the push-norm rule (``PushNormBound``) as plain Python, and the store
refusing a push over it with nothing changed."""

import copy
import math
import random

import pytest
import torch

from amprl.config import ParamServerConfig, config_from_dict
from amprl.errors import FailedPrecondition, InvalidArgument
from amprl.paramserver import admission
from amprl.paramserver.admission import PushNormBound, push_norm
from amprl.paramserver.store import ParameterStore, Step, build_store
from amprl.wire.compressed import decode, encode

# -- the rule ------------------------------------------------------------------------------


def test_push_norm_is_the_global_l2_norm_of_all_tensors():
    grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]]), "c": torch.zeros(0)}
    assert push_norm(grads) == 5.0
    assert push_norm({"h": torch.tensor([3.0, 4.0], dtype=torch.bfloat16)}) == 5.0


def test_push_norm_names_the_real_value_where_float32_overflows():
    # (1e20)^2 overflows float32: the norm is measured again in float64
    assert push_norm({"w": torch.full((8,), 1e20)}) == pytest.approx(math.sqrt(8) * 1e20)
    assert push_norm({"w": torch.full((4,), 3e38)}) == pytest.approx(6e38)


def test_the_bound_is_the_absolute_cap_until_the_window_is_full():
    rule = PushNormBound(max_norm=1e3, ratio=10, window=4, floor=0)
    for _ in range(3):
        rule.check([900.0])  # a step far above its predecessors is let through: no statistic yet
        rule.accept([1.0])
    assert rule.bound == 1e3
    with pytest.raises(InvalidArgument, match="max_push_norm, until 4 steps are accepted"):
        rule.check([1001.0])
    rule.accept([1.0])
    assert rule.bound == 10.0  # full: 10 x the median 1


def test_after_the_warm_up_the_bound_is_ratio_times_the_median_of_accepted_norms():
    rule = PushNormBound(max_norm=1e6, ratio=100, window=5, floor=0)
    rule.accept([1.0, 2.0, 3.0, 1000.0, 4.0])  # one outlier does not move the median
    assert (rule.median, rule.bound) == (3.0, 300.0)
    rule.check([300.0])
    with pytest.raises(InvalidArgument):
        rule.check([300.1])


def test_the_bound_stays_between_the_floor_and_the_cap():
    rule = PushNormBound(max_norm=50.0, ratio=100, window=3, floor=10.0)
    rule.accept([1e-4] * 3)
    assert rule.bound == 10.0  # 100 x 1e-4 = 0.01, lifted to the floor
    rule.accept([1.0] * 3)
    assert rule.bound == 50.0  # 100 x 1 = 100, capped


def test_a_sparse_rewards_first_gradient_at_the_floor_is_accepted():
    # zero-reward steps fit the values to ~0; the first reward's gradient is 10^4 x their median
    rule = PushNormBound(window=100)
    rule.accept([1e-4] * 100)
    rule.check([1.0])  # under the floor (10): accepted although 100 x the median is 0.01


def test_the_median_follows_a_tenfold_drift_without_refusing_a_step():
    """Norms that grow 10x over a run (and back), with log-normal noise of a factor ~2
    around the trend, are never refused, even with the floor out of the way."""
    rule = PushNormBound(window=100, floor=0.0)
    rng = random.Random(0)
    for t in range(20_000):
        trend = 10 ** (t / 10_000) if t < 10_000 else 10 ** (2 - t / 10_000)
        norm = 1e-3 * trend * math.exp(rng.gauss(0.0, 0.7))
        rule.check([norm])
        rule.accept([norm])


def test_checking_changes_nothing_and_only_accepted_norms_move_the_bound():
    rule = PushNormBound(window=3, floor=0)
    rule.accept([1.0, 1.0, 1.0])
    for _ in range(10):
        with pytest.raises(InvalidArgument):
            rule.check([1e5])
    assert (rule.norms(), rule.bound) == ([1.0, 1.0, 1.0], 100.0)


def test_a_refusal_names_the_norm_the_bound_its_origin_and_the_knob():
    rule = PushNormBound(window=2, floor=0)
    rule.accept([2.0, 2.0])
    with pytest.raises(InvalidArgument) as err:
        rule.check([1.0, 512.0])
    msg = str(err.value)
    assert msg.startswith("step 1 of 2: gradient norm 512 exceeds the bound 200 ")
    assert "max_push_norm_ratio 100 x 2, the median norm of the last 2 accepted steps" in msg
    assert "learner.grad_clip_norm" in msg and msg.endswith(
        "raise paramserver.max_push_norm_ratio if such steps are expected")


@pytest.mark.parametrize("kwargs", [dict(max_norm=0), dict(ratio=1), dict(window=0), dict(floor=-1)])
def test_a_bad_setting_is_refused(kwargs):
    with pytest.raises(InvalidArgument, match="push norm bound"):
        PushNormBound(**kwargs)


def test_the_rules_defaults_are_the_configs():
    ps = ParamServerConfig()
    assert (admission.DEFAULT_MAX_PUSH_NORM, admission.DEFAULT_MAX_PUSH_NORM_RATIO,
            admission.DEFAULT_PUSH_NORM_WINDOW, admission.DEFAULT_PUSH_NORM_FLOOR) == (
        ps.max_push_norm, ps.max_push_norm_ratio, ps.push_norm_window, ps.push_norm_floor)
    cfg = config_from_dict({"paramserver": {"max_push_norm": 5.0, "max_push_norm_ratio": 3.0,
                                            "push_norm_window": 7, "push_norm_floor": 0.5}})
    rule = build_store(cfg, torch.nn.Linear(2, 1)).norm_bound
    assert (rule.max_norm, rule.ratio, rule.window, rule.floor) == (5.0, 3.0, 7, 0.5)


# -- the store -----------------------------------------------------------------------------

NORMAL_STEPS = 1000


def normal_grads(n: int = NORMAL_STEPS) -> list[torch.Tensor]:
    """Gradients of a small parameter with a steady direction (norm ~0.3)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, generator=g) * 0.1 + 0.05 for _ in range(n)]


def moved_by_normal_steps(store: ParameterStore, grads: list[torch.Tensor]) -> torch.Tensor:
    """The weights' change over ``grads``, one push each."""
    start = store.params["w"].detach().clone()
    for g in grads:
        store.apply(store.version, {"w": g})
    return store.params["w"].detach() - start


def what_a_push_may_change(store: ParameterStore) -> dict:
    info = store.info()
    return {"state": store.state_dict(), "revision": store.revision,
            **{k: info[k] for k in ("version", "pushes_applied", "pushes_scaled",
                                    "pushes_rejected_invalid", "push_norm_bound")}}


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b) and all(assert_same(x, y) is None for x, y in zip(a, b))
    else:
        assert a == b


def test_without_the_bound_one_huge_push_freezes_adam():
    """What the bound prevents: a finite 1e20 gradient fills Adam's second moment, and the
    next 1,000 normal steps move the weights ~1% as far as they would have."""
    unbounded = PushNormBound(max_norm=math.inf, ratio=math.inf)
    control = moved_by_normal_steps(ParameterStore({"w": torch.zeros(8)}, lr=1e-3), normal_grads())
    hit = ParameterStore({"w": torch.zeros(8)}, lr=1e-3, norm_bound=unbounded)
    hit.apply(0, {"w": torch.full((8,), 1e20)})
    frozen = moved_by_normal_steps(hit, normal_grads())
    assert frozen.norm() < 0.02 * control.norm()


def test_a_huge_push_is_refused_and_training_goes_on_as_without_it():
    grads = normal_grads()
    control_store = ParameterStore({"w": torch.zeros(8)}, lr=1e-3)
    moved_by_normal_steps(control_store, grads[:200])
    control = moved_by_normal_steps(control_store, grads[200:])

    store = ParameterStore({"w": torch.zeros(8)}, lr=1e-3)
    moved_by_normal_steps(store, grads[:200])  # past the warm-up: the ratio applies too
    before = what_a_push_may_change(store)
    for huge in (1e20, 1e5):  # over the cap; under it but 10^5 x the median
        with pytest.raises(InvalidArgument, match="gradient norm .* exceeds the bound"):
            store.apply(store.version, {"w": torch.full((8,), huge)})
    assert_same(before, what_a_push_may_change(store))
    assert store.info()["pushes_rejected_norm"] == 2
    assert torch.equal(moved_by_normal_steps(store, grads[200:]), control)
    assert control.norm() > 1.0


def test_a_one_bit_step_with_a_huge_scale_is_refused_and_changes_nothing():
    """A preconditioned 1-bit tensor takes a momentum step linear in its scale: unbounded,
    one scale of 1e36 puts the weights near 1e33."""
    store = ParameterStore({"w": torch.zeros(4096)}, lr=1e-3)
    msg = encode("w", torch.randn(4096), "onebit", block_size=2048)
    msg.preconditioned = True
    msg.scales = torch.tensor([1e36, 1.0]).numpy().tobytes()
    huge = decode(msg)
    before = what_a_push_may_change(store)
    with pytest.raises(InvalidArgument, match="exceeds the bound 1e\\+06"):
        store.apply(0, {"w": huge}, preconditioned={"w"})
    assert_same(before, what_a_push_may_change(store))

    unbounded = ParameterStore({"w": torch.zeros(4096)}, lr=1e-3,
                               norm_bound=PushNormBound(max_norm=math.inf))
    unbounded.apply(0, {"w": huge}, preconditioned={"w"})
    assert unbounded.params["w"].abs().max() > 1e32


def test_a_multi_step_push_with_one_huge_step_is_refused_whole():
    store = ParameterStore({"w": torch.zeros(8)}, lr=1e-3)
    before = what_a_push_may_change(store)
    steps = [Step({"w": g}) for g in normal_grads(2)] + [Step({"w": torch.full((8,), 1e9)})]
    with pytest.raises(InvalidArgument, match="^step 2 of 3: gradient norm"):
        store.apply_steps(0, steps)
    assert_same(before, what_a_push_may_change(store))


def test_the_norm_is_judged_before_the_staleness_rule():
    store = ParameterStore({"w": torch.zeros(8)}, lr=1e-3, max_staleness=1)
    moved_by_normal_steps(store, normal_grads(5))
    with pytest.raises(InvalidArgument):  # stale as well as huge: refused for its size
        store.apply(0, {"w": torch.full((8,), 1e20)})
    with pytest.raises(FailedPrecondition):
        store.apply(0, {"w": torch.ones(8)})
    info = store.info()
    assert (info["pushes_rejected_norm"], info["pushes_rejected_stale"]) == (1, 1)


def test_the_statistic_is_judged_before_staleness_scaling_and_kept_by_checkpoints():
    bound = PushNormBound(window=4, floor=0)
    store = ParameterStore({"w": torch.zeros(8)}, lr=1e-3, staleness_scaling=True, norm_bound=bound)
    for g in normal_grads(4):
        store.apply(max(0, store.version - 1), {"w": g})  # scaled by 1/2: recorded as sent
    assert bound.norms() == [push_norm({"w": g}) for g in normal_grads(4)]
    state = store.state_dict()
    resumed = ParameterStore({"w": torch.zeros(8)}, lr=1e-3,
                             norm_bound=PushNormBound(window=4, floor=0))
    resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.norm_bound.norms() == bound.norms() and resumed.info()["push_norm_bound"] == bound.bound
    older = {k: v for k, v in state.items() if k != "push_norms"}  # a checkpoint from before the rule
    resumed.load_state_dict(older)
    assert resumed.norm_bound.norms() == [] and resumed.norm_bound.bound == bound.max_norm

