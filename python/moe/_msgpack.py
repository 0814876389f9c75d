"""A small msgpack encoder and decoder: what the generic calls (status, stats,
model.info, ...) of moe.Client need, with no dependency.

Encoding: None, bool, int, float (float64), str, bytes, list/tuple, dict with
str keys; each in its smallest format, as docs/PROTOCOL.md asks of writers.
Decoding: every format of the msgpack spec; str as str, bin as bytes, ext as
(type, bytes).
"""
import struct
from typing import Any


def packb(value: Any) -> bytes:
    """value encoded as msgpack."""
    out = bytearray()
    _pack(value, out)
    return bytes(out)


def _pack_len(n: int, fix_base: int, fix_max: int, m16: int, m32: int, out: bytearray):
    if n <= fix_max:
        out.append(fix_base | n)
    elif n <= 0xFFFF:
        out.append(m16)
        out += struct.pack(">H", n)
    else:
        out.append(m32)
        out += struct.pack(">I", n)


def _pack(v: Any, out: bytearray):
    if v is None:
        out.append(0xC0)
    elif v is True:
        out.append(0xC3)
    elif v is False:
        out.append(0xC2)
    elif isinstance(v, int):
        if 0 <= v <= 0x7F:
            out.append(v)
        elif -32 <= v < 0:
            out.append(v & 0xFF)
        elif 0 <= v <= 0xFF:
            out += b"\xcc" + struct.pack(">B", v)
        elif 0 <= v <= 0xFFFF:
            out += b"\xcd" + struct.pack(">H", v)
        elif 0 <= v <= 0xFFFFFFFF:
            out += b"\xce" + struct.pack(">I", v)
        elif 0 <= v <= 0xFFFFFFFFFFFFFFFF:
            out += b"\xcf" + struct.pack(">Q", v)
        elif -0x80 <= v < 0:
            out += b"\xd0" + struct.pack(">b", v)
        elif -0x8000 <= v < 0:
            out += b"\xd1" + struct.pack(">h", v)
        elif -0x80000000 <= v < 0:
            out += b"\xd2" + struct.pack(">i", v)
        elif -0x8000000000000000 <= v < 0:
            out += b"\xd3" + struct.pack(">q", v)
        else:
            raise OverflowError("int out of the msgpack range: %d" % v)
    elif isinstance(v, float):
        out += b"\xcb" + struct.pack(">d", v)
    elif isinstance(v, str):
        b = v.encode()
        if len(b) <= 31:
            out.append(0xA0 | len(b))
        elif len(b) <= 0xFF:
            out += b"\xd9" + struct.pack(">B", len(b))
        elif len(b) <= 0xFFFF:
            out += b"\xda" + struct.pack(">H", len(b))
        else:
            out += b"\xdb" + struct.pack(">I", len(b))
        out += b
    elif isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        if len(b) <= 0xFF:
            out += b"\xc4" + struct.pack(">B", len(b))
        elif len(b) <= 0xFFFF:
            out += b"\xc5" + struct.pack(">H", len(b))
        else:
            out += b"\xc6" + struct.pack(">I", len(b))
        out += b
    elif isinstance(v, (list, tuple)):
        _pack_len(len(v), 0x90, 15, 0xDC, 0xDD, out)
        for item in v:
            _pack(item, out)
    elif isinstance(v, dict):
        _pack_len(len(v), 0x80, 15, 0xDE, 0xDF, out)
        for k, item in v.items():
            if not isinstance(k, str):
                raise TypeError("map keys must be str, not %s" % type(k).__name__)
            _pack(k, out)
            _pack(item, out)
    else:
        raise TypeError("cannot encode %s as msgpack" % type(v).__name__)


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("msgpack: truncated at byte %d" % self.pos)
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def num(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]


def unpackb(data: bytes) -> Any:
    """The one msgpack value in data (trailing bytes are an error)."""
    r = _Reader(bytes(data))
    v = _unpack(r, 0)
    if r.pos != len(r.data):
        raise ValueError("msgpack: %d trailing bytes" % (len(r.data) - r.pos))
    return v


_FIXED = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i",
          0xD3: ">q", 0xCA: ">f", 0xCB: ">d"}
_LEN = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I", 0xC4: ">B", 0xC5: ">H", 0xC6: ">I", 0xDC: ">H",
        0xDD: ">I", 0xDE: ">H", 0xDF: ">I", 0xC7: ">B", 0xC8: ">H", 0xC9: ">I"}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}


def _unpack(r: _Reader, depth: int) -> Any:
    if depth > 64:
        raise ValueError("msgpack: nested too deep")
    b = r.take(1)[0]
    if b <= 0x7F:
        return b
    if b >= 0xE0:
        return b - 0x100
    if 0xA0 <= b <= 0xBF:
        return r.take(b & 0x1F).decode(errors="replace")
    if 0x90 <= b <= 0x9F:
        return _array(r, b & 0x0F, depth)
    if 0x80 <= b <= 0x8F:
        return _map(r, b & 0x0F, depth)
    if b == 0xC0:
        return None
    if b == 0xC2:
        return False
    if b == 0xC3:
        return True
    if b in _FIXED:
        return r.num(_FIXED[b])
    if b in _FIXEXT:
        t = r.num(">b")
        return (t, r.take(_FIXEXT[b]))
    if b in _LEN:
        n = r.num(_LEN[b])
        if b in (0xD9, 0xDA, 0xDB):
            return r.take(n).decode(errors="replace")
        if b in (0xC4, 0xC5, 0xC6):
            return r.take(n)
        if b in (0xDC, 0xDD):
            return _array(r, n, depth)
        if b in (0xDE, 0xDF):
            return _map(r, n, depth)
        t = r.num(">b")
        return (t, r.take(n))
    raise ValueError("msgpack: reserved byte 0x%02x" % b)


def _array(r: _Reader, n: int, depth: int) -> list:
    return [_unpack(r, depth + 1) for _ in range(n)]


def _map(r: _Reader, n: int, depth: int) -> dict:
    out = {}
    for _ in range(n):
        k = _unpack(r, depth + 1)
        if isinstance(k, (list, dict)):
            k = repr(k)
        out[k] = _unpack(r, depth + 1)
    return out

