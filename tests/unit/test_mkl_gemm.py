"""gpu_worker.executor.ops.cpu.mkl_gemm: MKL's packed GEMM from torch's own MKL, for any row count."""

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.executor.ops.cpu import mkl_gemm

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not mkl_gemm.available(), reason="this torch build has no MKL (not x86)")]


@pytest.mark.parametrize("rows", [0, 1, 3, 17, 256, 300, 1024])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_packed_weight_serves_every_row_count(rows, with_bias):
    """Packed once, the weight multiplies any number of rows (torch's own _mkl_linear takes its packed form only
    for the row count it was packed for); from a few rows on the result is F.linear's to the bit, as both are
    MKL's kernel, and the bias is added by MKL as addmm adds it."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    bias_before = b.clone()
    x = torch.randn(rows, 96, generator=g)
    packed = mkl_gemm.pack_weight(w, 64)
    out = mkl_gemm.gemm(x, packed, 200, b if with_bias else None)
    want = F.linear(x, w, b if with_bias else None)
    assert out.shape == (rows, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    if rows >= 17:
        assert torch.equal(out, want)
    assert torch.equal(b, bias_before)  # MKL writes C: never the bias itself (one row: expand is a view of it)


def test_a_row_strided_input_is_read_in_place_and_a_column_strided_one_copied():
    g = torch.Generator().manual_seed(0)
    w, wide = torch.randn(64, 40, generator=g), torch.randn(300, 100, generator=g)
    packed = mkl_gemm.pack_weight(w, 64)
    rows = wide[:, 10:50]  # a view with row stride 100
    assert torch.equal(mkl_gemm.gemm(rows, packed, 64), F.linear(rows, w))
    cols = wide[:, :80:2]  # column stride 2
    torch.testing.assert_close(mkl_gemm.gemm(cols, packed, 64), F.linear(cols, w), atol=1e-5, rtol=1e-5)


def test_the_packed_weight_is_independent_of_the_weight_it_came_from():
    w = torch.randn(32, 24)
    packed = mkl_gemm.pack_weight(w[:, :16], 300)  # a strided view: packed from a contiguous copy
    want = F.linear(torch.ones(300, 16), w[:, :16])
    w.zero_()  # the model lets its loaded weight go once it is packed
    torch.testing.assert_close(mkl_gemm.gemm(torch.ones(300, 16), packed, 32), want, atol=1e-5, rtol=1e-5)


def test_other_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match="weight: a 2-D float32"):
        mkl_gemm.pack_weight(torch.ones(4, 4, dtype=torch.bfloat16), 8)
    with pytest.raises(ValueError, match="x: float32 expected"):
        mkl_gemm.gemm(torch.ones(2, 4, dtype=torch.bfloat16), mkl_gemm.pack_weight(torch.ones(4, 4), 8), 4)
