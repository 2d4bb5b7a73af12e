"""A strict schema for wire structs, derived from dataclass annotations.

How this works: every struct of the protocol is a frozen dataclass decorated with ``@struct``. The
first time one is encoded or decoded, its annotations are compiled into a pair of converters per
field: ``to_wire`` (Python value -> MessagePack-able value, validating) and ``from_wire`` (decoded
MessagePack value -> Python value, validating). Structs travel as maps whose keys are the field
names in declaration order, so encoding is deterministic byte for byte.

Supported annotations: ``bool``, ``str``, ``bytes``, ``float``, ranged ints (``U8``, ``U32``,
``U64``, ``I64``), ``tuple[X, ...]``, ``Optional[X]``, enums (``IntEnum`` travel as ints, ``str``
enums as strings), nested structs, ``Json`` (nested maps/lists of scalars, depth-limited), and
``Columns[X]`` (a tuple of a flat struct X as one array per field: ``wire.columns``).

A violation raises ``Violation(kind, path, detail)``; the codec turns it into a typed
``FieldError`` (decode, the peer's fault) or ``InvalidMessage`` (encode, ours). A struct may define
``_check(self)`` for cross-field rules; it raises ``Violation`` with a field name relative to itself.

Optional trailing fields: a field declared with a default (added after a protocol release) is left out
of the map while it holds its default, and filled in with it when absent at decode. Messages that do
not use a new field therefore encode to the same bytes as before it existed, and peers that predate
it still decode them.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Annotated, Any, Callable, Union

__all__ = [
    "U8",
    "U32",
    "U64",
    "I64",
    "Json",
    "Columns",
    "Violation",
    "struct",
    "to_wire",
    "from_wire",
    "trusted",
]


class Range:
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi


class _JsonMarker:
    pass


class _ColumnsMarker:
    pass


class Columns:
    """``Columns[X]``: a tuple of struct X that travels as columns, one array per field
    (``wire.columns``), for tuples of 10^5 elements."""

    def __class_getitem__(cls, item: type) -> Any:
        return Annotated[tuple[item, ...], _ColumnsMarker()]


U8 = Annotated[int, Range(0, 2**8 - 1)]
U32 = Annotated[int, Range(0, 2**32 - 1)]
U64 = Annotated[int, Range(0, 2**64 - 1)]
I64 = Annotated[int, Range(-(2**63), 2**63 - 1)]
Json = Annotated[object, _JsonMarker()]

JSON_MAX_DEPTH = 32


class Violation(Exception):
    """A schema rule broken at ``path``: kind is missing / extra / type / value."""

    def __init__(self, kind: str, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.kind, self.path, self.detail = kind, path, detail

    def under(self, prefix: str) -> "Violation":
        return Violation(self.kind, f"{prefix}.{self.path}" if self.path else prefix, self.detail)


Converter = Callable[[Any, str], Any]


def _type_name(v: object) -> str:
    return type(v).__name__


def _scalar(py_type: type, wire_types: tuple[type, ...]) -> tuple[Converter, Converter]:
    def check(v: Any, path: str) -> Any:
        if type(v) not in wire_types:
            raise Violation("type", path, f"expected {py_type.__name__}, got {_type_name(v)}")
        return py_type(v) if py_type is float else v

    return check, check


def _ranged_int(rng: Range) -> tuple[Converter, Converter]:
    def check(v: Any, path: str) -> Any:
        if type(v) is not int:
            raise Violation("type", path, f"expected int, got {_type_name(v)}")
        if not rng.lo <= v <= rng.hi:
            raise Violation("value", path, f"{v} is outside [{rng.lo}, {rng.hi}]")
        return v

    return check, check


def _enum(cls: type[enum.Enum]) -> tuple[Converter, Converter]:
    base = int if issubclass(cls, int) else str
    members = {m.value: m for m in cls}

    def to(v: Any, path: str) -> Any:
        if isinstance(v, cls):
            return base(v.value)
        if type(v) is base and v in members:
            return v
        raise Violation("value", path, f"expected {cls.__name__}, got {v!r}")

    def frm(v: Any, path: str) -> Any:
        if type(v) is not base:
            raise Violation("type", path, f"expected {base.__name__} ({cls.__name__}), got {_type_name(v)}")
        try:
            return members[v]
        except KeyError:
            raise Violation("value", path, f"{v!r} is not a {cls.__name__}") from None

    return to, frm


def _json_check(v: Any, path: str, depth: int = 0) -> Any:
    if depth > JSON_MAX_DEPTH:
        raise Violation("value", path, f"nested deeper than {JSON_MAX_DEPTH}")
    if v is None or type(v) in (bool, int, float, str):
        if type(v) is int and not -(2**63) <= v < 2**64:
            raise Violation("value", path, "integer out of 64-bit range")
        return v
    if isinstance(v, (list, tuple)):
        return [_json_check(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                raise Violation("type", path, f"map keys must be str, got {_type_name(k)}")
            out[k] = _json_check(x, f"{path}.{k}", depth + 1)
        return out
    raise Violation("type", path, f"{_type_name(v)} is not JSON-able")


def _tuple(inner: tuple[Converter, Converter]) -> tuple[Converter, Converter]:
    to_i, from_i = inner

    def to(v: Any, path: str) -> Any:
        if not isinstance(v, (tuple, list)):
            raise Violation("type", path, f"expected a sequence, got {_type_name(v)}")
        return [to_i(x, f"{path}[{i}]") for i, x in enumerate(v)]

    def frm(v: Any, path: str) -> Any:
        if type(v) is not list:
            raise Violation("type", path, f"expected an array, got {_type_name(v)}")
        return tuple(from_i(x, f"{path}[{i}]") for i, x in enumerate(v))

    return to, frm


def _optional(inner: tuple[Converter, Converter]) -> tuple[Converter, Converter]:
    to_i, from_i = inner

    def to(v: Any, path: str) -> Any:
        return None if v is None else to_i(v, path)

    def frm(v: Any, path: str) -> Any:
        return None if v is None else from_i(v, path)

    return to, frm


def struct_converters(cls: type) -> tuple[Converter, Converter]:
    def to(v: Any, path: str) -> Any:
        if not isinstance(v, cls):
            raise Violation("type", path, f"expected {cls.__name__}, got {_type_name(v)}")
        return to_wire(v, path)

    def frm(v: Any, path: str) -> Any:
        return from_wire(cls, v, path)

    return to, frm


def _kind(tp: Any) -> tuple:
    """An annotation as the converters and the generator read it: ("int", lo, hi), ("type", t),
    ("float",), ("call", to, from) (enums, JSON), ("struct", cls), ("opt", kind), ("tuple", kind),
    ("columns", cls)."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        for m in meta:
            if isinstance(m, Range):
                return ("int", m.lo, m.hi)
            if isinstance(m, _JsonMarker):
                return ("call", _json_check, _json_check)
            if isinstance(m, _ColumnsMarker):
                return ("columns", typing.get_args(base)[0])
        return _kind(base)
    if origin is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp}")
        return ("opt", _kind(args[0]))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"only tuple[X, ...] is supported, not {tp}")
        return ("tuple", _kind(args[0]))
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return ("call", *_enum(tp))
        if dataclasses.is_dataclass(tp):
            return ("struct", tp)
        if tp in (bool, str, bytes):
            return ("type", tp)
        if tp is float:
            return ("float",)
        if tp is int:
            return ("int", -(2**63), 2**64 - 1)
    raise TypeError(f"unsupported wire annotation {tp!r}")


