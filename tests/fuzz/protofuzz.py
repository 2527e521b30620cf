"""Hypothesis strategies for protobuf requests of any type, built from their descriptors.

- ``messages(cls)``: a message of ``cls`` with each field present or missing, scalars drawn
  from the extremes of their type (0, 2^32, 2^63, 2^64 - 1, NaN, ...), strings long, empty
  or full of control and look-alike characters, repeated fields of random length, enums
  with unknown values, nested messages a few levels deep.
- ``mutated(valid)``: ``valid`` with one field (anywhere in it) cleared, replaced, its
  repeated elements dropped or duplicated, or its bytes scrambled in place.
- ``reshaped(valid)``: ``valid`` with one tensor's shape huge, negative or wrong, over its
  bytes, none, or half of them.
- ``raw_bytes(valid)``: what reaches a server that is not a message at all: random bytes,
  ``valid``'s serialization truncated or with bytes flipped, two messages concatenated
  (protobuf merges them: repeated fields twice, scalars the last).

``overrides`` (full message name -> strategy) replaces the generic walk for a type, so a
test can add values that make sense for it (a Tensor whose bytes match its shape).
"""

from __future__ import annotations

import math
from typing import Mapping

from google.protobuf import descriptor as pbd
from google.protobuf import message as pbm
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

FD = pbd.FieldDescriptor

Overrides = Mapping[str, st.SearchStrategy]


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    extremes = [v for v in (0, 1, -1, 2**31 - 1, -2**31, 2**32 - 1, 2**32, 2**63 - 1, -2**63,
                            2**63, 2**64 - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(extremes), st.integers(lo, hi),
                     st.integers(max(lo, -3), min(hi, 64)))


def floats(width: int) -> st.SearchStrategy[float]:
    big = 3.4e38 if width == 32 else 1.7e308
    return st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e20, -1e20, big, -big,
                                      math.inf, -math.inf, math.nan]),
                     st.floats(width=width))


LONG_LENGTHS = (255, 256, 513, 4096, 65_536)
"""Lengths of the long strings and byte strings drawn; a field of the outermost message may
also be a megabyte long (over the fuzz servers' message limit)."""

MEGABYTE = 1 << 20

_ODD_TEXT = ["", "\x00", "a\x00b", "\ufffd", "\ufeffactor-0", "actor-0\u202e", "Ã©", "\xc3\x28",
             "\x7f\x80\x9f", "actor-0\n", " ", "../../etc/passwd", "%s%n", "\U0001f600",
             "learner-0", "actor-0", "evaluator", "0.weight"]
"""Strings that look wrong: NUL, replacement and byte-order marks, right-to-left override,
mojibake of UTF-8 read as Latin-1, C1 controls, emoji, format specifiers, and plain ids."""


def text(megabyte: bool = False) -> st.SearchStrategy[str]:
    lengths = LONG_LENGTHS + ((MEGABYTE,) if megabyte else ())
    long = st.tuples(st.sampled_from(lengths), st.sampled_from("aé\U0001f600\x00"))
    return st.one_of(st.sampled_from(_ODD_TEXT), st.text(max_size=24), st.text(max_size=24),
                     long.map(lambda nc: nc[1] * nc[0]))


def binary(megabyte: bool = False) -> st.SearchStrategy[bytes]:
    lengths = LONG_LENGTHS + ((MEGABYTE,) if megabyte else ())
    return st.one_of(st.binary(max_size=48), st.binary(max_size=48),
                     st.sampled_from(lengths).map(lambda n: bytes([0xFF]) * n))


def _scalar(field: FD, outermost: bool = False) -> st.SearchStrategy:
    t = field.type
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return ints(-2**31, 2**31 - 1)
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return ints(0, 2**32 - 1)
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return ints(-2**63, 2**63 - 1)
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return ints(0, 2**64 - 1)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_FLOAT:
        return floats(32)
    if t == FD.TYPE_DOUBLE:
        return floats(64)
    if t == FD.TYPE_STRING:
        return text(outermost)
    if t == FD.TYPE_BYTES:
        return binary(outermost)
    if t == FD.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), ints(-2**31, 2**31 - 1))  # open enums
    raise TypeError(f"{field.full_name}: no strategy for field type {t}")


def _is_map(field: FD) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def value(field: FD, depth: int, overrides: Overrides, outermost: bool = False) -> st.SearchStrategy:
    """One value of ``field`` (one element, for a repeated field); ``outermost``: a field of
    the request itself, which may be a megabyte long."""
    if field.message_type is not None:
        return messages(GetMessageClass(field.message_type), depth - 1, overrides, _outermost=False)
    return _scalar(field, outermost)


def field_values(field: FD, depth: int, overrides: Overrides, outermost: bool = False) -> st.SearchStrategy:
    """A whole field: a value, or a list of them for a repeated field (a dict for a map)."""
    if _is_map(field):
        key, val = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_scalar(key), value(val, depth, overrides), max_size=4)
    if field.is_repeated:
        return st.lists(value(field, depth, overrides), max_size=5)
    return value(field, depth, overrides, outermost)


def assign(msg: pbm.Message, field: FD, v) -> None:
    """Sets ``msg.field`` to ``v`` (as ``field_values`` draws it)."""
    name = field.name
    if _is_map(field):
        target = getattr(msg, name)
        target.clear()
        for k, x in v.items():
            if isinstance(x, pbm.Message):
                target[k].CopyFrom(x)
            else:
                target[k] = x
    elif field.is_repeated:
        msg.ClearField(name)
        if field.message_type is not None:
            for x in v:
                getattr(msg, name).add().CopyFrom(x)
        else:
            getattr(msg, name).extend(v)
    elif field.message_type is not None:
        getattr(msg, name).CopyFrom(v)
    else:
        setattr(msg, name, v)


