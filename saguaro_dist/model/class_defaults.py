"""The fields a config.json omits, filled in as transformers' config class for its model_type fills them: what
transformers' from_pretrained computes with, and vLLM too (it reads the same classes). MixtralConfig's
rms_norm_eps 1e-5 and rope_theta 1e6, Mistral's 8 key/value heads, Qwen3's head_dim 128, ... all come from there,
so no hand table has to follow each class."""
from __future__ import annotations

import contextlib
import copy
import logging

from saguaro_dist.model.rope_checks import is_number

log = logging.getLogger(__name__)
# Kept as config.json gives them: the sizes (a checkpoint of the class's default sizes is no real one: a missing
# size is refused by name, not met as a shape mismatch), the token ids (stopping, not logits: they come from the
# tokenizer and generation config as before), the rope fields (rope_checks.py reads them; only rope_theta is
# filled, below) and the file's own bookkeeping.
_NOT_FILLED = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters", "rope_scaling",
                         "rope_theta", "architectures", "transformers_version", "_name_or_path", "model_type"})
# The class's top level is not the language model (gemma3_config.gemma3_text_view reads its text_config)
_NESTED_TYPES = ("gemma3",)


def class_defaults_view(hf: dict) -> dict:
    """config.json with each field it omits at the value transformers' config class gives it (derived ones, such
    as head_dim from hidden_size, from this file's values); config.json as it is when transformers has no class
    for its model_type or the class refuses the file (then the checks here speak)."""
    parsed = _parsed(hf)
    if parsed is None:
        return hf
    filled = {k: v for k, v in parsed.to_dict().items() if k not in hf and k not in _NOT_FILLED and v is not None}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = _class_theta(parsed)
    if theta is not None and hf.get("rope_theta") is None and isinstance(rope, dict) and rope.get("rope_theta") is None:
        filled["rope_theta"] = theta  # the class's default_theta (transformers 5) or rope_theta (4.x)
    return {**filled, **hf}


def _parsed(hf: dict):
    """transformers' config object for config.json, or None."""
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type in _NESTED_TYPES:
        return None
    try:
        from transformers import CONFIG_MAPPING
        config_class = CONFIG_MAPPING[model_type]
    except (ImportError, KeyError):  # an older transformers without this family: config.json as it is
        return None
    try:
        with _transformers_quiet():  # its warnings are its from_pretrained's; the checks here refuse what matters
            return config_class.from_dict(copy.deepcopy(hf))  # it edits nested dicts (rope) in place
    except Exception as err:  # noqa: BLE001 - any refusal by the class: the fields stay as config.json gives them
        log.debug("transformers' %s refused config.json (%s); omitted fields take this runtime's defaults",
                  config_class.__name__, err)
        return None


def _class_theta(parsed) -> float | None:
    rope = getattr(parsed, "rope_parameters", None)
    if isinstance(rope, dict) and is_number(rope.get("rope_theta")):
        return float(rope["rope_theta"])
    theta = getattr(parsed, "rope_theta", None)
    return float(theta) if is_number(theta) else None


@contextlib.contextmanager
def _transformers_quiet():
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