# Converter makers for kinds that other wire modules define on top of this one (``columns`` registers
# "columns" when it is imported; ``weightsync.wire`` imports it): the dependency points one way.
KIND_CONVERTERS: dict[str, Callable[[type], tuple[Converter, Converter]]] = {}


def _converters(kind: tuple) -> tuple[Converter, Converter]:
    """The checked walk's pair of converters for one annotation, read by ``_kind``."""
    tag = kind[0]
    if tag == "int":
        return _ranged_int(Range(kind[1], kind[2]))
    if tag == "type":
        return _scalar(kind[1], (kind[1],))
    if tag == "float":
        return _scalar(float, (float, int))
    if tag == "call":
        return kind[1], kind[2]
    if tag == "columns":
        make = KIND_CONVERTERS.get("columns")
        if make is None:
            raise TypeError("a Columns[...] field needs weightsync.wire.columns imported (it registers the kind)")
        return make(kind[1])
    if tag == "struct":
        return struct_converters(kind[1])
    if tag == "opt":
        return _optional(_converters(kind[1]))
    return _tuple(_converters(kind[1]))


class _Compiled:
    __slots__ = ("names", "kinds", "fields", "name_set", "defaults")

    def __init__(self, cls: type) -> None:
        hints = typing.get_type_hints(cls, include_extras=True)
        fields = dataclasses.fields(cls)
        self.names = tuple(f.name for f in fields)
        self.kinds = tuple(_kind(hints[n]) for n in self.names)
        self.fields = tuple((n, *_converters(k)) for n, k in zip(self.names, self.kinds))
        self.name_set = frozenset(self.names)
        self.defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


