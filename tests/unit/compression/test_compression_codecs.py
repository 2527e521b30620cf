"""The wire encodings and error feedback, as pure functions."""

import math

import numpy as np
import pytest
import torch

from amprl.wire.compressed import ErrorFeedback, decode, encode
from amprl.compression.codecs import block_scales, pack_signs, unpack_signs
from amprl.errors import InvalidArgument
from amprl.v1 import tensor_pb2

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4099])
def test_packing_round_trips_exactly(n, device):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(device)
    x[::5] = 0.0  # zero counts as non-negative
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed, n), expected)


def test_bit_7_of_byte_0_is_element_0_and_padding_is_zero():
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 0.0, -2.0, 3.0])
    packed = pack_signs(x).tolist()
    assert packed == [0b1000_0001, 0b0100_0000]
    # The same layout as numpy's big-endian packbits.
    np.testing.assert_array_equal(np.packbits((x.numpy() >= 0).astype(np.uint8)), packed)


@pytest.mark.parametrize("device", DEVICES)
def test_onebit_decodes_to_sign_times_block_mean_abs(device):
    n, block = 1000, 96  # 11 blocks, the last one 40 elements
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(device) * 3
    msg = encode("layer.weight", x.view(10, 100), "onebit", block_size=block)
    assert msg.encoding == tensor_pb2.ENCODING_ONE_BIT and list(msg.shape) == [10, 100]
    assert len(msg.data) == 125 and len(msg.scales) == 4 * 11 and msg.block_size == block
    y = decode(msg, device=device).view(-1)
    scales = np.frombuffer(msg.scales, "<f4").copy()
    xa = x.cpu().numpy()
    for k in range(11):
        blk = xa[k * block:(k + 1) * block]
        assert scales[k] == pytest.approx(np.abs(blk).mean(), rel=1e-5)
    assert torch.equal(torch.sign(y), torch.where(x >= 0, 1.0, -1.0))
    expected = torch.as_tensor(np.repeat(scales, block)[:n], device=device) * torch.sign(y)
    assert torch.allclose(y, expected)
    assert torch.allclose(block_scales(x, block).cpu(), torch.as_tensor(scales))


@pytest.mark.parametrize("encoding,tol", [("fp32", 0.0), ("bf16", 2**-8), ("fp16", 2**-11)])
def test_dense_encodings_round_trip(encoding, tol):
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(2))
    y = decode(encode("w", x, encoding))
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.allclose(y, x, rtol=tol, atol=0)
    exact = torch.tensor([0.5, -2.0, 1.25, 0.0, 1024.0])  # representable in all three
    assert torch.equal(decode(encode("b", exact, encoding)), exact)
    bytes_per = {"fp32": 4, "bf16": 2, "fp16": 2}[encoding]
    assert len(encode("w", x, encoding).data) == bytes_per * x.numel()


def test_bf16_keeps_the_fp32_bit_pattern_upper_half():
    x = torch.tensor([1.0, -3.5, 2.0**100, -(2.0**-100)])  # exact in bf16: no rounding
    data = encode("w", x, "bf16").data
    want = (x.numpy().view("<u4") >> 16).astype("<u2").tobytes()
    assert data == want


def test_fp16_saturates_instead_of_sending_inf():
    y = decode(encode("w", torch.tensor([1e6, -1e6, 1.0]), "fp16"))
    assert y.tolist() == [65504.0, -65504.0, 1.0]


def test_one_million_elements_onebit_is_under_a_thirtieth_of_fp32_on_the_wire():
    x = torch.randn(1_000_000)
    one = encode("trunk.0.weight", x, "onebit").SerializeToString()
    fp32 = encode("trunk.0.weight", x, "fp32").SerializeToString()
    assert len(fp32) >= 4_000_000
    assert len(one) <= 4_000_000 / 30, len(one)
    assert len(fp32) / len(one) > 31


def _bad(**changes):
    msg = encode("net.w", torch.randn(4, 6), "onebit", block_size=8)
    for k, v in changes.items():
        setattr(msg, k, v) if k != "shape" else msg.shape.__setitem__(slice(None), v)
    return msg


