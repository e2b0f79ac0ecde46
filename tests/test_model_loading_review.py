"""Loading checkpoints as users bring them: Hub ids the offline cache lacks, tensors config.json has no
place for, PyTorch-pickle (.bin) checkpoints, and repositories that hold the weights twice. Real tiny
checkpoints written by transformers; the Hub is read from a real cache folder, offline."""
from __future__ import annotations

import json
import shutil

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from conftest import write_checkpoint
from saguaro_dist import LLM
from saguaro_dist.config import Config
from saguaro_dist.engine.build import fit_draft
from saguaro_dist.model import ModelRunner, load_tokenizer
from saguaro_dist.model.loader import resolve_model_dir

PROMPT = [5, 9, 2, 7, 11, 3]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def runner_logits(path, **kwargs) -> torch.Tensor:
    runner = ModelRunner(path, **kwargs)
    runner.add(0)
    return runner.extend([0], [PROMPT], [len(PROMPT)])[0]


def hf_logits(path) -> torch.Tensor:
    with torch.no_grad():
        return LlamaForCausalLM.from_pretrained(path).eval()(torch.tensor([PROMPT])).logits[0].float()


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setattr(huggingface_hub.constants, name, value)
        monkeypatch.setenv(name, str(int(value)) if value is True else value)
    return cache