_COMPILED: dict[type, _Compiled] = {}


def compiled_struct(cls: type) -> _Compiled:
    c = _COMPILED.get(cls)
    if c is None:
        c = _COMPILED[cls] = _Compiled(cls)
    return c


def struct(cls: type) -> type:
    """Mark a dataclass as a wire struct (frozen; compiled lazily on first use)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.__wire_struct__ = True
    return cls


def trusted(cls: type, *values: Any) -> Any:
    """Build a struct from values known to be valid, skipping ``__init__`` (hot paths of the planner).

    Positional values in field order; the caller vouches for their validity. ``to_wire`` still
    validates everything when the struct is encoded.
    """
    return trusted_maker(cls)(*values)


def trusted_maker(cls: type) -> Callable[..., Any]:
    """``trusted`` for one struct as a function of its fields, in order: the fields are stored straight
    into the new instance's attribute dict (a quarter of ``trusted``'s time; a table's rows are made so
    from columns, 10^5-10^6 of them; instances of a class share their dicts' keys)."""
    make = _MAKERS.get(cls)
    if make is None:
        names = compiled_struct(cls).names
        args = ", ".join(f"a{i}" for i in range(len(names)))
        stores = "".join(f"    d[{n!r}] = a{i}\n" for i, n in enumerate(names))
        scope = {"new": object.__new__, "cls": cls}
        exec(f"def make({args}):\n    o = new(cls)\n    d = o.__dict__\n{stores}    return o", scope)
        make = _MAKERS[cls] = scope["make"]
    return make


_MAKERS: dict[type, Callable[..., Any]] = {}


def run_check(obj: Any, path: str) -> None:
    check = getattr(obj, "_check", None)
    if check is not None:
        try:
            check()
        except Violation as v:
            raise v.under(path) if path else v from None


def to_wire(obj: Any, path: str = "") -> dict[str, Any]:
    """Validate a struct instance and return its MessagePack-able map."""
    try:
        return fast_path(type(obj)).encode(obj)
    except Exception:  # (the fast path only declines: the checked walk below names what is wrong)
        return _checked_to_wire(obj, path)


def _checked_to_wire(obj: Any, path: str) -> dict[str, Any]:
    c = compiled_struct(type(obj))
    out: dict[str, Any] = {}
    for name, to, _ in c.fields:
        value = getattr(obj, name)
        if name in c.defaults and value == c.defaults[name]:
            continue  # an optional field at its default stays off the wire
        out[name] = to(value, f"{path}.{name}" if path else name)
    run_check(obj, path)
    return out


def from_wire(cls: type, data: Any, path: str = "") -> Any:
    """Validate a decoded map strictly (no missing required field, no extra field) and build the struct."""
    try:
        return fast_path(cls).decode(data)
    except Exception:  # (as in ``to_wire``)
        return _checked_from_wire(cls, data, path)


def _checked_from_wire(cls: type, data: Any, path: str) -> Any:
    c = compiled_struct(cls)
    if type(data) is not dict:
        raise Violation("type", path, f"expected a map for {cls.__name__}, got {_type_name(data)}")
    if len(data) != len(c.names) or data.keys() != c.name_set:
        for key in data:
            if key not in c.name_set:
                raise Violation("extra", f"{path}.{key}" if path else str(key), f"not a field of {cls.__name__}")
        for name in c.names:
            if name not in data and name not in c.defaults:
                raise Violation("missing", f"{path}.{name}" if path else name, f"required by {cls.__name__}")
    kwargs = {}
    for name, _, frm in c.fields:
        if name in data:
            kwargs[name] = frm(data[name], f"{path}.{name}" if path else name)
        else:
            kwargs[name] = c.defaults[name]
    obj = cls(**kwargs)
    run_check(obj, path)
    return obj


# The fast path: per struct, an encoder and a decoder generated as straight-line code (``fast_path``). They
# check exactly what the converters above check, but build no field paths (a plan message of 10^5
# transfers made 10^6 path strings): any failure (a broken rule, a missing key, a type) only makes them
# decline, and the checked walk (``_checked_to_wire`` / ``_checked_from_wire``) then finds and names the
# culprit. ``tests/wire/test_fastpath.py`` holds the two to the same answers on random and broken input.


class _Decline(Exception):
    pass


class _Fast:
    __slots__ = ("encode", "decode")


_FAST: dict[type, _Fast] = {}
_ABSENT = object()


