"""kvfleet's native CPU kernels (gpu_worker/executor/ops/cpu/csrc, through gpu_worker.executor.ops.cpu.native_ops) against the torch ops.

The elementwise kernels round as the torch ops do, so bfloat16 results match them to within one bfloat16
ulp (where a sum of squares accumulated in another order lands the normalized value on the other side of a
rounding boundary) and float32 within a few float32 ulps. Decode attention runs both its SIMD kernel (AVX-512 or AVX2,
whichever the machine has) and its portable loops.
"""


import pytest
import torch

from gpu_worker.executor.ops import torch_ops as ops
from gpu_worker.executor.ops.cpu import kernels as cpu_kernels
from gpu_worker.executor.ops.cpu import native_ops as cpu_ops

pytestmark = pytest.mark.kernels

DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = ["token-major", "head-major"]  # the caches' memory: contiguous, or as the CPU model runner allocates them


def kv_cache(num_blocks, block_size, hkv, head_dim, g, dtype, layout):
    """Random keys or values [num_blocks, block_size, Hkv, D], in the given memory layout (the same values)."""
    values = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    if layout == "token-major":
        return values
    cache = cpu_kernels.head_major_kv_cache(num_blocks, block_size, hkv, head_dim, dtype=dtype)
    assert cpu_kernels.kv_layout(cache, cache) == 1  # (with one head the two coincide: 1 or 0 address alike)
    return cache.copy_(values)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.load() is not None, "g++ could not build gpu_worker/executor/ops/cpu/csrc/"


def close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if dtype == torch.bfloat16:  # one bf16 ulp: 2**-7 relative
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=2**-7)
    else:
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [3, 300])  # decode-sized (one thread) and prefill-sized (OpenMP)
def test_rms_norm_silu_rotary_store(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=g).to(dtype)  # 72: vector body + scalar tail
    res = torch.randn(rows, 72, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(72, generator=g)).to(dtype)
    close(cpu_ops.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5), dtype)
    (out, new_res), (want, want_res) = cpu_ops.rms_norm(x, w, 1e-5, res), ops.rms_norm(x, w, 1e-5, res)
    close(out, want, dtype)
    close(new_res, want_res, dtype)

    gate_up = (3 * torch.randn(rows, 2 * 100, generator=g)).to(dtype)  # 100: 64 four registers at a time, 32, 4
    close(cpu_ops.silu_and_mul(gate_up), ops.silu_and_mul(gate_up), dtype)

    head_dim, hq, hkv = 32, 3, 1
    qkv = torch.randn(rows, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)  # strided row views
    cos_sin = torch.randn(64, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 64, (rows,), generator=g)
    for neox in (True, False):
        got, want = cpu_ops.rotary_embedding(positions, q, k, cos_sin, head_dim, neox), ops.rotary_embedding(
            positions, q, k, cos_sin, head_dim, neox)
        close(got[0], want[0].contiguous(), dtype)
        close(got[1], want[1].contiguous(), dtype)

    hkv = 2
    kv = torch.randn(rows, 2 * hkv * head_dim, generator=g).to(dtype)
    k, v = kv.split([hkv * head_dim, hkv * head_dim], dim=-1)  # strided row views, as from the qkv projection
    slots = torch.randperm(400, generator=g)[:rows]
    slots[0] = -1
    key, value = k.view(rows, hkv, head_dim), v.view(rows, hkv, head_dim)
    want_k, want_v = torch.zeros(100, 4, hkv, head_dim, dtype=dtype), torch.zeros(100, 4, hkv, head_dim, dtype=dtype)
    ops.store_kv_cache(key, value, want_k, want_v, slots)
    assert torch.equal(want_k[slots[1] // 4, slots[1] % 4], key[1])
    assert int(want_k.flatten(0, 1).any(-1).any(-1).sum()) == rows - 1  # slot -1: skipped
    for layout in (0, 1):
        pair = [torch.zeros(100, 4, hkv, head_dim, dtype=dtype) if layout == 0
                else cpu_kernels.head_major_kv_cache(100, 4, hkv, head_dim, dtype=dtype).zero_() for _ in range(2)]
        assert cpu_kernels.kv_layout(*pair) == layout
        cpu_ops.store_kv_cache(key, value, *pair, slots)
        assert torch.equal(pair[0], want_k) and torch.equal(pair[1], want_v), layout
        torch_pair = [torch.zeros_like(t) for t in pair]  # the torch op into the same layout
        ops.store_kv_cache(key, value, *torch_pair, slots)
        assert torch.equal(torch_pair[0], want_k) and torch.equal(torch_pair[1], want_v), layout


@pytest.mark.skipif(cpu_kernels.isa() in ("none", "scalar"), reason="no SIMD build on this CPU")
def test_every_simd_build_has_the_native_prefill_kernel():
    """AVX2 builds (Zen 2/3) as well as AVX-512 ones: head dims 16-128 in powers of two, nothing else."""
    assert [d for d in (16, 32, 48, 64, 96, 128) if cpu_kernels.prefill_covers(d)] == [16, 32, 64, 128]


@pytest.fixture(params=["no-amx", "amx"])
def bf16_kernels(request):
    """The native bf16 kernels on each path this CPU runs: without AMX tiles (vdpbf16ps; AVX2 or scalar code where
    the CPU has no AVX512_BF16), and on AMX tiles where it has them (skipped elsewhere)."""
    on = request.param == "amx"
    was = cpu_kernels.amx()
    if on and not was:
        pytest.skip("no AMX-BF16 here (or Linux does not lend this process the tile state)")
    assert cpu_kernels.amx(on) == on
    yield request.param
    cpu_kernels.amx(was)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 16),
                                                         (10, 2, 64, 16), (6, 2, 32, 4), (9, 3, 64, 8),
                                                         (14, 1, 64, 16), (16, 2, 128, 16), (11, 1, 64, 16)])
