"""Source views, staging copies and shard coordinates (engine/datapath/staging.py)."""

from __future__ import annotations


import pytest
import torch

from weightsync.engine.datapath.staging import SourceSet, StagingPool
from weightsync.engine.errors import StagingError
from weightsync.wire import Slice, Transfer


def _t(index, name, nbytes, slice_=None, dst=0, offset=0, transform=""):
    return Transfer(index, name, slice_, dst, name, 0, offset, nbytes, transform)


async def test_staging_views_copies_and_errors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sources = SourceSet({"w": base, "wt": base.t()})
    pool = StagingPool()
    rows = await sources.stage(_t(0, "w", 2 * 6 * 4, Slice(0, 1, 3)), pool, "crc32")
    assert not rows.pooled and rows.tensor.data_ptr() == base[1].data_ptr()  # a view: zero copy
    cols = await sources.stage(_t(1, "w", 4 * 2 * 4, Slice(1, 2, 4)), pool, "")
    assert cols.pooled and torch.equal(cols.tensor, base[:, 2:4])  # another dim: staged copy
    nc = await sources.stage(_t(2, "wt", 24 * 4), pool, "")
    assert nc.pooled and torch.equal(nc.tensor, base.t())
    pool.give(cols.buffer)
    pool.give(nc.buffer)
    again = await sources.stage(_t(3, "w", 4 * 2 * 4, Slice(1, 0, 2)), pool, "")
    assert pool.reused == 1 and torch.equal(again.tensor, base[:, 0:2])
    with pytest.raises(StagingError, match="does not hold"):
        await sources.stage(_t(4, "nope", 4), pool, "")
    with pytest.raises(StagingError, match="the table says"):
        await sources.stage(_t(5, "w", 7), pool, "")
    with pytest.raises(StagingError, match="unknown transform"):
        await sources.stage(_t(6, "w", 96, transform="fp8"), pool, "")


async def test_sharded_source_uses_local_coordinates():
    from weightsync.wire import ShardSpec

    shard = torch.arange(8, dtype=torch.float32).reshape(4, 2)  # rows 4:8 of an (8, 2) tensor
    sources = SourceSet({"w": shard}, {"w": ShardSpec((8, 2), 0, 4, 8)})
    staged = await sources.stage(_t(0, "w", 2 * 2 * 4, Slice(0, 5, 7)), StagingPool(), "")
    assert torch.equal(staged.tensor, shard[1:3])
    with pytest.raises(StagingError, match="outside the rows"):
        await sources.stage(_t(1, "w", 16, Slice(0, 2, 4)), StagingPool(), "")


async def test_a_block_of_a_dim0_shard_is_its_rows_of_the_columns():
    """A block (columns 1:3 of dim 1, dim-0 rows 5:7) read from a rank holding rows 4:8: a strided view
    of its own rows, staged contiguous; rows it does not hold are a typed error naming the parameter."""
    from weightsync.wire import ShardSpec

    shard = torch.arange(16, dtype=torch.float32).reshape(4, 4)  # rows 4:8 of an (8, 4) tensor
    sources = SourceSet({"w": shard}, {"w": ShardSpec((8, 4), 0, 4, 8)})
    staged = await sources.stage(_t(0, "w", 2 * 2 * 4, Slice(1, 1, 3, 5, 7)), StagingPool(), "")
    assert staged.pooled and torch.equal(staged.tensor, shard[1:3, 1:3])
    with pytest.raises(StagingError, match=r"parameter 'w': .*dim0_start=2.*outside the rows"):
        await sources.stage(_t(1, "w", 2 * 2 * 4, Slice(1, 1, 3, 2, 4)), StagingPool(), "")


@pytest.mark.parametrize("n", [0, 1, 3, 4096 + 7, (1 << 20) + 5])
def test_crc32_checksums_are_zlibs_crc32(n):
    """``crc32`` is zlib's CRC-32 of the bytes, whoever computes it (ISA-L where it imports, as it does
    wherever weightsync's dependencies are installed; zlib otherwise): odd sizes, other dtypes, strided."""
    import importlib.util
    import zlib

    from weightsync.engine.datapath import checksums

    g = torch.Generator().manual_seed(n)
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    assert checksums.checksum(t, "crc32") == zlib.crc32(t.numpy().tobytes())
    x = torch.randn(33, 17 + n % 5, generator=g).to(torch.bfloat16).t()
    assert checksums.checksum(x, "crc32") == zlib.crc32(x.contiguous().view(torch.uint8).numpy().tobytes())
    assert (checksums._crc32 is zlib.crc32) == (importlib.util.find_spec("isal") is None)