def fast_path(cls: type) -> _Fast:
    f = _FAST.get(cls)
    if f is None:
        f = _Fast()
        f.encode, f.decode = _generate(cls)
        _FAST[cls] = f
    return f


def _emit(kind: tuple, v: str, ind: str, env: dict, enc: bool) -> list[str]:
    """Lines that check variable ``v`` against ``kind`` and convert it in place (raising ``_Decline``)."""
    tag, name = kind[0], f"h{len(env)}"
    if tag == "int":
        return [f"{ind}if type({v}) is not int or not {kind[1]} <= {v} <= {kind[2]}: raise _Decline"]
    if tag == "type":
        env[name] = kind[1]
        return [f"{ind}if type({v}) is not {name}: raise _Decline"]
    if tag == "float":
        return [f"{ind}if type({v}) is int: {v} = float({v})", f"{ind}elif type({v}) is not float: raise _Decline"]
    if tag == "struct":
        f = fast_path(kind[1])
        env[name] = f.encode if enc else f.decode
        return [f"{ind}{v} = {name}({v})"]
    if tag in ("call", "columns"):
        env[name] = _converters(kind)[0 if enc else 1]
        return [f"{ind}{v} = {name}({v}, '')"]
    if tag == "opt":
        return [f"{ind}if {v} is not None:", *_emit(kind[1], v, ind + "    ", env, enc)]
    env[name] = _element(kind[1], enc)  # ("tuple", element kind)
    if enc:
        return [f"{ind}if not isinstance({v}, (tuple, list)): raise _Decline", f"{ind}{v} = [{name}(x) for x in {v}]"]
    return [f"{ind}if type({v}) is not list: raise _Decline", f"{ind}{v} = tuple([{name}(x) for x in {v}])"]


def _element(kind: tuple, enc: bool) -> Callable[[Any], Any]:
    if kind[0] == "struct":
        f = fast_path(kind[1])
        return f.encode if enc else f.decode
    env: dict[str, Any] = {}
    return _define("element", ["x"], [*_emit(kind, "x", "    ", env, enc), "    return x"], env)


def _define(fn: str, args: list[str], body: list[str], env: dict) -> Callable:
    scope = {**env, "_Decline": _Decline, "_ABSENT": _ABSENT, "new": object.__new__}
    exec(f"def {fn}({', '.join(args)}):\n" + "\n".join(body), scope)
    return scope[fn]


def _generate(cls: type) -> tuple[Callable, Callable]:
    c = compiled_struct(cls)
    env: dict[str, Any] = {"C": cls}
    kinds = [(i, n, k) for i, (n, k) in enumerate(zip(c.names, c.kinds))]
    required = [(i, n, k) for i, n, k in kinds if n not in c.defaults]
    optional = [(i, n, k) for i, n, k in kinds if n in c.defaults]
    for i, n, _ in optional:
        env[f"D{i}"] = c.defaults[n]
    check = ["    o._check()"] if getattr(cls, "_check", None) is not None else []
    enc = ["    if type(o) is not C: raise _Decline", "    d = o.__dict__"]
    for i, n, k in required:
        enc += [f"    v{i} = d[{n!r}]", *_emit(k, f"v{i}", "    ", env, True)]
    enc.append("    out = {" + ", ".join(f"{n!r}: v{i}" for i, n, _ in required) + "}")
    for i, n, k in optional:  # (at its default: off the wire)
        enc += [f"    v{i} = d[{n!r}]", f"    if not (v{i} == D{i}):", *_emit(k, f"v{i}", "        ", env, True),
                f"        out[{n!r}] = v{i}"]
    encode = _define("encode", ["o"], [*enc, *check, "    return out"], env)
    dec = ["    if type(data) is not dict: raise _Decline"]
    for i, n, k in required:
        dec += [f"    v{i} = data[{n!r}]", *_emit(k, f"v{i}", "    ", env, False)]
    dec.append(f"    k = {len(required)}")
    for i, n, k in optional:
        dec += [f"    v{i} = data.get({n!r}, _ABSENT)", f"    if v{i} is _ABSENT: v{i} = D{i}", "    else:",
                "        k += 1", *_emit(k, f"v{i}", "        ", env, False)]
    dec += ["    if len(data) != k: raise _Decline", "    o = new(C)", "    d = o.__dict__"]
    dec += [f"    d[{n!r}] = v{i}" for i, n, _ in kinds]
    decode = _define("decode", ["data"], [*dec, *check, "    return o"], env)
    return encode, decode
