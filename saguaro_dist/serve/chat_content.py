"""A chat message's `content`: a string, or a list of parts told apart by their `type`.

The parts are a union pydantic picks by `type` (request_fields.tagged_union), so a bad part's 400 is that
part's own error with its path (`messages.1.content.0.image_url.url: Field required`), where a plain union
reported its first member's ("messages.1.content: Input should be a valid string"). Text parts are read as
vLLM reads them (its TEXT_PART_TYPES); OpenAI's image, audio and file parts are checked as OpenAI shapes them,
then refused by name (the model reads text only).
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from saguaro_dist.serve.request_fields import tagged_union

# Parts read as text, as vLLM reads them (its TEXT_PART_TYPES), each with the key that holds its text
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}


class _TextCarrier(BaseModel):
    """A part whose text is under a key of its own (TEXT_PART_KEYS): a missing one is "content.0.refusal: Field
    required in a part of type 'refusal'", which says why (a client sent refusal's text as `text`)."""

    @field_validator("text", "refusal", "thinking", mode="before", check_fields=False)
    @classmethod
    def _text_required(cls, value, info: ValidationInfo):
        if value is None:  # absent (the default) or null
            raise PydanticCustomError("missing", "Field required in a part of type '{kind}'",
                                      {"kind": info.data.get("type")})
        return value


def _required_text():
    return Field(None, validate_default=True)  # required: None is _text_required's "Field required"


class TextPart(_TextCarrier):
    """OpenAI's text part, and the Responses API's input_text and output_text (vLLM reads them as text)."""
    type: Literal["text", "input_text", "output_text"]
    text: str = _required_text()

    def value(self) -> str:
        return self.text


class RefusalPart(_TextCarrier):
    """An earlier assistant turn's refusal (OpenAI's), read as its text."""
    type: Literal["refusal"]
    refusal: str = _required_text()

    def value(self) -> str:
        return self.refusal


class ThinkingPart(_TextCarrier):
    """Anthropic-style thinking, read as its text (vLLM's)."""
    type: Literal["thinking"]
    thinking: str = _required_text()

    def value(self) -> str:
        return self.thinking


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(BaseModel):
    data: str  # base64
    format: str


class AudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FileData(BaseModel):
    file_data: str | None = None  # base64
    file_id: str | None = None
    filename: str | None = None


class FilePart(BaseModel):
    type: Literal["file"]
    file: FileData


MEDIA_PARTS = (ImagePart, AudioPart, FilePart)  # OpenAI's parts this server cannot read: refused after their checks
_PART_MODELS = {"text": TextPart, "input_text": TextPart, "output_text": TextPart, "refusal": RefusalPart,
                "thinking": ThinkingPart, "image_url": ImagePart, "input_audio": AudioPart, "file": FilePart}


class UntypedPart(BaseModel):
    """Where a part without a known `type` goes: its error is then "content.0.type: Input should be 'text', ..."
    (or "Field required"), OpenAI's "Invalid value ... Supported values are ..."."""
    type: Literal[tuple(_PART_MODELS)]  # type: ignore[valid-type]


def _part_tag(part) -> str | None:
    """The member for a part: by its type (tags are "part:<type>", never a request key: errors.py's field
    path drops them); a typed object of another or no type is UntypedPart's; anything else no part."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    if isinstance(kind, str) and kind in _PART_MODELS:
        return f"part:{kind}"
    return "part:untyped" if isinstance(part, (dict, BaseModel)) else None


ContentPart = tagged_union({**{f"part:{kind}": model for kind, model in _PART_MODELS.items()},
                            "part:untyped": UntypedPart}, _part_tag, "a content part (an object with a type)")
MessageContent = Optional[tagged_union(
    {"content:text": str, "content:parts": list[ContentPart]},
    lambda v: "content:text" if isinstance(v, str) else "content:parts" if isinstance(v, list) else None,
    "a string or a list of content parts")]


def refuse_media(content):
    """The model reads text only: a well-formed image, audio or file part is refused by name."""
    for i, part in enumerate(content if isinstance(content, list) else ()):
        if isinstance(part, MEDIA_PARTS):
            raise ValueError(f"part {i} is of type {part.type!r}: this server reads text parts only "
                             f"({', '.join(TEXT_PART_KEYS)})")
    return content
