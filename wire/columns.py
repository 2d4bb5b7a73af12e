"""Tuples of flat structs as columns: one packed array per field instead of one map per element.

How this works: a field annotated ``Columns[X]`` (a tuple of X) travels as one map: ``n``, the
count, and per field of X, in declaration order, its column: ints as one little-endian array (u8,
u32, u64 or i64, the narrowest that holds the field's range) in a bin; strings as ``strings``, the
distinct ones in order of first use, and ``index``, a u32 array into them; bytes as ``lengths``, a
u32 array, and ``data``, all of them in one bin; an optional as
``present``, one byte (0 or 1) per element, and ``values``, the column of the present ones; a
nested struct as its own columns map. A routing table of 150,000 transfers is one such map instead
of 150,000 maps that each repeat nine field names and the tensor names.

Encoding checks what the per-element schema checks (each value's type and range, each element's own
``_check``); when anything fails, the per-element checked walk runs to name the culprit
(``transfers[3].nbytes``). Decoding checks the columns (every length is ``n``, every index within
its table, every value within its field's range), builds the elements and runs their checks. The
elements are equal to those the per-element encoding would give.

``Rows`` keeps such a tuple as its columns in memory (the planner makes its tables so): it reads like
the tuple and encodes column by column, without an object per element. A struct that says
``KEPT_AS_COLUMNS`` (and has no ``_check``) also decodes to ``Rows``, its columns checked as above:
``Checksum``, thousands of which a checked round passes through the controller.
"""

from __future__ import annotations

import array
import sys
from operator import itemgetter
from typing import Any, Callable, Iterator, Sequence

from .schema import KIND_CONVERTERS, Violation, compiled_struct, run_check, struct_converters, trusted_maker

_CODES = (("B", 0, 2**8 - 1), ("I", 0, 2**32 - 1), ("Q", 0, 2**64 - 1), ("q", -(2**63), 2**63 - 1))  # narrowest first
_SWAP = sys.byteorder == "big"
if [array.array(code).itemsize for code, _, _ in _CODES] != [1, 4, 8, 8]:
    raise ImportError("wire.columns needs array typecodes B, I, Q, q of 1, 4, 8, 8 bytes")


def _code(lo: int, hi: int, where: str) -> str:
    for code, a, b in _CODES:
        if a <= lo and hi <= b:
            return code
    raise TypeError(f"{where}: no column for ints in {lo}..{hi}")


class _Column:
    """How one field's values travel: ``encode(values)`` (raising anything on a bad value: the caller
    names it) and ``decode(data, n, path)`` (raising ``Violation``)."""

    def __init__(self, kind: tuple, where: str) -> None:
        tag = kind[0]
        if tag == "int":
            self.encode, self.decode = _ints(kind[1], kind[2], where)
        elif tag == "type" and kind[1] is str:
            self.encode, self.decode = _strings()
        elif tag == "type" and kind[1] is bytes:
            self.encode, self.decode = _blobs()
        elif tag == "opt":
            self.encode, self.decode = _optional(_Column(kind[1], where))
        elif tag == "struct":
            self.encode, self.decode = _structs(kind[1])
        else:
            raise TypeError(f"{where}: no column for {kind}")


def _bin(data: Any, n: int, size: int, path: str) -> bytes:
    if type(data) is not bytes:
        raise Violation("type", path, f"expected bin, got {type(data).__name__}")
    if len(data) != n * size:
        raise Violation("value", path, f"{len(data)} bytes for {n} values of {size}")
    return data


def _ints(lo: int, hi: int, where: str) -> tuple[Callable, Callable]:
    code = _code(lo, hi, where)
    size = array.array(code).itemsize
    exact = (lo, hi) == next((a, b) for c, a, b in _CODES if c == code)

    def encode(values: list) -> bytes:
        if values and (set(map(type, values)) != {int} or min(values) < lo or max(values) > hi):
            raise ValueError("a value is not an int in range")
        a = array.array(code, values)
        if _SWAP:
            a.byteswap()
        return a.tobytes()

    def decode(data: Any, n: int, path: str) -> list:
        a = array.array(code)
        a.frombytes(_bin(data, n, size, path))
        if _SWAP:
            a.byteswap()
        values = a.tolist()
        if not exact and values and (min(values) < lo or max(values) > hi):
            raise Violation("value", path, f"a value outside {lo}..{hi}")
        return values

    return encode, decode