@pytest.mark.parametrize("msg,match", [
    (_bad(data=b"\x00" * 2), "bytes of sign bits"),
    (_bad(scales=b"\x00" * 8), "bytes of scales"),
    (_bad(block_size=0), "block_size"),
    (_bad(block_size=5), "bytes of scales"),
    (_bad(encoding=tensor_pb2.ENCODING_UNSPECIFIED), "unknown encoding"),
    (_bad(encoding=99), "unknown encoding"),
    (_bad(shape=[4, -6]), "negative dimension"),
    (_bad(scales=np.array([1, np.nan, 1], "<f4").tobytes()), "NaN or infinite"),
    (_bad(scales=np.array([1, np.inf, 1], "<f4").tobytes()), "NaN or infinite"),
])
def test_decode_rejects_malformed_onebit_naming_the_tensor(msg, match):
    with pytest.raises(InvalidArgument, match=match) as err:
        decode(msg)
    assert "net.w" in str(err.value)


@pytest.mark.parametrize("encoding", ["fp32", "fp16", "bf16"])
def test_decode_rejects_malformed_dense(encoding):
    msg = encode("head.b", torch.ones(10), encoding)
    short = tensor_pb2.CompressedTensor()
    short.CopyFrom(msg)
    short.data = msg.data[:-1]
    with pytest.raises(InvalidArgument, match="head.b.*bytes"):
        decode(short)
    nan = encode("head.b", torch.tensor([1.0, float("nan")]), encoding)
    with pytest.raises(InvalidArgument, match="head.b: contains NaN"):
        decode(nan)
    inf = encode("head.b", torch.tensor([1.0, float("inf")]), "fp32")
    with pytest.raises(InvalidArgument, match="NaN or infinite"):
        decode(inf)
    with_scales = tensor_pb2.CompressedTensor()
    with_scales.CopyFrom(msg)
    with_scales.scales = b"\x00" * 4
    with pytest.raises(InvalidArgument, match="only valid with ENCODING_ONE_BIT"):
        decode(with_scales)


def test_encode_rejects_unknown_encoding_and_integer_tensors():
    with pytest.raises(InvalidArgument, match="unknown encoding"):
        encode("w", torch.ones(3), "int4")
    with pytest.raises(InvalidArgument, match="not a floating-point"):
        encode("w", torch.ones(3, dtype=torch.int64), "fp32")


def test_error_feedback_delivers_every_gradient_but_the_last_residual():
    torch.manual_seed(0)
    ef = ErrorFeedback("onebit", block_size=64, min_elements=16)
    shape = (40, 50)
    sum_g = torch.zeros(shape, dtype=torch.float64)
    sum_d = torch.zeros(shape, dtype=torch.float64)
    drift = torch.randn(shape)  # a consistent direction plus noise, like real gradients
    residual_norms, grad_norms = [], []
    for _ in range(200):
        g = drift + 2.0 * torch.randn(shape)
        (msg,) = ef.compress({"w": g})
        sum_g += g.double()
        sum_d += decode(msg).double()
        residual_norms.append(ef.residuals["w"].norm().item())
        grad_norms.append(g.norm().item())
    r_T = ef.residuals["w"].double()
    # sum of what was sent = sum of gradients - final residual (up to fp32 rounding)
    assert torch.allclose(sum_d, sum_g - r_T, atol=1e-3, rtol=0)
    # The residual does not grow with T: it settles within a small multiple of one gradient.
    assert max(residual_norms) < 3 * max(grad_norms)
    assert max(residual_norms[150:]) < 1.25 * max(residual_norms[50:100])
    # Without error feedback the accumulated error grows with T.
    no_ef = sum(decode(encode("w", drift + 2.0 * torch.randn(shape), "onebit", 64)).double()
                for _ in range(200))
    assert (sum_g - sum_d).norm() < (200 * drift.double() - no_ef).norm()


def test_error_feedback_small_tensors_go_dense_with_zero_residual():
    ef = ErrorFeedback("onebit", block_size=256, min_elements=64)
    msgs = ef.compress({"w": torch.randn(8, 16), "b": torch.randn(63)})
    enc = {m.name: m.encoding for m in msgs}
    assert enc == {"w": tensor_pb2.ENCODING_ONE_BIT, "b": tensor_pb2.ENCODING_FP32}
    assert set(ef.residuals) == {"w"}
    assert [m.name for m in msgs] == ["w", "b"]


