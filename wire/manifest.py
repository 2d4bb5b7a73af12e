"""Manifests: what a worker holds (a sender) or wants (a receiver), and where the bytes live.

How this works: a worker describes each parameter with a ``TensorSpec`` (name, dtype, shape, byte
size, strides, device, an optional ``ShardSpec`` saying which slice of the full tensor it is, and
where it lives inside one of the worker's registered ``RegionInfo`` s). Regions carry the opaque
transport descriptor a peer needs for one-sided writes. Every rule that can be checked from the
manifest alone (byte counts, shard geometry, region bounds, unique names) is checked at encode and
decode, so a bad manifest is rejected with the field named before any byte moves.

Dtypes travel as torch's names without the ``torch.`` prefix; ``wire`` never imports torch.
"""

from __future__ import annotations

from math import prod
from typing import Optional

from .schema import I64, U32, U64, Violation, struct, trusted

DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise Violation("value", "dtype", f"unknown dtype {dtype!r}") from None


@struct
class Slice:
    """Rows ``start:stop`` of dimension ``dim`` of a full tensor. A slice along a later dim may also keep
    only rows ``dim0_start:dim0_stop`` of dim 0 (``dim0_stop`` set): a block, such as the rows an FSDP
    rank holds of a row-parallel tensor-parallel slice, which it sends without gathering the tensor."""

    dim: U32
    start: U64
    stop: U64
    dim0_start: U64 = 0
    dim0_stop: Optional[U64] = None

    def _check(self) -> None:
        if self.start > self.stop:
            raise Violation("value", "stop", f"stop {self.stop} is before start {self.start}")
        if self.dim0_stop is None:
            if self.dim0_start:
                raise Violation("value", "dim0_start", "dim0_start without dim0_stop")
            return
        if self.dim == 0:
            raise Violation("value", "dim0_stop", "a slice along dim 0 takes its dim-0 rows from start:stop")
        if self.dim0_start > self.dim0_stop:
            raise Violation("value", "dim0_stop", f"dim0_stop {self.dim0_stop} is before dim0_start {self.dim0_start}")

    @property
    def block(self) -> bool:
        """Whether this slice also keeps a range of dim-0 rows."""
        return self.dim0_stop is not None


@struct
class ShardSpec:
    """This tensor is ``full_shape`` sliced along ``dim`` to ``start:stop``."""

    full_shape: tuple[U64, ...]
    dim: U32
    start: U64
    stop: U64

    def _check(self) -> None:
        if self.dim >= len(self.full_shape):
            raise Violation("value", "dim", f"dim {self.dim} out of range for {len(self.full_shape)}-d shape")
        if not self.start <= self.stop <= self.full_shape[self.dim]:
            raise Violation(
                "value", "stop", f"{self.start}:{self.stop} does not fit size {self.full_shape[self.dim]}"
            )

    @property
    def slice(self) -> Slice:
        return trusted(Slice, self.dim, self.start, self.stop)  # a valid shard is a valid slice

    def covers(self, sl: "Optional[Slice]") -> bool:
        """Whether rows ``sl`` of the full tensor lie inside this shard (nil: the whole tensor, which a
        shard covers only when it is all of it along its dim)."""
        if sl is None:
            return self.start == 0 and self.stop == self.full_shape[self.dim]
        if sl.dim == self.dim:
            return self.start <= sl.start and sl.stop <= self.stop
        return self.dim == 0 and sl.block and self.start <= sl.dim0_start and sl.dim0_stop <= self.stop

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)


@struct
class RegionInfo:
    """A registered memory region; ``descriptor`` is the transport's opaque handle for it."""

    region_id: U32
    nbytes: U64
    device: str
    descriptor: bytes


@struct
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[U64, ...]
    nbytes: U64
    strides: tuple[I64, ...]
    contiguous: bool
    device: str
    region: Optional[U32]
    offset: U64
    shard: Optional[ShardSpec]
    tied_to: Optional[str]
    gatherable: bool

    def _check(self) -> None:
        if not self.name:
            raise Violation("value", "name", "empty parameter name")
        want = prod(self.shape) * dtype_size(self.dtype)
        if self.nbytes != want:
            raise Violation(
                "value", "nbytes", f"{self.name}: {self.nbytes} bytes do not match shape {list(self.shape)} "
                f"of {self.dtype} ({want} bytes)"
            )
        if len(self.strides) != len(self.shape):
            raise Violation("value", "strides", f"{self.name}: {len(self.strides)} strides for {len(self.shape)} dims")
        if self.shard is not None and self.shard.local_shape() != tuple(self.shape):
            raise Violation(
                "value", "shard", f"{self.name}: shard of {list(self.shard.full_shape)} along dim "
                f"{self.shard.dim} [{self.shard.start}:{self.shard.stop}] does not give shape {list(self.shape)}"
            )
        if self.tied_to == self.name:
            raise Violation("value", "tied_to", f"{self.name} is tied to itself")

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.shard.full_shape if self.shard is not None else self.shape


@struct
class TransportInfo:
    """How to reach a worker's data plane: transport kind, host, address and opaque extra data."""

    kind: str
    host: str
    address: str
    device: str
    data: bytes


@struct
class Manifest:
    tensors: tuple[TensorSpec, ...]
    regions: tuple[RegionInfo, ...]

    def _check(self) -> None:
        regions = {}
        for i, r in enumerate(self.regions):
            if r.region_id in regions:
                raise Violation("value", f"regions[{i}].region_id", f"duplicate region id {r.region_id}")
            regions[r.region_id] = r
        names: set[str] = set()
        for i, t in enumerate(self.tensors):
            if t.name in names:
                raise Violation("value", f"tensors[{i}].name", f"duplicate parameter {t.name!r}")
            names.add(t.name)
            if t.region is None:
                continue
            region = regions.get(t.region)
            if region is None:
                raise Violation("value", f"tensors[{i}].region", f"{t.name}: no region {t.region}")
            if t.contiguous and t.offset + t.nbytes > region.nbytes:
                raise Violation(
                    "value", f"tensors[{i}].offset", f"{t.name}: bytes {t.offset}+{t.nbytes} overrun region "
                    f"{t.region} of {region.nbytes} bytes"
                )
        for i, t in enumerate(self.tensors):
            if t.tied_to is not None and t.tied_to not in names:
                raise Violation("value", f"tensors[{i}].tied_to", f"{t.name} is tied to unknown {t.tied_to!r}")

    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.tied_to is None)
