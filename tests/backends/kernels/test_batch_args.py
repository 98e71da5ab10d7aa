"""The paged-batch argument checks shared by the MSA indexer and sparse-attention launchers."""

import pytest
import torch

from m3c.backends.kernels.batch_args import paged_batch, require_aligned
from m3c.errors import ShapeError


def _meta(rows: int = 5, reqs: int = 2, blocks: int = 3) -> dict:
    return {"positions": torch.arange(rows, dtype=torch.int64),
            "query_start_loc": torch.tensor([0, 2, rows], dtype=torch.int32)[: reqs + 1],
            "seq_lens": torch.full((reqs,), 7, dtype=torch.int32),
            "block_table": torch.randperm(reqs * blocks).view(reqs, blocks).to(torch.int32)}


def test_kernel_dtypes_pass_through_and_others_convert() -> None:
    m = _meta()
    got = paged_batch(**m, rows=5, device=torch.device("cpu"))
    assert all(g is x for g, x in zip(got, m.values()))  # BatchMetadata's dtypes: no copies
    m64 = {k: v.to(torch.int64) for k, v in m.items()}
    got = paged_batch(**m64, rows=5, device=torch.device("cpu"))
    assert [g.dtype for g in got] == [torch.int64, torch.int32, torch.int32, torch.int32]
    assert all(torch.equal(g.long(), x) for g, x in zip(got, m64.values()))


@pytest.mark.parametrize("bad,match", [
    ({"seq_lens": torch.ones((2, 1), dtype=torch.int32)}, "seq_lens"),
    ({"query_start_loc": torch.tensor([0, 5], dtype=torch.int32)}, "query_start_loc"),
    ({"block_table": torch.zeros((3, 3), dtype=torch.int32)}, "block_table"),
    ({"positions": torch.arange(4)}, "positions"),
    ({"positions": torch.arange(5).float()}, "positions has dtype"),
    ({"block_table": torch.zeros((2, 3), dtype=torch.bool)}, "block_table has dtype"),
    ({"seq_lens": torch.full((2,), 7, dtype=torch.int32, device="meta")}, "seq_lens is on meta"),
])
def test_rejects(bad: dict, match: str) -> None:
    with pytest.raises(ShapeError, match=match):
        paged_batch(**(_meta() | bad), rows=5, device=torch.device("cpu"))


def test_require_aligned() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    require_aligned(a=buf, b=buf[16:])
    with pytest.raises(ShapeError, match="b must start at a 16-byte aligned address"):
        require_aligned(a=buf, b=buf[1:])
