"""Real tokenizers built offline with the `tokenizers` library (no downloads), wrapped in transformers'
PreTrainedTokenizerFast: a byte-level BPE (GPT-2 / Llama-3 style) and a SentencePiece-like BPE with byte
fallback (Llama-2 style: Metaspace, `<0xE2>` byte tokens), each with added special tokens."""
from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# ASCII prose and code only: CJK and emoji are left out, so they tokenize into byte pieces
CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # plain code\n",
    "Stop here. END of the text; the end is near, isn't it? STOP!",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2013 ascii and a few accents, said the user to the assistant.",
] * 20
BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
SPM_ADDED = ["<tool_call>", "</tool_call>"]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 / Llama-3 style: every byte a token (its ByteLevel alphabet), merges learned on CORPUS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=BYTE_LEVEL_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   additional_special_tokens=BYTE_LEVEL_SPECIALS[1:], clean_up_tokenization_spaces=False)


def sentencepiece_bpe() -> PreTrainedTokenizerFast:
    """Llama-2 style: Metaspace ("▁" for spaces, one prepended to the text), byte fallback to <0xNN>
    tokens for characters outside the vocabulary, and the decoder that strips the first leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPM_SPECIALS + byte_tokens, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=_bytes_in_vocab(tok), unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=SPM_ADDED, clean_up_tokenization_spaces=False)


def _bytes_in_vocab(tok: Tokenizer) -> Tokenizer:
    """The <0xNN> tokens as plain vocabulary entries, as in Llama-2's tokenizer: the trainer made them added
    (special) tokens, which skip_special_tokens would drop from the text."""
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPM_SPECIALS]
    return Tokenizer.from_str(json.dumps(spec))


def wordpiece() -> PreTrainedTokenizerFast:
    """BERT style, with its clean_up_tokenization_spaces (a whole decode rewrites " n't" as "n't")."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[SEP]",
                                   clean_up_tokenization_spaces=True)
