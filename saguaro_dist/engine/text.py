"""Text into token ids: the one way the server and LLM.generate tokenize, so HTTP and in-process outputs agree."""
from __future__ import annotations


def encode_text(tokenizer, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
    """Token ids of text; a ValueError naming `param` where the text is not Unicode."""
    _check_unicode(text, param)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _check_unicode(text: str, param: str) -> None:
    """A clear error for text that is no Unicode: half a surrogate pair, from a JSON escape ("\\ud800") or from
    bytes that were not UTF-8 (stdin read with surrogateescape), which tokenizers refuse with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{param} is not valid Unicode text: it holds a lone surrogate {text[err.start]!r} (an "
                         "unpaired \\ud800-\\udfff escape, or bytes that were not UTF-8)") from None
