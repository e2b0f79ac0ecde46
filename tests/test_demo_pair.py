"""The shipped demo pair: loads with transformers, shares a lossless tokenizer, generates."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from saguaro_dist.demo import PAIR_DIR, demo_pair, demo_prompts

SNIPPET = 'class Point:\n    """A 2-D point."""\n\n    def norm(self) -> float:\n\t\treturn (self.x ** 2 + self.y ** 2) ** 0.5  # café\n\n\n'


@pytest.fixture(scope="module")
def pair():
    target_dir, draft_dir = demo_pair()
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    return load(target_dir), load(draft_dir), AutoTokenizer.from_pretrained(target_dir)


def test_pair_is_llama_and_draft_is_about_10x_smaller(pair):
    target, draft, _ = pair
    assert target.config.model_type == draft.config.model_type == "llama"
    size = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert 6 <= size(target) / size(draft) <= 16


def test_tokenizer_round_trips_python_exactly(pair):
    _, _, tok = pair
    ids = tok(SNIPPET)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == SNIPPET
    assert tok.eos_token_id is not None and tok.pad_token_id is not None


def test_target_and_draft_share_the_vocab(pair):
    target, draft, _ = pair
    target_dir, draft_dir = map(Path, demo_pair())
    assert target.config.vocab_size == draft.config.vocab_size
    assert (target_dir / "tokenizer.json").read_bytes() == (draft_dir / "tokenizer.json").read_bytes()


def test_shipped_files_fit_the_size_budget():
    total = sum(p.stat().st_size for p in PAIR_DIR.rglob("*") if p.is_file())
    assert total <= 24 * 2**20
    for role in ("target", "draft"):
        config = json.loads((PAIR_DIR / role / "config.json").read_text())
        assert config["dtype"] in ("float16", "bfloat16")


def test_greedy_generation_continues_a_prompt(pair):
    target, _, tok = pair
    ids = tok(demo_prompts(1)[0], return_tensors="pt")["input_ids"][:, -128:]
    out = target.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def test_demo_prompts_are_deterministic_and_checked():
    assert demo_prompts(5) == demo_prompts(5)
    assert len(demo_prompts(20)) == 20 and all(p.strip() for p in demo_prompts(20))
    with pytest.raises(ValueError):
        demo_prompts(10**6)
