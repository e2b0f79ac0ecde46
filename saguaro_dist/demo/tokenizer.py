"""Byte-level BPE tokenizer for Python source, saved as a transformers PreTrainedTokenizerFast."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE (lossless: every byte, every space of indentation round-trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    # Every training file starts with BOS, so a prompt encoded with special tokens does too.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def wrap_fast(tok, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   clean_up_tokenization_spaces=False, model_max_length=model_max_length)


def encode_files(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each file as BOS + text + EOS (EOS separates files in the training stream)."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    return [[bos, *enc.ids, eos] for enc in encodings]


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
