"""The native decode stack (gpu_worker/executor/ops/cpu/decode_stack.py) against the model's Python forward: a
decode step's hidden states and residual, and the keys and values it stores, bit for bit, on tiny models of the
families (Llama; Qwen2 with its qkv bias; Qwen3 with its q/k RMSNorm), in float32 and bfloat16; and the steps and
plans it leaves to the Python forward (a prefill chunk in the batch, another matmul path)."""

import pytest
import torch

from gpu_worker.executor.model_loader import load_model_files
from gpu_worker.executor.models.llama import LlamaForCausalLM
from gpu_worker.executor.ops import AttentionMetadata
from gpu_worker.executor.ops.cpu import kernels as cpu_kernels
from gpu_worker.executor.ops.cpu import linear as cpu_linear

pytestmark = pytest.mark.kernels

BLOCK, BLOCKS = 16, 64


def _model(model_dir, dtype, plan):
    files = load_model_files(model_dir)
    model = LlamaForCausalLM(files.config, max_positions=512, dtype=dtype)
    model.load_weights(files.weights())
    model.pack_weights(plan)
    return model


def _caches(model, dtype, gen, head_major=False):
    """Random caches, contiguous or head-major in memory as the CPU model runner allocates them."""
    arch = model.arch
    shape = (BLOCKS, BLOCK, arch.num_kv_heads, arch.head_dim)

    def one():
        values = torch.randn(shape, generator=gen).to(dtype)
        return cpu_kernels.head_major_kv_cache(*shape, dtype=dtype).copy_(values) if head_major else values
    return [(one(), one()) for _ in range(arch.num_layers)]


def _decode_batch(lens, gen):
    """One decode token per sequence, each with its own shuffled blocks: (positions, metadata)."""
    width = max(-(-n // BLOCK) for n in lens)
    blocks = torch.randperm(BLOCKS, generator=gen)[: len(lens) * width].view(len(lens), width)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.stack([blocks[s, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for s, n in enumerate(lens)])
    meta = AttentionMetadata(slot_mapping=slots.long(), block_tables=blocks.to(torch.int32),
                             query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                             context_lens=torch.tensor(lens, dtype=torch.int32))
    return positions, meta


def _python_forward(model, ids, positions, caches, meta):
    stack, model.decode_stack = model.decode_stack, None
    try:
        return model(ids, positions, caches, meta)
    finally:
        model.decode_stack = stack


PANEL = cpu_linear.LinearPlan("panel", None, bf16_gemm=True)


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_decode_step_through_the_stack_equals_the_python_forward(request, dtype, family, head_major):
    """The Python forward on contiguous copies of the caches: the stack on head-major ones gives the same bits."""
    if not cpu_kernels.gemm_available(dtype):
        pytest.skip(f"no panel GEMM for {dtype} on this CPU: the stack does not apply")
    model = _model(request.getfixturevalue(f"tiny_{family}_dir"), dtype, PANEL)
    assert model.decode_stack is not None
    gen = torch.Generator().manual_seed(0)
    caches = _caches(model, dtype, gen, head_major)
    assert {cpu_kernels.kv_layout(k, v) for k, v in caches} == {int(head_major)}
    positions, meta = _decode_batch([1, 17, 40, 16, 33, 5, 64], gen)
    ids = torch.randint(0, model.arch.vocab_size, (len(positions),), generator=gen)
    with torch.inference_mode():
        theirs_caches = [(k.contiguous().clone(), v.contiguous().clone()) for k, v in caches]
        ours = model(ids, positions, caches, meta)
        theirs = _python_forward(model, ids, positions, theirs_caches, meta)
    assert torch.equal(ours, theirs)
    for (k, v), (tk, tv) in zip(caches, theirs_caches, strict=True):
        assert torch.equal(k, tk) and torch.equal(v, tv)


def test_steps_and_models_it_does_not_cover_take_the_python_forward(tiny_llama_dir):
    dtype = torch.float32
    if not cpu_kernels.gemm_available(dtype):
        pytest.skip("no panel GEMM on this CPU")
    assert _model(tiny_llama_dir, dtype, cpu_linear.LinearPlan("onednn", None, False)).decode_stack is None
    model = _model(tiny_llama_dir, dtype, PANEL)
    gen = torch.Generator().manual_seed(1)
    caches = _caches(model, dtype, gen)
    positions, meta = _decode_batch([9, 20], gen)
    hidden = torch.randn(3, model.arch.hidden_size, generator=gen)
    prefill = AttentionMetadata(slot_mapping=torch.tensor([0, 1, 2]), block_tables=meta.block_tables,
                                query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
                                context_lens=meta.context_lens)  # a chunk of 2 tokens: not all decode
    assert model.decode_stack.run(hidden, torch.tensor([7, 8, 19]), caches, prefill, model.cos_sin_cache) is None
    # caches the kernels cannot read (another memory layout), or layers in different layouts
    odd = [(k.transpose(0, 1).contiguous().transpose(0, 1), v) for k, v in caches]
    mixed = [*caches[:1], *_caches(model, dtype, gen, head_major=True)[1:]]
    for bad in (odd, mixed):
        assert model.decode_stack.run(hidden[:2], positions, bad, meta, model.cos_sin_cache) is None
    # a plan whose many-rows path is oneDNN: a decode batch of that many rows is oneDNN's, so the Python forward's
    rows = cpu_linear.MANY_ROWS
    model = _model(tiny_llama_dir, dtype, cpu_linear.LinearPlan("panel", "onednn", False))
    wide = AttentionMetadata(slot_mapping=torch.full((rows,), -1), block_tables=torch.zeros(rows, 1, dtype=torch.int32),
                             query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
                             context_lens=torch.ones(rows, dtype=torch.int32))
    hidden = torch.randn(rows, model.arch.hidden_size, generator=gen)
    assert model.decode_stack.run(hidden, torch.zeros(rows, dtype=torch.long), caches, wide, model.cos_sin_cache) is None
    assert model.decode_stack.run(hidden[:8], positions[:1].repeat(8), caches, AttentionMetadata(
        slot_mapping=torch.full((8,), -1), block_tables=wide.block_tables[:8], query_start_loc=wide.query_start_loc[:9],
        context_lens=wide.context_lens[:8]), model.cos_sin_cache) is not None
