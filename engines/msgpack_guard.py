"""A structural check of untrusted msgpack, for engine adapters, before a recursive decoder
sees it.

msgspec decodes nested arrays and maps by recursion in C (so does skipping an unknown
field): a frame of 50,000 nested one-element arrays costs a `RecursionError` at the default
recursion limit and crashes the process at a raised one. `check_structure` walks the
msgpack headers with an explicit stack instead, and rejects a payload that is too big, too
deep, declares more items than a container may hold (or than its bytes could), or is cut
short, so a hostile frame costs CPU and memory in proportion to its size, never more.
It runs in Python, so adapters call it only for payloads their fully typed (and therefore
depth-bounded) decoder refused.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes a scalar element takes, its type byte included; 0: a container or a sized blob.
_FIXED = [0] * 256
for _b in (*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3):
    _FIXED[_b] = 1  # fixints, nil, false, true
for _b in range(0xA0, 0xC0):
    _FIXED[_b] = 1 + (_b & 0x1F)  # fixstr
for _b, _size in {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}.items():
    _FIXED[_b] = _size  # float32/64, uint8..64
for _b, _size in {0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}.items():
    _FIXED[_b] = _size  # int8..64
for _b, _size in {0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}.items():
    _FIXED[_b] = _size  # fixext 1..16

# Sized blobs: type byte -> (width of the length field, bytes between it and the data).
_BLOBS = {
    0xC4: (1, 0),  # bin 8/16/32
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xD9: (1, 0),  # str 8/16/32
    0xDA: (2, 0),
    0xDB: (4, 0),
    0xC7: (1, 1),  # ext 8/16/32: the length, then the ext type byte
    0xC8: (2, 1),
    0xC9: (4, 1),
}
# Sized containers: type byte -> (width of the count field, items per counted entry).
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


class StructureError(ValueError):
    """A payload that breaks a structural limit; `reason` is a short label for counters:
    `too_large`, `too_deep`, `too_long` (a container with too many items) or `decode`
    (not msgpack: cut short, trailing bytes, a reserved type byte)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """Bounds on one payload. The defaults are far above what an engine sends (vLLM's
    deepest field is 6 levels down; a step's batch is a few hundred KB)."""

    max_bytes: int = 16 * 2**20
    max_depth: int = 16
    max_items: int = 2**22  # per array or map


def check_size(data: bytes, limits: Limits) -> None:
    if len(data) > limits.max_bytes:
        raise StructureError(
            "too_large", f"payload of {len(data)} bytes exceeds {limits.max_bytes}"
        )


def check_structure(data: bytes, limits: Limits) -> None:
    """Raise `StructureError` unless `data` is one well-formed msgpack value within
    `limits`. Cost: one step per element, no recursion, no allocation but the stack."""
    check_size(data, limits)
    end, pos = len(data), 0
    left = [1]  # items still to read at each open level, the document itself at the bottom
    while left:
        if not left[-1]:
            left.pop()
            continue
        left[-1] -= 1
        if pos >= end:
            raise StructureError("decode", "payload cut short")
        size = _FIXED[data[pos]]
        if size:
            pos += size
            continue
        pos, items = _header(data, pos)
        if items:
            _check_container(items, len(left), end - pos, limits)
            left.append(items)
    if pos != end:
        raise StructureError("decode", f"{end - pos} bytes past the end of the value")


def _header(data: bytes, pos: int) -> tuple[int, int]:
    """Past a blob, or past a container's header: (new position, items it holds)."""
    b = data[pos]
    if 0x80 <= b <= 0x9F:  # fixmap, fixarray
        return pos + 1, (b & 0x0F) * (2 if b < 0x90 else 1)
    if b in _BLOBS:
        width, gap = _BLOBS[b]
        return pos + 1 + width + gap + _read_uint(data, pos + 1, width), 0
    if b in _CONTAINERS:
        width, per = _CONTAINERS[b]
        return pos + 1 + width, _read_uint(data, pos + 1, width) * per
    raise StructureError("decode", f"reserved msgpack type byte 0x{b:02x} at {pos}")


def _read_uint(data: bytes, pos: int, width: int) -> int:
    if pos + width > len(data):
        raise StructureError("decode", "payload cut short in a length field")
    return int.from_bytes(data[pos : pos + width], "big")


def _check_container(items: int, depth: int, bytes_left: int, limits: Limits) -> None:
    if depth > limits.max_depth:
        raise StructureError("too_deep", f"nested deeper than {limits.max_depth} levels")
    if items > limits.max_items:
        raise StructureError("too_long", f"a container of {items} items (limit {limits.max_items})")
    if items > bytes_left:  # every item takes at least one byte
        raise StructureError("decode", f"a container of {items} items in {bytes_left} bytes")