def messages(cls: type[pbm.Message], depth: int = 3, overrides: Overrides | None = None,
             _outermost: bool = True) -> st.SearchStrategy[pbm.Message]:
    """A message of ``cls``: each field present or missing (module docstring)."""
    overrides = overrides or {}
    if cls.DESCRIPTOR.full_name in overrides:
        return overrides[cls.DESCRIPTOR.full_name]
    if depth <= 0:
        return st.just(cls())

    @st.composite
    def build(draw):
        msg = cls()
        for field in cls.DESCRIPTOR.fields:
            if draw(st.booleans()):
                assign(msg, field, draw(field_values(field, depth, overrides, _outermost)))
        return msg
    return build()


def _places(msg: pbm.Message) -> list[tuple[pbm.Message, FD]]:
    """(message, field) for every field of ``msg`` and of the messages set inside it."""
    out = []
    for field in msg.DESCRIPTOR.fields:
        out.append((msg, field))
        if field.message_type is None or _is_map(field):
            continue
        if field.is_repeated:
            for element in getattr(msg, field.name):
                out += _places(element)
        elif msg.HasField(field.name):
            out += _places(getattr(msg, field.name))
    return out


def mutated(valid: pbm.Message, overrides: Overrides | None = None,
            depth: int = 2) -> st.SearchStrategy[pbm.Message]:
    """``valid`` with one change in one field anywhere in it (module docstring)."""
    overrides = overrides or {}

    @st.composite
    def mutate(draw):
        msg = type(valid)()
        msg.CopyFrom(valid)
        places = _places(msg)
        if not places:  # a message without fields: nothing to change
            return msg
        parent, field = draw(st.sampled_from(places))
        repeated = field.is_repeated and not _is_map(field)
        actions = ["clear", "replace"]
        current = getattr(parent, field.name)
        if repeated and len(current):
            actions += ["drop one", "duplicate one"]
        if field.type in (FD.TYPE_BYTES, FD.TYPE_STRING) and not repeated and current:
            actions.append("scramble")
        action = draw(st.sampled_from(actions))
        if action == "clear":
            parent.ClearField(field.name)
        elif action == "replace":
            outermost = parent is msg
            if repeated or _is_map(field):
                assign(parent, field, draw(field_values(field, depth, overrides, outermost)))
            else:
                assign(parent, field, draw(value(field, depth, overrides, outermost)))
        elif action == "drop one":
            del current[draw(st.integers(0, len(current) - 1))]
        elif action == "duplicate one":
            i = draw(st.integers(0, len(current) - 1))
            if field.message_type is not None:
                current.add().CopyFrom(current[i])
            else:
                current.append(current[i])
        else:  # scramble: the same length, other contents (NaN, huge, negative values ...)
            if field.type == FD.TYPE_BYTES:
                setattr(parent, field.name, draw(st.binary(min_size=len(current), max_size=len(current))))
            else:
                setattr(parent, field.name, draw(st.text(min_size=len(current), max_size=len(current))))
        return msg
    return mutate()


HUGE_SHAPES = [[2**32, 2**32], [2**62, 4], [0, 2**63 - 1], [2**63 - 1, 0], [-1], [-1, -1],
               [2**31, 2**31, 4], [2**63 - 1, 2**63 - 1], [-(2**63)], [2**40], [1, -1]]
"""Shapes whose element count is negative, overflows 64 bits (2^32 x 2^32 wraps to 0), is
zero beside a dimension no array can have, or is beyond any memory."""


def reshaped(valid: pbm.Message) -> st.SearchStrategy[pbm.Message]:
    """``valid`` with one of its tensors (a message with ``shape`` and ``data`` fields) given
    a huge, negative or odd shape, its bytes kept, dropped or cut in half."""

    @st.composite
    def reshape(draw):
        msg = type(valid)()
        msg.CopyFrom(valid)
        tensors = [m for m, f in _places(msg) if f.name == "shape" and "data" in m.DESCRIPTOR.fields_by_name]
        t = draw(st.sampled_from(tensors))
        rank = len(t.shape)
        t.shape[:] = draw(st.one_of(
            st.sampled_from(HUGE_SHAPES),
            st.lists(ints(-2**63, 2**63 - 1), min_size=rank, max_size=rank),  # its rank, odd sizes
            st.lists(st.integers(0, 4), max_size=4)))
        t.data = draw(st.sampled_from([t.data, b"", t.data[:len(t.data) // 2]]))
        return msg
    return reshape()


def raw_bytes(valid: pbm.Message) -> st.SearchStrategy[bytes]:
    """Bytes in place of a serialized request (module docstring)."""
    good = valid.SerializeToString()

    def flipped(args):
        i, b = args
        data = bytearray(good or b"\x00")
        data[i % len(data)] ^= b or 1
        return bytes(data)

    return st.one_of(
        st.binary(max_size=64),
        st.integers(0, max(0, len(good) - 1)).map(lambda n: good[:n]),
        st.tuples(st.integers(0, 2**16), st.integers(0, 255)).map(flipped),
        st.binary(min_size=1, max_size=8).map(lambda junk: good + junk),
        st.just(good + good),
        # a string field (tag 1 or 2) carrying bytes that are not UTF-8
        st.sampled_from([b"\x0a\x02\xc3\x28", b"\x12\x03\xff\xfe\xfd", b"\x0a\x01\x80"]),
        # a length prefix far beyond the message, a field number 0, an end-group tag
        st.sampled_from([b"\x0a\xff\xff\xff\xff\x0f", b"\x00", b"\x0c", b"\xf8\xff\xff\xff\x0f\x01"]),
    )