def cache_snapshot(cache, repo_id: str, files) -> None:
    """`files` as the main branch's snapshot, laid out as huggingface_hub writes its cache."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    (folder / "snapshots" / COMMIT).mkdir(parents=True)
    for f in files:
        shutil.copy(f, folder / "snapshots" / COMMIT / f.name)


# -- Hub ids that cannot be fetched ------------------------------------------------------------------
@pytest.mark.parametrize("load", [lambda: ModelRunner("nobody-org/absent-model"),
                                  lambda: load_tokenizer("nobody-org/absent-model"),
                                  lambda: LLM(model="nobody-org/absent-model", mode="ar")])
def test_a_hub_id_the_offline_cache_lacks_is_named_with_HF_HUB_OFFLINE(offline_cache, load):
    with pytest.raises(ValueError, match="model 'nobody-org/absent-model' is not a local folder, and the Hugging "
                                         "Face Hub could not provide it .*HF_HUB_OFFLINE is set") as err:
        load()
    assert err.value.__cause__ is None and err.value.__suppress_context__  # one message, not the client's stack


def test_a_revision_the_offline_cache_lacks_is_named(offline_cache, tmp_path):
    cache_snapshot(offline_cache, "tiny-org/llama", write_checkpoint("llama", tmp_path / "ck").iterdir())
    assert ModelRunner("tiny-org/llama").config.vocab_size == 64  # main is cached
    with pytest.raises(ValueError, match="'tiny-org/llama' at revision 'v2'.*HF_HUB_OFFLINE"):
        ModelRunner("tiny-org/llama", revision="v2")


# -- every tensor must fill a parameter --------------------------------------------------------------
def add_tensor(ckpt, name: str, tensor: torch.Tensor) -> None:
    weights = load_file(ckpt / "model.safetensors")
    weights[name] = tensor
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})


def test_attention_biases_config_json_omits_are_refused_not_dropped(tmp_path):
    """transformers' config would build biases only with attention_bias: a checkpoint that has them under
    a config without it computed another model, silently."""
    ckpt = write_checkpoint("llama", tmp_path / "ck")
    add_tensor(ckpt, "model.layers.0.self_attn.q_proj.bias", torch.randn(32))
    with pytest.raises(ValueError, match=r"no place for: model\.layers\.0\.self_attn\.q_proj\.bias.*attention_bias"):
        ModelRunner(ckpt)


def test_layers_beyond_num_hidden_layers_are_refused(tmp_path):
    ckpt = write_checkpoint("llama", tmp_path / "ck")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"no place for: model\.layers\.1\."):
        ModelRunner(ckpt)


def test_a_tied_head_stored_anyway_and_old_rotary_buffers_still_load(tmp_path):
    """What transformers ignores too: lm_head.weight beside tie_word_embeddings, and inv_freq buffers."""
    ckpt = write_checkpoint("tied", tmp_path / "ck")
    want = hf_logits(ckpt)
    embed = load_file(ckpt / "model.safetensors")["model.embed_tokens.weight"]
    add_tensor(ckpt, "lm_head.weight", embed.clone())
    add_tensor(ckpt, "model.layers.0.self_attn.rotary_emb.inv_freq", torch.randn(4))
    torch.testing.assert_close(runner_logits(ckpt), want, atol=1e-4, rtol=1e-4)


# -- PyTorch-pickle checkpoints ----------------------------------------------------------------------
def to_bin(ckpt, shards: int) -> None:
    """Replace model.safetensors by pytorch_model.bin (one shard) or `shards` files and their index."""
    weights = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    if shards == 1:
        torch.save(weights, ckpt / "pytorch_model.bin")
        return
    names, weight_map = sorted(weights), {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: weights[n] for n in names[i::shards]}
        torch.save(part, ckpt / file)
        weight_map.update(dict.fromkeys(part, file))
    (ckpt / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_a_bin_only_checkpoint_loads_and_computes_what_transformers_does(tmp_path, shards):
    ckpt = write_checkpoint("llama", tmp_path / "ck")
    want = hf_logits(ckpt)
    to_bin(ckpt, shards)
    torch.testing.assert_close(runner_logits(ckpt), want, atol=1e-4, rtol=1e-4)


def test_a_bin_that_is_not_a_plain_state_dict_is_refused(tmp_path):
    ckpt = write_checkpoint("llama", tmp_path / "ck")
    (ckpt / "model.safetensors").unlink()
    torch.save({"model": object()}, ckpt / "pytorch_model.bin")  # needs code to unpickle: weights_only refuses
    with pytest.raises(ValueError, match="not a plain state dict"):
        ModelRunner(ckpt)


def test_a_bin_only_hub_id_loads_from_the_cache(offline_cache, tmp_path):
    ckpt = write_checkpoint("llama", tmp_path / "ck")
    want = hf_logits(ckpt)
    to_bin(ckpt, 1)
    cache_snapshot(offline_cache, "tiny-org/bin-only", ckpt.iterdir())
    torch.testing.assert_close(runner_logits("tiny-org/bin-only"), want, atol=1e-4, rtol=1e-4)


def test_an_index_names_the_weight_files_fetched(offline_cache, tmp_path, monkeypatch):
    """Mistral's repos hold the shards, their index and consolidated.safetensors (the same weights again):
    only what the index names is fetched."""
    ckpt = write_checkpoint("sharded", tmp_path / "ck")
    (ckpt / "consolidated.safetensors").write_bytes(b"not fetched")
    cache_snapshot(offline_cache, "tiny-org/sharded", ckpt.iterdir())
    from huggingface_hub import snapshot_download
    asked = []

    def recording(*args, **kwargs):
        asked.append(kwargs["allow_patterns"])
        return snapshot_download(*args, **kwargs)
    monkeypatch.setattr("huggingface_hub.snapshot_download", recording)
    resolve_model_dir("tiny-org/sharded")
    fetched = [p for patterns in asked for p in patterns if "safetensors" in p and not p.endswith(".json")]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert sorted(fetched) == sorted(set(index["weight_map"].values()))


# -- dtype -----------------------------------------------------------------------------------------
def test_float16_on_the_cpu_runs_but_warns_that_bfloat16_is_far_faster(tiny_checkpoint, caplog):
    want = hf_logits(tiny_checkpoint("llama"))
    with caplog.at_level("WARNING", logger="saguaro_dist.model.runner_args"):
        got = runner_logits(tiny_checkpoint("llama"), dtype=torch.float16)
    assert "float16 on the CPU" in caplog.text and "bfloat16" in caplog.text
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    caplog.clear()
    runner_logits(tiny_checkpoint("llama"), dtype=torch.bfloat16)
    assert "float16 on the CPU" not in caplog.text


# -- what config.json says ---------------------------------------------------------------------------
def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path):
    """FP8 weights were cast without their scales: another model, silently."""
    ckpt = write_checkpoint("llama", tmp_path / "ck")
    cfg = json.loads((ckpt / "config.json").read_text())
    quant = {"quant_method": "fp8", "activation_scheme": "static"}
    (ckpt / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ValueError, match="quantization_config \\(quant_method 'fp8'\\).*not supported"):
        ModelRunner(ckpt)


def test_a_max_model_len_beyond_the_target_fails_the_pair_check(tiny_llama_pair):
    """fit_draft is the check a driver makes before Ray starts any actor: it was left to the target's
    ranks, after the draft actors had loaded."""
    target, draft = map(str, tiny_llama_pair)
    config = Config(model=target, draft=draft, mode="sd", max_model_len=1000)
    with pytest.raises(ValueError, match="max_model_len must be in 1..256"):
        fit_draft(config, None)
    assert fit_draft(Config(model=target, draft=draft, mode="sd", max_model_len=200), None).max_model_len == 200