def _strings() -> tuple[Callable, Callable]:
    def encode(values: list) -> dict:
        if values and set(map(type, values)) != {str}:
            raise ValueError("a value is not a str")
        table = {v: i for i, v in enumerate(dict.fromkeys(values))}  # (in order of first use)
        index = array.array("I", map(table.__getitem__, values))
        if _SWAP:
            index.byteswap()
        return {"strings": list(table), "index": index.tobytes()}

    def decode(data: Any, n: int, path: str) -> list:
        strings, index = _fields(data, ("strings", "index"), path)
        if type(strings) is not list or (strings and set(map(type, strings)) != {str}):
            raise Violation("type", f"{path}.strings", "expected an array of str")
        a = array.array("I")
        a.frombytes(_bin(index, n, 4, f"{path}.index"))
        if _SWAP:
            a.byteswap()
        if n and max(a) >= len(strings):
            raise Violation("value", f"{path}.index", f"index {max(a)} beyond {len(strings)} strings")
        return [strings[i] for i in a]

    return encode, decode


def _blobs() -> tuple[Callable, Callable]:
    def encode(values: list) -> dict:
        if values and set(map(type, values)) != {bytes}:
            raise ValueError("a value is not bytes")
        lengths = array.array("I", map(len, values))
        if _SWAP:
            lengths.byteswap()
        return {"lengths": lengths.tobytes(), "data": b"".join(values)}

    def decode(data: Any, n: int, path: str) -> list:
        lengths, blob = _fields(data, ("lengths", "data"), path)
        a = array.array("I")
        a.frombytes(_bin(lengths, n, 4, f"{path}.lengths"))
        if _SWAP:
            a.byteswap()
        if type(blob) is not bytes or len(blob) != sum(a):
            raise Violation("value", f"{path}.data", "expected bin of the lengths' total")
        out, at = [], 0
        for size in a:
            out.append(blob[at:at + size])
            at += size
        return out

    return encode, decode


def _optional(inner: _Column) -> tuple[Callable, Callable]:
    def encode(values: list) -> dict:
        return {"present": bytes([v is not None for v in values]),
                "values": inner.encode([v for v in values if v is not None])}

    def decode(data: Any, n: int, path: str) -> list:
        present, values = _fields(data, ("present", "values"), path)
        present = _bin(present, n, 1, f"{path}.present")
        if present.strip(b"\x00\x01"):
            raise Violation("value", f"{path}.present", "expected bytes of 0 or 1")
        it = iter(inner.decode(values, present.count(1), f"{path}.values"))
        return [next(it) if p else None for p in present]

    return encode, decode


def _fields(data: Any, names: tuple[str, ...], path: str) -> list:
    if type(data) is not dict:
        raise Violation("type", path, f"expected a map, got {type(data).__name__}")
    if set(data) != set(names):
        extra, missing = sorted(set(data) - set(names), key=str), sorted(set(names) - set(data))
        raise Violation("extra" if extra else "missing", path, f"fields {extra or missing}")
    return [data[k] for k in names]


def _structs(cls: type) -> tuple[Callable, Callable]:
    c = compiled_struct(cls)
    columns: list[_Column] = []  # (made on first use: a struct may name itself only through a column)
    make = trusted_maker(cls)
    check = getattr(cls, "_check", None) is not None

    def cols() -> list[_Column]:
        if not columns:
            columns.extend(_Column(k, f"{cls.__name__}.{n}") for n, k in zip(c.names, c.kinds))
        return columns

    def encode(values: list) -> dict:
        if values and set(map(type, values)) != {cls}:
            raise ValueError(f"an element is not a {cls.__name__}")
        dicts = list(map(vars, values))
        out = from_columns(len(values), {name: list(map(itemgetter(name), dicts)) for name in c.names})
        if check:
            list(map(cls._check, values))
        return out

    def from_columns(n: int, values: dict[str, Any]) -> dict:
        out: dict[str, Any] = {"n": n}
        for name, col in zip(c.names, cols()):
            out[name] = col.encode(values[name])
        return out

    encode.from_columns = from_columns  # type: ignore[attr-defined]  (``Rows``: the columns as they are)

    def decode_columns(data: Any, n: int, path: str) -> list:
        got = _fields(data, ("n", *c.names), path)
        if got[0] != n or type(got[0]) is not int:
            raise Violation("value", f"{path}.n", f"{got[0]!r} elements where {n} are expected")
        return [col.decode(v, n, f"{path}.{name}") for name, col, v in zip(c.names, cols(), got[1:])]

    def decode(data: Any, n: int, path: str) -> list:
        values = decode_columns(data, n, path)
        out = [make(*row) for row in zip(*values)]
        if check:
            for i, v in enumerate(out):
                run_check(v, f"{path}[{i}]")
        return out

    decode.columns = decode_columns  # type: ignore[attr-defined]  (``Rows``: the columns, checked, as they came)
    return encode, decode


