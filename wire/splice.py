"""Body frames made from parts encoded once, reused from one message (and one plan) to the next.

How this works: MessagePack is context-free — a map is its header followed by each key and value
packed alone, an array its header followed by each element — so a frame can be assembled from the
encodings of its parts and be, byte for byte, the frame ``codec.encode_body`` makes. A
``PartsEncoder`` walks the struct types it is told to ``split`` field by field (each field checked
by the schema's converter, each struct's own check run, fields in the order ``to_wire`` gives them)
and keeps the encoding of the parts it meets, keyed by the object's identity with the object held:
a ``Columns`` field's rows whole, or, for element types named ``shared``, each element of a tuple.
Wire structs are frozen and tuples immutable, so an object's encoding cannot change while it is kept. A controller
hands out hundreds of plan messages whose tables, peers and keys recur across members and across
replans; with the parts kept, a replan that keeps most tables encodes only what changed.

Whatever the walk does not take (a list where a tuple is expected, an invalid value, a failed
check) goes to ``codec.encode_body``, which makes the frame or names the culprit exactly as
without parts. ``retain()`` drops every part not used since the previous call.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import msgpack

from . import errors
from .columns import Rows
from .codec import DEFAULT_LIMITS, Limits, check_sizes, message_type, pack_map, encode_body
from .schema import compiled_struct, fast_path, run_check

_NIL = b"\xc0"


def map_header(n: int) -> bytes:
    """MessagePack's header of a map of ``n`` entries."""
    if n < 16:
        return bytes((0x80 | n,))
    return (b"\xde" + n.to_bytes(2, "big")) if n < 1 << 16 else (b"\xdf" + n.to_bytes(4, "big"))


def array_header(n: int) -> bytes:
    """MessagePack's header of an array of ``n`` elements."""
    if n < 16:
        return bytes((0x90 | n,))
    return (b"\xdc" + n.to_bytes(2, "big")) if n < 1 << 16 else (b"\xdd" + n.to_bytes(4, "big"))


class _Layout:
    """A split struct's fields in ``to_wire``'s order (required, then optional): the packed name, the
    name, kind, converter, and the default that keeps an optional field off the wire."""

    __slots__ = ("fields",)

    def __init__(self, cls: type) -> None:
        c = compiled_struct(cls)
        rows = [(pack_map(n), n, k, to, n in c.defaults, c.defaults.get(n))
                for n, k, (_, to, _) in zip(c.names, c.kinds, c.fields)]
        self.fields = [r for r in rows if not r[4]] + [r for r in rows if r[4]]


class _Kept:
    """Encodings by object identity, the objects held, and the identities used since ``retain``."""

    __slots__ = ("parts", "held", "seen")

    def __init__(self) -> None:
        self.parts: dict[int, bytes] = {}
        self.held: dict[int, Any] = {}
        self.seen: set[int] = set()

    def retain(self) -> None:
        for i in [i for i in self.parts if i not in self.seen]:
            del self.parts[i], self.held[i]
        self.seen = set()


class PartsEncoder:
    """``encode_body`` that keeps and reuses the encodings of parts (see the module's header).

    ``split``: struct types walked field by field (the message types and the tables inside them; a
    table met again is not checked again); ``shared``: struct types kept element by element inside
    tuples (what many messages repeat). ``Columns`` fields are kept whole; other fields are packed each
    time. Not thread-safe: one planning thread uses it."""

    def __init__(self, split: Iterable[type], shared: Iterable[type] = ()) -> None:
        self._layouts = {cls: _Layout(cls) for cls in split}
        self._shared = frozenset(shared)
        self.pack_map = msgpack.Packer(use_bin_type=True).pack  # (codec's settings)
        self._kept: dict[Any, _Kept] = {}  # by struct type (elements), field kind (columns), "checked"
        self.reused = self.encoded = self.fallbacks = 0

    def __repr__(self) -> str:
        kept = sum(len(k.parts) for k in self._kept.values())
        return f"<PartsEncoder kept={kept} reused={self.reused} encoded={self.encoded} fallbacks={self.fallbacks}>"

    def encode_body(self, body: Any, limits: Limits = DEFAULT_LIMITS) -> bytes:
        """``codec.encode_body(body, limits)``, the same bytes and the same errors."""
        if type(body) not in self._layouts:
            return encode_body(body, limits)
        message_type(body)
        try:
            frame = self._struct(body)
        except Exception:  # (the plain encoder names what is wrong, or makes what the walk declined)
            self.fallbacks += 1
            return encode_body(body, limits)
        check_sizes([frame], limits, errors.InvalidMessage)
        return frame

    def retain(self) -> None:
        """Keep only the parts used since the last call (those of the latest plan)."""
        for kept in self._kept.values():
            kept.retain()

    def _store(self, slot: Any) -> _Kept:
        kept = self._kept.get(slot)
        if kept is None:
            kept = self._kept[slot] = _Kept()
        return kept

    def _struct(self, obj: Any) -> bytes:
        d = obj.__dict__
        out = []
        for packed, name, kind, to, optional, default in self._layouts[type(obj)].fields:
            value = d[name]
            if optional and value == default:
                continue  # (off the wire, as in to_wire)
            out.append(packed)
            out.append(self._value(value, kind, to, name))
        checked = self._store("checked")
        if id(obj) not in checked.parts:
            run_check(obj, "")
            checked.parts[id(obj)], checked.held[id(obj)] = b"", obj
        checked.seen.add(id(obj))
        return map_header(len(out) // 2) + b"".join(out)

    def _value(self, value: Any, kind: tuple, to: Any, name: str) -> bytes:
        if kind[0] == "opt":
            if value is None:
                return _NIL
            kind = kind[1]
        if kind[0] == "struct" and type(value) is kind[1] and kind[1] in self._layouts:
            return self._struct(value)
        if kind[0] == "columns" and type(value) in (tuple, Rows):
            return self._parts((value,), kind, lambda v: self.pack_map(to(v, name)))[0]
        if kind[0] == "tuple" and kind[1][0] == "struct" and kind[1][1] in self._shared and type(value) is tuple:
            cls = kind[1][1]  # (made from its elements' parts; the tuple itself is not kept)
            return array_header(len(value)) + b"".join(self._parts(value, cls, self._element(cls)))
        return self.pack_map(to(value, name))

    def _element(self, cls: type) -> Callable[[Any], bytes]:
        enc = fast_path(cls).encode

        def encode(x: Any) -> bytes:
            if type(x) is not cls:
                raise TypeError(f"{type(x).__name__} where {cls.__name__} is expected")
            return self.pack_map(enc(x))

        return encode

    def _parts(self, objs: tuple, slot: Any, encode: Callable[[Any], bytes]) -> list[bytes]:
        """The encodings of ``objs`` (each of what ``slot`` names), kept by identity."""
        kept = self._store(slot)
        get = kept.parts.get
        parts = [get(id(x)) for x in objs]
        kept.seen.update(map(id, objs))
        missing = [i for i, part in enumerate(parts) if part is None] if None in parts else ()
        self.reused += len(objs) - len(missing)
        self.encoded += len(missing)
        for i in missing:
            x = objs[i]
            parts[i] = kept.parts[id(x)] = encode(x)
            kept.held[id(x)] = x  # (held: its id stays its own while the encoding is kept)
        return parts
