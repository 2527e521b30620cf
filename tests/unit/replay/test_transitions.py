import numpy as np
import pytest
from amprl.envs.spec import EnvSpec
from amprl.errors import InvalidArgument
from amprl_testing.replay import atari_spec, make_chunk, vector_spec
from amprl.rl.transitions import Chunk
from amprl.v1 import replay_pb2
from amprl.wire.tensors import tensor_to_proto
from amprl.wire.transitions import chunk_from_proto, chunk_to_proto


def roundtrip(chunk, spec):
    msg = replay_pb2.TransitionBatch.FromString(
        chunk_to_proto(chunk, replay_pb2.TransitionBatch()).SerializeToString())
    return chunk_from_proto(msg, spec)


@pytest.mark.parametrize("spec", [vector_spec(), atari_spec(),
                                  EnvSpec((3,), np.dtype(np.float32), 1, False, action_dim=2)])
def test_chunk_round_trips_exactly(spec):
    chunk = make_chunk(spec, 9)
    back = roundtrip(chunk, spec)
    for name in ("frames", "obs_idx", "next_obs_idx", "actions", "rewards", "discounts"):
        np.testing.assert_array_equal(getattr(back, name), getattr(chunk, name))
        assert getattr(back, name).dtype == getattr(chunk, name).dtype
    assert len(back) == 9


def _msg(chunk):
    return chunk_to_proto(chunk, replay_pb2.TransitionBatch())


def _bad(spec, mutate, t=5):
    chunk = make_chunk(spec, t)
    msg = _msg(chunk)
    mutate(chunk, msg)
    return msg


CASES = [
    ("frames dtype", lambda c, m: tensor_to_proto(c.frames.astype(np.float64), m.frames), "chunk.frames: dtype"),
    ("frame shape", lambda c, m: tensor_to_proto(np.zeros((8, 5), np.float32), m.frames), r"expected \[F, 4\]"),
    ("frames rank", lambda c, m: tensor_to_proto(np.zeros(8, np.float32), m.frames), "chunk.frames: rank"),
    ("frames NaN", lambda c, m: tensor_to_proto(np.full((8, 4), np.nan, np.float32), m.frames), "NaN"),
    ("frames bytes", lambda c, m: setattr(m.frames, "data", m.frames.data[:-1]), "bytes for shape"),
    ("no frames", lambda c, m: tensor_to_proto(np.zeros((0, 4), np.float32), m.frames), "outside|F = 0"),
    ("obs idx dtype", lambda c, m: tensor_to_proto(c.obs_idx.astype(np.int64), m.obs_frame_indices), "obs_frame_indices: dtype"),
    ("obs idx stack", lambda c, m: tensor_to_proto(np.zeros((5, 2), np.int32), m.obs_frame_indices), r"expected \[T, 1\]"),
    ("empty chunk", lambda c, m: tensor_to_proto(np.zeros((0, 1), np.int32), m.obs_frame_indices), "T >= 1"),
    ("obs idx range", lambda c, m: tensor_to_proto(np.full((5, 1), 8, np.int32), m.obs_frame_indices), r"index 8 outside \[0, 8\)"),
    ("negative idx", lambda c, m: tensor_to_proto(np.full((5, 1), -1, np.int32), m.next_obs_frame_indices), "index -1 outside"),
    ("next idx length", lambda c, m: tensor_to_proto(np.zeros((4, 1), np.int32), m.next_obs_frame_indices), r"expected \[5, 1\]"),
    ("actions length", lambda c, m: tensor_to_proto(np.zeros(4, np.int64), m.actions), r"chunk.actions: shape \[4\], expected \[5\]"),
    ("actions dtype", lambda c, m: tensor_to_proto(np.zeros(5, np.float32), m.actions), "chunk.actions: dtype"),
    ("action range", lambda c, m: tensor_to_proto(np.full(5, 3, np.int64), m.actions), r"action 3 outside \[0, 3\)"),
    ("rewards length", lambda c, m: tensor_to_proto(np.zeros(6, np.float32), m.rewards), r"chunk.rewards: shape \[6\]"),
    ("rewards inf", lambda c, m: tensor_to_proto(np.array([0, 1, np.inf, 0, 0], np.float32), m.rewards), "chunk.rewards: contains NaN"),
    ("discount NaN", lambda c, m: tensor_to_proto(np.array([0, 1, np.nan, 0, 0], np.float32), m.discounts), "chunk.discounts"),
    ("discount > 1", lambda c, m: tensor_to_proto(np.full(5, 1.5, np.float32), m.discounts), r"\[0, 1\]"),
    ("unknown dtype", lambda c, m: setattr(m.rewards, "dtype", 99), "unknown dtype"),
    ("lz4 frames", lambda c, m: m.lz4_frames.append(b"x"), "lz4_frames"),
]


@pytest.mark.parametrize("name,mutate,message", CASES, ids=[c[0] for c in CASES])
def test_bad_chunk_is_invalid_argument_naming_the_field(name, mutate, message):
    spec = vector_spec()
    with pytest.raises(InvalidArgument, match=message):
        chunk_from_proto(_bad(spec, mutate), spec)


def test_atari_frame_shape_must_match_the_spec():
    spec = atari_spec()
    chunk = make_chunk(atari_spec(80), 4)
    with pytest.raises(InvalidArgument, match=r"expected \[F, 84, 84\]"):
        chunk_from_proto(_msg(chunk), spec)


def test_continuous_actions_are_checked():
    spec = EnvSpec((3,), np.dtype(np.float32), 1, False, action_dim=2)
    chunk = make_chunk(spec, 4)
    chunk.actions = np.zeros((4, 3), np.float32)
    with pytest.raises(InvalidArgument, match=r"expected \[4, 2\]"):
        chunk_from_proto(_msg(chunk), spec)
    chunk.actions = np.full((4, 2), np.nan, np.float32)
    with pytest.raises(InvalidArgument, match="chunk.actions: contains NaN"):
        chunk_from_proto(_msg(chunk), spec)


def test_chunk_dataclass_len():
    assert len(Chunk(np.zeros((2, 1)), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros(1),
                     np.zeros(1), np.zeros(1))) == 1
