"""CUDA C++ sources: the shared header is expanded into what a spec is keyed by and what a compile records."""

from __future__ import annotations

import pytest

from m3c.backends import cuda_aot
from m3c.backends.cuda_aot import SOURCE_DIR, source_text


@pytest.mark.parametrize("source", sorted(p.name for p in SOURCE_DIR.glob("*.cu")))
def test_sources_expand_their_header_once(source: str) -> None:
    """Every kernel source includes ptx_common.cuh; its expansion holds the header's helpers exactly once and no
    include line of ours is left (so the text compiles on its own and its sha covers the header)."""
    raw = (SOURCE_DIR / source).read_text()
    assert '#include "ptx_common.cuh"' in raw
    text = source_text(source)
    assert '#include "ptx_common.cuh"' not in text and "#pragma once" not in text
    assert text.count("__device__ __forceinline__ u32 prmt(") == 1
    assert text.count("typedef unsigned int u32;") == 1
    if '#include "moe_tokens.cuh"' in raw:  # a header that itself includes ptx_common.cuh: both still once
        assert text.count("void pow2_scale(") == 1 and '#include "moe_tokens.cuh"' not in text


def test_header_edit_changes_the_key(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec's key follows its header: the same .cu with another ptx_common.cuh keys differently."""
    for p in SOURCE_DIR.glob("*.cu*"):
        (tmp_path / p.name).write_text(p.read_text())
    monkeypatch.setattr(cuda_aot, "SOURCE_DIR", tmp_path)
    cuda_aot.source_text.cache_clear()
    cuda_aot._source_sha.cache_clear()
    spec = cuda_aot.CudaKernelSpec("f", "msa_indexer_mma.cu", "msa_index_scores", (("q", "*u8"),))
    before = spec.key()
    (tmp_path / "ptx_common.cuh").write_text((tmp_path / "ptx_common.cuh").read_text() + "// edited\n")
    cuda_aot.source_text.cache_clear()
    cuda_aot._source_sha.cache_clear()
    after = cuda_aot.CudaKernelSpec("f", "msa_indexer_mma.cu", "msa_index_scores", (("q", "*u8"),)).key()
    assert before != after
    cuda_aot.source_text.cache_clear()
    cuda_aot._source_sha.cache_clear()
