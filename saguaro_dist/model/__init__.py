"""Model runtime: a plain-PyTorch Llama / Mistral / Qwen2 / Qwen3 / Granite / OLMo 2 / Gemma 3 / Mixtral / Qwen3-MoE
decoder, HF checkpoint loading, per-sequence KV state with batched extend and shared-prefix branch decode, and tensor parallelism
over torch.distributed."""
from saguaro_dist.model.branch import BranchState
from saguaro_dist.model.device import set_torch_threads
from saguaro_dist.model.hf_config import ModelConfig, load_config
from saguaro_dist.model.loader import load_tokenizer, resolve_model_dir
from saguaro_dist.model.runner import ModelRunner
from saguaro_dist.model.vocab import check_pair_vocab

__all__ = ["ModelRunner", "BranchState", "ModelConfig", "load_config", "load_tokenizer", "resolve_model_dir",
           "check_pair_vocab", "set_torch_threads"]