class Rows(Sequence):
    """A tuple of struct ``cls`` kept as its columns (one tuple per field): what the planner makes for
    a routing table, so that 10^5-10^6 rows are neither built as objects nor taken apart again to be
    encoded. Reads like a tuple (length, index, iteration make the elements; equal to the tuple of the
    same elements); a ``Columns[cls]`` field encodes it column by column, to the bytes the tuple of its
    elements gives. Immutable: the columns are tuples."""

    __slots__ = ("cls", "columns", "_n")

    def __init__(self, cls: type, columns: dict[str, Sequence]) -> None:
        names = compiled_struct(cls).names
        if set(columns) != set(names):
            raise TypeError(f"Rows[{cls.__name__}] needs the columns {list(names)}, got {sorted(columns)}")
        self.cls, self.columns = cls, {n: tuple(columns[n]) for n in names}
        lengths = {len(col) for col in self.columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"Rows[{cls.__name__}]: columns of different lengths {sorted(lengths)}")
        self._n = lengths.pop() if lengths else 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator:
        return map(trusted_maker(self.cls), *self.columns.values())

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        return trusted_maker(self.cls)(*(col[i] for col in self.columns.values()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Rows):
            return self.cls is other.cls and self.columns == other.columns
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Rows[{self.cls.__name__}]({self._n} rows)"


def column(rows: Sequence, name: str) -> Sequence:
    """One field of every row, from ``Rows`` as it is kept, else from each element."""
    if isinstance(rows, Rows):
        return rows.columns[name]
    return [getattr(x, name) for x in rows]


def converters(cls: type) -> tuple[Callable[[Any, str], Any], Callable[[Any, str], Any]]:
    """``Columns[cls]``'s pair of schema converters (a tuple of ``cls``, or ``Rows`` of it <-> columns map)."""
    encode, decode = _structs(cls)
    element_to = struct_converters(cls)[0]
    check = getattr(cls, "_check", None) is not None
    kept = getattr(cls, "KEPT_AS_COLUMNS", False) and not check  # (decoded as ``Rows``: no object per element)

    empty: dict = {}  # (made on first use: the columns of no rows, the same map every time)

    def no_rows() -> dict:
        if not empty:
            empty.update(encode([]))
        return empty

    def to(v: Any, path: str) -> Any:
        if not isinstance(v, (tuple, list, Rows)):
            raise Violation("type", path, f"expected a sequence, got {type(v).__name__}")
        if not len(v):  # (most summaries carry no checksums and no deltas: one map, no walk per column)
            return dict(no_rows())
        try:
            if type(v) is Rows and v.cls is cls:
                out = encode.from_columns(len(v), v.columns)
                if check:
                    list(map(cls._check, v))
                return out
            return encode(list(v))
        except Exception as exc:  # (name the culprit: the per-element walk raises at the first bad value)
            for i, x in enumerate(v):
                element_to(x, f"{path}[{i}]")
            raise Violation("value", path, f"cannot be encoded as columns: {exc}") from None

    def frm(v: Any, path: str) -> Any:
        if type(v) is not dict:
            raise Violation("type", path, f"expected a map, got {type(v).__name__}")
        n = v.get("n")
        if type(n) is not int or n < 0:
            raise Violation("value", f"{path}.n", f"expected a count, got {n!r}")
        if n == 0 and v == no_rows():  # (exactly the map ``to`` makes of no rows: nothing to check further)
            return Rows(cls, {name: () for name in compiled_struct(cls).names}) if kept else ()
        if kept:
            return Rows(cls, dict(zip(compiled_struct(cls).names, decode.columns(v, n, path))))
        return tuple(decode(v, n, path))

    return to, frm


KIND_CONVERTERS["columns"] = converters  # (schema's checked walk reaches Columns[...] fields through it)
