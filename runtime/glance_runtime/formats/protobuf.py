"""A few fields of a protobuf message (an ONNX graph), read without the protobuf or onnx packages: the edge
install and a device's build have neither. Values are views into the buffer, so walking a graph copies
nothing but what a caller keeps."""
from __future__ import annotations

from typing import Iterator

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5  # wire types


def varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); ValueError on a varint that runs past the buffer or 70 bits."""
    result = shift = 0
    while True:
        if pos >= len(buf) or shift >= 70:
            raise ValueError("truncated or malformed protobuf")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(buf: memoryview) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of each field of one message: an int for a varint, a view for the rest."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = varint(buf, pos)
        wire = key & 7
        if wire == VARINT:
            value, pos = varint(buf, pos)
        else:
            if wire == LENGTH:
                width, pos = varint(buf, pos)
            elif wire in (FIXED64, FIXED32):
                width = 8 if wire == FIXED64 else 4
            else:
                raise ValueError(f"unsupported protobuf wire type {wire}")
            if pos + width > end:
                raise ValueError("truncated protobuf")
            value, pos = buf[pos:pos + width], pos + width
        yield key >> 3, wire, value


def signed(value: int) -> int:
    """An int64 field's value from its two's-complement varint."""
    return value - (1 << 64) if value >= 1 << 63 else value


def ints(wire: int, value) -> list[int]:
    """A repeated int64 field's values, packed (a view) or one at a time (a varint)."""
    if wire == VARINT:
        return [signed(value)]
    out, pos = [], 0
    while pos < len(value):
        raw, pos = varint(value, pos)
        out.append(signed(raw))
    return out