def test_decode_attention_reads_the_paged_cache(dtype, hq, hkv, head_dim, block_size, layout):
    g = torch.Generator().manual_seed(hq * head_dim + block_size)
    num_blocks = 200
    key_cache = kv_cache(num_blocks, block_size, hkv, head_dim, g, dtype, layout)
    value_cache = kv_cache(num_blocks, block_size, hkv, head_dim, g, dtype, layout)
    lens = torch.tensor([1, 2, block_size - 1, block_size, block_size + 1, 33, 100], dtype=torch.int32)
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    query = torch.randn(len(lens), hq, head_dim, generator=g).to(dtype)
    want = ops._decode_attention(query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    for simd in (True, False):
        out = torch.zeros_like(query)
        cpu_kernels.decode_attention(query, key_cache, value_cache, tables, lens, torch.arange(len(lens)),
                                     head_dim**-0.5, out, int(lens.max()), simd=simd)
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-6  # bf16: the torch path rounds its scores to bf16
        torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trend", ["rising", "falling", "spike-last"])
def test_decode_attention_follows_a_running_max_that_moves_late_or_never(dtype, trend):
    """The AVX-512 kernel rescales only where a block's scores pass the running max: scores that rise block after
    block (a rescale every block), that fall (never after the first), and one key far above the rest in the
    last, partial block (softmax all but one-hot there) against the torch op."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, head_dim, block_size, length = 9, 3, 64, 16, 87
    key_cache = kv_cache(8, block_size, hkv, head_dim, g, dtype, "head-major")
    value_cache = kv_cache(8, block_size, hkv, head_dim, g, dtype, "head-major")
    query = torch.ones(1, hq, head_dim).to(dtype)
    base = torch.ones(head_dim) / head_dim
    ramp = torch.linspace(-4, 4, length) if trend == "rising" else torch.linspace(4, -4, length)
    if trend == "spike-last":
        ramp = torch.zeros(length)
        ramp[-1] = 60.0
    table = torch.tensor([[3, 0, 6, 1, 7, 2]], dtype=torch.int32)
    for t in range(length):  # the score of token t is ramp[t] * sqrt(head_dim) / sqrt(head_dim)
        key_cache[int(table[0, t // block_size]), t % block_size] = (base * ramp[t] * head_dim**0.5).to(dtype)
    lens = torch.tensor([length], dtype=torch.int32)
    want = ops._decode_attention(query, key_cache, value_cache, table, lens, head_dim**-0.5)
    out = torch.zeros_like(query)
    cpu_kernels.decode_attention(query, key_cache, value_cache, table, lens, torch.arange(1), head_dim**-0.5, out,
                                 length)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    if trend == "spike-last":  # all but one-hot on the last token: its value row
        last = value_cache[int(table[0, (length - 1) // block_size]), (length - 1) % block_size]
        torch.testing.assert_close(out[0].float(), last.repeat_interleave(hq // hkv, 0).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_mixed_batch_matches_the_torch_op(dtype, layout):
    g = torch.Generator().manual_seed(1)
    hq, hkv, head_dim, block_size, num_blocks = 6, 2, 64, 8, 64
    key_cache = kv_cache(num_blocks, block_size, hkv, head_dim, g, dtype, layout)
    value_cache = kv_cache(num_blocks, block_size, hkv, head_dim, g, dtype, layout)
    q_lens, ctx = [20, 1, 7, 1, 33], [20, 50, 40, 3, 33]  # prefill, decode, chunk after a prefix, decode, prefill
    width = max(-(-c // block_size) for c in ctx)
    tables = torch.randperm(num_blocks, generator=g)[: len(ctx) * width].view(len(ctx), width).to(torch.int32)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(starts[-1]), hq, head_dim, generator=g).to(dtype)
    args = (query, key_cache, value_cache, tables, starts, torch.tensor(ctx, dtype=torch.int32), head_dim**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(cpu_ops.paged_attention(*args).float(), ops.paged_attention(*args).float(),
                               atol=tol, rtol=tol)


def test_bf16_results_that_are_subnormal_round_as_torch_rounds_them():
    """bfloat16 stores through vcvtneps2bf16, which flushes float32 subnormals to zero; torch rounds them to bf16
    subnormals. SiLU-and-mul of gates under 2^-24 is exactly gate / 2 * up, so every lane here is a subnormal (or a
    tie, or zero) to round, next to normal ones, and the kernel's bits must be torch's."""
    tiny = torch.tensor([2.0**-133, -(2.0**-133), 3 * 2.0**-133, 2.0**-127, -(2.0**-126), 2.0**-130 * 1.5, 0.0,
                         1e-30, 2.0**-126, 5e-39, -7e-39, 2.0**-132, 2.0**-128 * 1.25, 3e-40, 1e-39, 2.0**-120])
    gate = tiny.repeat(3, 4).bfloat16()  # 64 columns: the kernel's four-register loop
    up = torch.tensor([1.0, 0.5, 3.0, -1.0]).repeat_interleave(16).repeat(3, 1).bfloat16()
    up[2] = 1.5
    got = cpu_ops.silu_and_mul(torch.cat([gate, up], dim=1))
    want = (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
    assert (want.float().abs() < 2.0**-126).sum() > 20  # subnormal results, the point of the test
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_unsupported_inputs_fall_back_to_the_torch_ops():
    x = torch.randn(4, 16, dtype=torch.float64)
    w = torch.ones(16, dtype=torch.float64)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    gate_up = torch.randn(4, 32, dtype=torch.float16)
    assert torch.equal(cpu_ops.silu_and_mul(gate_up), ops.silu_and_mul(gate_up))
    # caches in neither layout the kernels read (here [block_size, num_blocks, ...] in memory): the torch ops
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, bs, nb = 4, 2, 64, 16, 8
    caches = [torch.randn(bs, nb, hkv, d, generator=g).transpose(0, 1) for _ in range(2)]
    assert cpu_kernels.kv_layout(*caches) is None and cpu_kernels.kv_layout(caches[0], caches[1].contiguous()) is None
    query = torch.randn(3, hq, d, generator=g)
    args = (query, *caches, torch.tensor([[3, 1, 4]], dtype=torch.int32).expand(3, 3).contiguous(),
            torch.arange(4, dtype=torch.int32), torch.tensor([40, 17, 33], dtype=torch.int32), d**-0.5)
    torch.testing.assert_close(cpu_ops.paged_attention(*args), ops.paged_attention(*args))
    key = torch.randn(2, hkv, d, generator=g)
    slots = torch.tensor([5, 70])
    cpu_ops.store_kv_cache(key, key, *caches, slots)
    assert torch.equal(caches[0][0, 5], key[0]) and torch.equal(caches[1][4, 6], key[1])


@pytest.mark.parametrize(("dtype", "bf16_kernels"), [(torch.float32, "no-amx"), (torch.bfloat16, "no-amx"),
                                                     (torch.bfloat16, "amx")], indirect=["bf16_kernels"])
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 32, 4),
                                                         (4, 2, 16, 16),  # 16: bf16 query pairs fill half a register
                                                         (6, 2, 48, 8)])  # 48: no native variant
@pytest.mark.parametrize("q_len,ctx", [(37, 37), (20, 53), (16, 16), (2, 90)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_chunks_match_the_torch_op(dtype, hq, hkv, head_dim, block_size, q_len, ctx, layout, bf16_kernels):
    """Causal chunks (a whole prompt, a chunk after a cached prefix, lengths that end mid-tile and mid-block), grouped
    heads, both KV layouts; bfloat16 on each of its kernels here (vdpbf16ps; AMX tiles where the CPU has them)."""
    g = torch.Generator().manual_seed(q_len * ctx + head_dim)
    num_blocks = 40
    key_cache = kv_cache(num_blocks, block_size, hkv, head_dim, g, dtype, layout)
    value_cache = kv_cache(num_blocks, block_size, hkv, head_dim, g, dtype, layout)
    table = torch.randperm(num_blocks, generator=g)[: -(-ctx // block_size)].to(torch.int32)[None]  # [1, nb]
    query = torch.randn(q_len, hq, head_dim, generator=g).to(dtype)
    args = (query, key_cache, value_cache, table, torch.tensor([0, q_len], dtype=torch.int32),
            torch.tensor([ctx], dtype=torch.int32), head_dim**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-6
    torch.testing.assert_close(cpu_ops.paged_attention(*args).float(), ops.paged_attention(*args).float(),
                               atol=tol, rtol=tol)


needs_gemm = pytest.mark.skipif(not cpu_kernels.gemm_available(), reason="the panel GEMM needs AVX2 + FMA")


@pytest.fixture(params=[0, 1])
def f32_blocking(request):
    """The float32 panel GEMM under each of its k blockings (the calibration picks one per CPU)."""
    was = cpu_kernels.gemm_blocking()
    assert cpu_kernels.gemm_blocking(request.param) == request.param
    yield request.param
    cpu_kernels.gemm_blocking(was)


@needs_gemm
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 5, 7), (4, 130, 24), (5, 577, 25), (33, 64, 960), (7, 1536, 49), (64, 576, 97),
                                   (9, 129, 48), (17, 65, 16), (0, 64, 48), (300, 130, 50)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_gemm_against_float64(m, k, n, with_bias, f32_blocking):
    """Row tails (m % 4 or 8), column tails (n % 24 or 48), k blocks (k > 64 or 128; 64 in AVX2 builds' second
    blocking) and row blocks (from 256 rows, blocks of 128 and a tail) against a float64 product."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_kernels.pack_gemm_weight(w)
    width = cpu_kernels.gemm_panel_width()
    assert packed.numel() == -(-n // width) * width * k
    out = cpu_kernels.gemm(x, packed, n, b if with_bias else None)
    want = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.skipif(not cpu_kernels.gemm_available(torch.bfloat16), reason="the bf16 panel GEMM needs AVX512_BF16")
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 5, 7), (8, 130, 48), (5, 577, 25), (33, 64, 960), (64, 576, 97),
                                   (9, 1536, 576), (0, 64, 48), (16, 32, 16), (70, 96, 100), (130, 64, 47)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_panel_gemm_rounds_as_torch(m, k, n, with_bias, bf16_kernels):
    """Row tails (m % 8; on AMX, m % 16 and more than one block of 64 rows), column tails (n % 48, and % 16), an
    odd k (its last element paired with a zero, never with what lies past the row; AMX takes k % 32 == 0 and
    leaves the rest to vdpbf16ps): within one bf16 rounding of a float64 product, and the same values as
    F.linear's bf16 GEMM but for a rare last-bit difference (fp32 sums in another order)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k + 1, generator=g).bfloat16()[:, :k], torch.randn(n, k, generator=g).bfloat16()
    x[:, -1:] = 1.0  # an odd k's last element, next to a NaN past it in the row (row stride k + 1)
    if k % 2:
        x.as_strided((m, 1), (k + 1, 1), k).fill_(float("nan"))
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    packed = cpu_kernels.pack_gemm_weight(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() == -(-n // 48) * 48 * ((k + 1) // 2) * 2
    out = cpu_kernels.gemm(x, packed, n, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16 and not out.isnan().any()
    want = x.double() @ w.double().T + (b.double() if with_bias else 0)
    torch.testing.assert_close(out.double(), want, atol=1e-3 * k**0.5, rtol=2**-7)
    if m:
        assert (out == torch.nn.functional.linear(x, w, b)).float().mean() > 0.99
    wide = cpu_kernels.gemm(x, packed, n, b, float_out=True)  # the logits' form: the same values in float32
    assert wide.dtype == torch.float32 and wide.shape == (m, n)
    assert torch.equal(wide, out.float())


@needs_gemm
def test_panel_gemm_reads_strided_rows_and_is_deterministic_across_threads():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g)  # >= 1 MiB: split across threads when the caller has several
    base = torch.randn(32, 600, generator=g)
    x = base[:, :576]  # row stride 600
    packed = cpu_kernels.pack_gemm_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.gemm(x, packed, 1536)
        torch.set_num_threads(2)
        two = cpu_kernels.gemm(x, packed, 1536)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, cpu_kernels.gemm(x.contiguous(), packed, 1536))
    torch.testing.assert_close(one, x @ w.T, atol=1e-3, rtol=1e-4)
    many = torch.randn(300, 576, generator=g)  # row blocks: each row's outputs as in a call of a few rows
    assert torch.equal(cpu_kernels.gemm(many, packed, 1536)[250:270], cpu_kernels.gemm(many[250:270], packed, 1536))
    was = cpu_kernels.gemm_blocking()
    try:  # every blocking sums each output in the same order: the same bits
        for b in (0, 1):
            assert cpu_kernels.gemm_blocking(b) == b and torch.equal(cpu_kernels.gemm(x, packed, 1536), one)
    finally:
        cpu_kernels.gemm_blocking(was)


@pytest.mark.skipif(cpu_kernels.isa() not in ("avx512", "avx512+avx512_bf16"), reason="the native argmax needs AVX-512")
@pytest.mark.parametrize("cols", [1, 15, 16, 63, 64, 65, 200, 49152])
def test_native_argmax_picks_as_torch_does(cols):
    """Greedy sampling's argmax: the first of tied maxima, the first NaN, an all -inf row's first index, 0.0 and
    -0.0 as equal; rows over the threads (64 x 49,152: a decode step's logits) and strided rows."""
    g = torch.Generator().manual_seed(cols)
    rows = 64
    cases = {
        "random": torch.randn(rows, cols, generator=g),
        "ties": torch.randint(-3, 3, (rows, cols), generator=g).float(),
        "signed zeros": torch.where(torch.rand(rows, cols, generator=g) < 0.5, 0.0, -0.0),
        "all -inf": torch.full((rows, cols), float("-inf")),
        "+inf": torch.where(torch.rand(rows, cols, generator=g) < 0.2, float("inf"), torch.randn(rows, cols, generator=g)),
        "NaN": torch.where(torch.rand(rows, cols, generator=g) < 0.05, float("nan"), torch.randn(rows, cols, generator=g)),
        "strided": torch.randn(rows, cols + 7, generator=g)[:, 3:3 + cols],
    }
    for name, x in cases.items():
        got = cpu_kernels.argmax(x)
        assert got is not None and torch.equal(got, x.argmax(dim=-1)), name
    assert cpu_kernels.argmax(torch.randn(4, 8).to(torch.bfloat16)) is None  # float32 only: torch's then