def test_preconditioned_error_feedback_sends_the_gradient_over_its_own_rms():
    """u = g / (sqrt(v / (1 - b2^t)) + eps) with v Adam's running mean of g^2 and t each
    tensor's own step count, then plain error feedback on u; the 1-bit messages say so,
    the dense ones (below min_elements) are the raw gradient."""
    b2, eps = 0.999, 1e-3
    ef = ErrorFeedback("onebit", block_size=16, min_elements=64, precondition=True, beta2=b2, eps=eps)
    plain = ErrorFeedback("onebit", block_size=16, min_elements=64)
    gen = torch.Generator().manual_seed(0)
    v = {"w": torch.zeros(8, 20), "u": torch.zeros(100)}
    t = {"w": 0, "u": 0}
    for step in range(4):
        # "u" sits out step 1, as TD3's actor does between critic steps
        grads = {"w": torch.randn(8, 20, generator=gen) * (step + 1), "b": torch.randn(5, generator=gen)}
        if step != 1:
            grads["u"] = torch.randn(100, generator=gen)
        expected = {}
        for n, g in grads.items():
            if n == "b":
                continue
            t[n] += 1
            v[n] = b2 * v[n] + (1 - b2) * g * g
            expected[n] = g / ((v[n] / (1 - b2 ** t[n])).sqrt() + eps)
        msgs = {m.name: m for m in ef.compress(grads)}
        ref = {m.name: m for m in plain.compress(expected)}
        for n in expected:
            assert msgs[n].preconditioned and msgs[n].encoding == tensor_pb2.ENCODING_ONE_BIT
            torch.testing.assert_close(decode(msgs[n]), decode(ref[n]))
        assert not msgs["b"].preconditioned and torch.equal(decode(msgs["b"]), grads["b"])
    assert {n: s for n, (s, _) in ef.second_moments.items()} == {"w": 4, "u": 3}
    ef.reset()
    assert not ef.second_moments and not ef.residuals


def test_only_onebit_is_preconditioned():
    for encoding in ("fp32", "bf16", "fp16"):
        ef = ErrorFeedback(encoding, min_elements=0, precondition=True)
        (msg,) = ef.compress({"w": torch.full((100,), 3.0)})
        assert not msg.preconditioned and not ef.second_moments
        assert float(decode(msg)[0]) == 3.0


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16", "onebit"])
@pytest.mark.parametrize("precondition", [False, True])
def test_error_feedback_keeps_exactly_what_the_receiver_decodes(encoding, precondition):
    ef = ErrorFeedback(encoding, block_size=64, min_elements=50, precondition=precondition)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):  # residuals and second moments in play after the first
        grads = {"w": torch.randn(33, 17, generator=gen), "b": torch.randn(17, generator=gen)}
        msgs = ef.compress(grads)
        assert set(ef.decoded) == {"w", "b"}
        for m in msgs:
            assert ef.decoded[m.name].dtype == torch.float32
            assert torch.equal(ef.decoded[m.name], decode(m)), (step, m.name)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16", "onebit"])
@pytest.mark.parametrize("precondition", [False, True])
def test_error_feedback_never_writes_the_callers_gradients(encoding, precondition):
    # residuals are updated in place in their own buffers; the first step's residual
    # must not be the caller's tensor either
    ef = ErrorFeedback(encoding, block_size=64, min_elements=50, precondition=precondition)
    gen = torch.Generator().manual_seed(5)
    residuals = []
    for step in range(3):
        grads = {"w": torch.randn(33, 17, generator=gen), "b": torch.randn(17, generator=gen)}
        kept = {n: g.clone() for n, g in grads.items()}
        ef.compress(grads)
        assert all(torch.equal(grads[n], kept[n]) for n in grads), step
        assert all(r.data_ptr() != grads["w"].data_ptr() for r in ef.residuals.values())
        residuals.append({n: r.clone() for n, r in ef.residuals.items()})
    if encoding != "fp32":  # the residual carries over: e = g + r, then e - decoded
        assert not torch.equal(residuals[1]["w"], residuals[2]["w"])


