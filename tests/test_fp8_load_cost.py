"""An FP8 checkpoint's load costs work linear in its tensors: the index is parsed once and each shard opened a
bounded number of times, however many float8 weights look up their scales (a scale read by a fresh read_tensor
each parsed the index twice and opened and scanned a shard: quadratic, minutes for a 30B MoE's ~20k weights).
Counted, not timed: the loader's json.loads and safe_open wrapped while a many-shard tiny checkpoint loads. And
read_tensor, which other loaders still call one name at a time, reads as it did."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from model_checks import check_logits, random_tokens
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from saguaro_dist.model import loader
from saguaro_dist.model.loader import read_tensor
from saguaro_dist.model.runner import ModelRunner

SHARDS = 6
FP8_MAX = 448.0


def tiny_llama(path, layers: int):
    torch.manual_seed(layers)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def write_fp8_shards(src, dst) -> dict:
    """src's projections float8 with one scale a weight named `_scale_inv` (quant_method fp8 without blocks tries
    `_scale` first), every tensor dealt round-robin over SHARDS shards (a scale mostly away from its weight);
    returns the dequantized state dict."""
    tensors, dequantized = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        dequantized[name] = tensors[name] = w
        if name.endswith("_proj.weight"):
            scale = w.abs().max() / FP8_MAX
            tensors[name], tensors[name + "_scale_inv"] = (w / scale).to(torch.float8_e4m3fn), scale
            dequantized[name] = tensors[name].float() * scale
    files = [f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors" for i in range(SHARDS)]
    weight_map = {name: files[i % SHARDS] for i, name in enumerate(tensors)}
    dst.mkdir()
    for file in files:
        save_file({n: t for n, t in tensors.items() if weight_map[n] == file}, dst / file, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return dequantized


def counting(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(args[0] if args else None)
        return fn(*args, **kwargs)
    return counted


def load_counting(path, monkeypatch) -> tuple[int, int]:
    """(index / config parses, shard opens) of the loader while path loads."""
    parses, opens = [], []
    monkeypatch.setattr(loader, "json", SimpleNamespace(loads=counting(json.loads, parses)))
    monkeypatch.setattr(loader, "safe_open", counting(safe_open, opens))
    ModelRunner(path)
    monkeypatch.undo()
    return len(parses), len(opens)


def test_index_parses_and_shard_opens_do_not_grow_with_the_weights(tmp_path, monkeypatch):
    costs = {}
    for layers in (1, 4):  # 7 float8 weights, then 28, over the same shards
        write_fp8_shards(tiny_llama(tmp_path / f"src{layers}", layers), tmp_path / f"fp8_{layers}")
        costs[layers] = load_counting(tmp_path / f"fp8_{layers}", monkeypatch)
    assert costs[1] == costs[4], costs
    parses, opens = costs[4]
    assert parses <= 3 and opens <= 2 * SHARDS, costs  # config, the index (twice at most); each shard twice at most


def test_the_many_shard_checkpoint_loads_the_dequantized_weights(tmp_path):
    src = tiny_llama(tmp_path / "src", 2)
    dequantized = write_fp8_shards(src, tmp_path / "fp8")
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "config.json").write_text((src / "config.json").read_text())
    save_file(dequantized, tmp_path / "ref" / "model.safetensors", metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    check_logits(tmp_path / "fp8", ref, random_tokens(2, 12, 64))


def _save(path, tensors: dict) -> None:
    save_file(tensors, path, metadata={"format": "pt"})


def test_read_tensor_reads_one_name_as_before(tmp_path):
    """By the index when there is one (a name it lacks, or its shard lacks, is None); without one, the first file
    holding the name; a 0-dim tensor whole; a pytorch_model.bin too."""
    a, b, scalar = torch.ones(2, 3), torch.zeros(4), torch.tensor(2.5)
    _save(tmp_path / "s1.safetensors", {"a": a, "x": scalar})
    _save(tmp_path / "s2.safetensors", {"b": b, "x": torch.tensor(9.0)})
    assert torch.equal(read_tensor(tmp_path, "a"), a) and torch.equal(read_tensor(tmp_path, "b"), b)
    assert torch.equal(read_tensor(tmp_path, "x"), scalar) and read_tensor(tmp_path, "nope") is None
    index = {"weight_map": {"a": "s1.safetensors", "x": "s2.safetensors", "gone": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(read_tensor(tmp_path, "x"), torch.tensor(9.0)) and torch.equal(read_tensor(tmp_path, "a"), a)
    assert read_tensor(tmp_path, "b") is None and read_tensor(tmp_path, "gone") is None
    (tmp_path / "bin").mkdir()
    torch.save({"w": a}, tmp_path / "bin" / "pytorch_model.bin")
    assert torch.equal(read_tensor(tmp_path / "bin", "w"), a) and read_tensor(tmp_path / "bin", "v") is None


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    _save(tmp_path / "s1.safetensors", {"a": torch.ones(1)})
    index = {"weight_map": {"a": "s1.safetensors", "b": "s9.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"names shard files that do not exist: \['s9.safetensors'\]"):
        read_tensor(tmp_path, "a")
