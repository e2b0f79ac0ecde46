"""Clear ValueErrors that name the file, tensor or field at fault; nothing is silently random-initialised."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from saguaro_dist.model import ModelRunner, check_pair_vocab, load_config, load_tokenizer


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    """A private copy of the tiny Llama checkpoint that a test may break."""
    return shutil.copytree(tiny_checkpoint("llama"), tmp_path / "ckpt")


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        ModelRunner(ckpt)


def test_missing_tensor_is_named(ckpt):
    weights = load_file(ckpt / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        ModelRunner(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        ModelRunner(ckpt)


def test_shape_mismatch_names_tensor_and_shapes(ckpt):
    edit_config(ckpt, intermediate_size=48)
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight.*shape \(\d+, \d+\) in the checkpoint.*expects"):
        ModelRunner(ckpt)


@pytest.mark.parametrize("changes, pattern", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}}, "rope_type 'dynamic'"),
    ({"hidden_size": None}, "hidden_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_or_missing_config(ckpt, changes, pattern):
    edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=pattern):
        ModelRunner(ckpt)


def test_old_style_rope_fields_are_read(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    edit_config(ckpt, rope_parameters=None, rope_theta=rope["rope_theta"],
                rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16})
    assert load_config(ckpt).rope["rope_type"] == "llama3"


@pytest.mark.parametrize("kind, window_fields", [("mistral", {}),
                                                  ("qwen2", {"use_sliding_window": True, "layer_types": None})])
def test_a_sliding_window_shorter_than_the_context_no_longer_bounds_it(tiny_checkpoint, tmp_path, kind, window_fields):
    """Sliding layers attend over their window (tests/test_sliding_window.py), so the context runs on to
    max_position_embeddings; Qwen's window only when used, on the layers from max_window_layers on."""
    ckpt = shutil.copytree(tiny_checkpoint(kind), tmp_path / kind)
    edit_config(ckpt, sliding_window=32, max_window_layers=1, **window_fields)
    runner = ModelRunner(ckpt)
    assert runner.max_model_len == 256
    assert runner.config.layer_windows == ((32, 32) if kind == "mistral" else (None, 32))
    with pytest.raises(ValueError, match="max_model_len must be in 1..256 .config.json max_position_embeddings"):
        ModelRunner(ckpt, max_model_len=257)
    edit_config(ckpt, sliding_window=None, use_sliding_window=False)
    assert ModelRunner(ckpt).config.layer_windows == ()


def test_not_a_directory_nor_an_id(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        ModelRunner(tmp_path / "nowhere")


def test_vocab_sizes_may_differ_only_with_one_tokenizer_to_show_it_is_padding():
    check_pair_vocab(64, 64, None, None)
    with pytest.raises(ValueError, match="vocab mismatch.*64.*65.*without both tokenizers"):
        check_pair_vocab(64, 65, None, None)


def test_bad_calls(tiny_checkpoint):
    runner = ModelRunner(tiny_checkpoint("llama"), max_model_len=8)
    with pytest.raises(ValueError, match="unknown sequence"):
        runner.extend(["nope"], [[1]], [1])
    runner.add(0)
    with pytest.raises(ValueError, match="already exists"):
        runner.add(0)
    with pytest.raises(ValueError, match="token ids"):
        runner.extend([0], [[64]], [1])
    with pytest.raises(ValueError, match="num_logits"):
        runner.extend([0], [[1, 2]], [3])
    with pytest.raises(ValueError, match="max_model_len"):
        runner.extend([0], [list(range(9))], [1])
    runner.extend([0], [[1, 2, 3]], [1])
    with pytest.raises(ValueError, match="truncate"):
        runner.truncate(0, 4)
    with pytest.raises(ValueError, match="prefix_len"):
        runner.branch_start([0], [4], [1])
    state, _ = runner.branch_start([0], [3], [1])
    with pytest.raises(ValueError, match="2 tokens for 1 branches"):
        runner.branch_step(state, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="max_model_len must be"):
        ModelRunner(tiny_checkpoint("llama"), max_model_len=10_000)


def test_checkpoint_without_tokenizer_loads_as_model(tiny_checkpoint):
    assert load_tokenizer(tiny_checkpoint("llama")) is None
    assert ModelRunner(tiny_checkpoint("llama")).vocab_size == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_gpu_this_process_cannot_see_is_a_clear_error(ckpt, device):
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        ModelRunner(ckpt, device=device)