@pytest.mark.parametrize("encoding", ["bf16", "fp16"])
def test_low_precision_error_feedback_over_changing_sets_of_tensors_equals_one_tensor_at_a_time(encoding):
    # bf16/fp16 encode a step's tensors together in one flat buffer (_compress_lowp); each
    # tensor must get exactly what it would get alone: e = g + r, send round(e), r = e - round(e),
    # with its residual carried across steps whose sets of tensors differ (TD3's critic-only
    # steps between actor-and-critic ones), a shape change resetting it, small tensors dense
    ef = ErrorFeedback(encoding, min_elements=8)
    gen = torch.Generator().manual_seed(11)
    shapes = {"actor.w": (6, 5), "critic.w": (4, 9), "critic.b": (9,), "out.b": (3,)}
    steps = [["actor.w", "critic.w", "critic.b", "out.b"], ["critic.w", "critic.b"],
             ["actor.w", "critic.w", "critic.b", "out.b"], ["critic.b", "actor.w"],
             ["actor.w", "critic.w", "critic.b"], ["critic.w", "critic.b"]]
    ref: dict[str, torch.Tensor] = {}
    for step, names in enumerate(steps):
        if step == 4:
            shapes["critic.w"] = (5, 9)  # the model changed: that residual starts again
        grads = {n: torch.randn(shapes[n], generator=gen) * 10.0 ** (step - 2) for n in names}
        if step == 3:
            grads["critic.b"] = grads["critic.b"].to(torch.bfloat16)  # an autocast-dtype gradient
        msgs = ef.compress(grads)
        assert [m.name for m in msgs] == names
        for m in msgs:
            g = grads[m.name].float()
            if g.numel() < 8:
                assert m.encoding == tensor_pb2.ENCODING_FP32 and torch.equal(decode(m), g)
                continue
            r = ref.get(m.name)
            e = g + r if r is not None and r.shape == g.shape else g.clone()
            sent = decode(encode(m.name, e, encoding))
            assert m.data == encode(m.name, e, encoding).data, (step, m.name)
            assert torch.equal(ef.decoded[m.name], sent) and torch.equal(decode(m), sent)
            ref[m.name] = e - sent
            assert torch.equal(ef.residuals[m.name], ref[m.name]), (step, m.name)
    assert set(ef.residuals) == {"actor.w", "critic.w", "critic.b"}
    ef.reset()
    (msg,) = ef.compress({"critic.b": torch.ones(9)})
    assert torch.equal(decode(msg), torch.ones(9)) and torch.equal(ef.residuals["critic.b"], torch.zeros(9))


def test_error_feedback_fp32_is_lossless_and_bf16_keeps_residuals():
    g = torch.randn(100, 30)
    ef = ErrorFeedback("fp32", min_elements=0)
    (msg,) = ef.compress({"w": g})
    assert torch.equal(decode(msg), g) and not ef.residuals
    ef = ErrorFeedback("bf16", min_elements=0)
    (msg,) = ef.compress({"w": g})
    assert torch.allclose(decode(msg) + ef.residuals["w"], g, atol=1e-6)


def test_error_feedback_refuses_non_finite_steps_and_keeps_its_residuals():
    ef = ErrorFeedback("onebit", block_size=32, min_elements=0)
    ef.compress({"a": torch.randn(64), "b": torch.randn(64)})
    before = {k: v.clone() for k, v in ef.residuals.items()}
    bad = torch.randn(64)
    bad[3] = float("nan")
    with pytest.raises(InvalidArgument, match="non-finite gradient in b"):
        ef.compress({"a": torch.randn(64), "b": bad})
    assert all(torch.equal(before[k], ef.residuals[k]) for k in before)
    ef.reset()
    assert ef.residual_norm() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_error_feedback_runs_on_the_gradients_device():
    ef = ErrorFeedback("onebit", block_size=2048, min_elements=64)
    g = torch.randn(1000, 1000, device="cuda")
    (msg,) = ef.compress({"w": g})
    assert ef.residuals["w"].device.type == "cuda"
    assert torch.allclose(decode(msg, device="cuda") + ef.residuals["w"], g, atol=1e-5)


def test_nonfinite_names_each_tensor_with_a_nan_or_an_infinity_and_no_other():
    from amprl.compression import nonfinite
    clean = [torch.randn(256, 256), torch.randn(7), torch.zeros(0), torch.randn(3).to(torch.bfloat16)]
    assert nonfinite(clean) == []
    assert nonfinite([]) == []
    bad = [t.clone() for t in clean]
    bad[0][17, 3] = float("nan")
    bad[1][6] = float("-inf")
    bad[3][0] = float("inf")
    assert nonfinite(bad) == [0, 1, 3]
    # values so large that their L2 norm overflows float32 are still finite
    huge = [torch.full((1000,), 3e38), torch.tensor([float("nan"), 3e38])]
    assert nonfinite(huge) == [1]
