"""The chat-completions request as OpenAI defines it, validated strictly (pydantic), and what this server
cannot honour refused by name: a field this server does not act on (tools, response formats,
logit biases, ...) is a 400 naming it, never ignored. Everything a request holds is checked here, before
its answer starts: a streamed request refused later would already have its 200."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..decode.sampling import MAX_TOP_N, SamplingParams, sampling_params
from ..errors import GlanceError, InputError
from ..prompt.prompt_builder import check_unicode
from .openai_errors import RequestError

PART_TYPES = ("text", "image_url")  # the content parts a Qwen-VL prompt is made of
MAX_CHOICES = 16  # answers one request may ask for (`n`): each is a decode of its own


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted and ignored: the model's processor sizes images


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_N)
    seed: int | None = None
    user: str | None = None

    def refuse_sampling(self) -> None:
        """What this server does not serve is a 400, never ignored: penalties, and top_logprobs without logprobs
        (temperature, top_p, seed, n and log-probs are served: `sampling`, `choices`, `reported`)."""
        asked = [f"{name}={value}" for name, value, neutral in (
            ("presence_penalty", self.presence_penalty, 0), ("frequency_penalty", self.frequency_penalty, 0))
            if value is not None and value != neutral]
        if asked:
            raise RequestError(f"{', '.join(asked)} is not served here: this server answers without penalties (it "
                               "samples with temperature, top_p and seed, the same tokens with the draft on or off); "
                               "omit it", param=asked[0].split("=")[0], code="sampling_unsupported")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError(f"top_logprobs={self.top_logprobs} needs logprobs true; send logprobs: true with it, or "
                               "omit top_logprobs", param="top_logprobs", code="invalid_request")
        if self.choices > MAX_CHOICES:
            raise RequestError(f"n={self.n} is over this server's {MAX_CHOICES} answers a request; ask for fewer",
                               param="n", code="sampling_unsupported")

    @property
    def reported(self) -> int | None:
        """Alternatives each answered token reports (`logprobs` true: `top_logprobs` or 0), or None (no log-probs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def choices(self) -> int:
        """Answers asked for (`n`): answer i samples with the request's seed + i (a drawn one where none was sent)."""
        return self.n or 1

    def sampling(self) -> SamplingParams:
        """The request's temperature, top_p and seed (absent: greedy, top_p 1, a drawn seed)."""
        try:
            return sampling_params(self.temperature or 0.0, 1.0 if self.top_p is None else self.top_p, 0, 0.0,
                                   self.seed)
        except InputError as exc:
            name = str(exc).split(" ", 1)[0]
            raise RequestError(str(exc), param=name, code="invalid_sampling") from None

    def check_text(self) -> None:
        """Stop strings and message text are real text (no lone surrogate, no empty stop string), refused with
        the field at fault."""
        for i, stop in enumerate(self.stops):
            where = "stop" if isinstance(self.stop, str) else f"stop.{i}"
            if not stop:
                raise RequestError(f"{where} is an empty string, which would end every answer before it starts; "
                                   "drop it or pass text", param=where, code="invalid_stop")
            _text(stop, where, "invalid_stop")
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                _text(m.content, f"messages.{i}.content", "invalid_prompt")
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if isinstance(part, TextPart):
                    _text(part.text, f"messages.{i}.content.{j}.text", "invalid_prompt")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _text(text: str, where: str, code: str) -> None:
    try:
        check_unicode(text, where)
    except GlanceError as exc:
        raise RequestError(str(exc), param=where, code=code) from None


def _branch(label: object) -> bool:
    """A union branch pydantic names in an error's location (`str`, `list[...]`): no field of the request."""
    return isinstance(label, str) and (label == "str" or label.startswith(("list[", "tagged-union[")))


def _first(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error that describes the value sent: a list of parts sent as content fails as a string too, but it
    is the list's error that names what is wrong."""
    mismatch = [e for e in errors if e["loc"] and _branch(e["loc"][-1]) and e["type"].endswith("_type")]
    return next((e for e in errors if e not in mismatch), errors[0])


def _where(loc: tuple) -> str:
    """An error's location as the client wrote it: pydantic's union branches and the part type it picked
    (`content.list[tagged-union[...]].0.image_url.image_url`) left out."""
    out, tag_next = [], False
    for p in loc:
        if _branch(p):
            tag_next = "tagged-union[" in p
        elif tag_next and isinstance(p, str):
            tag_next = False
        else:
            out.append(str(p))
    return ".".join(out) or "body"


def parse_request(raw: Any) -> ChatRequest:
    """The validated request, or a 400 naming the first field at fault."""
    try:
        req = ChatRequest.model_validate(raw)
    except ValidationError as exc:
        first = _first(exc.errors())
        where = _where(first["loc"])
        if first["type"] == "union_tag_invalid":
            tag, types = first.get("ctx", {}).get("tag"), " and ".join(map(repr, PART_TYPES))
            raise RequestError(f"{where}: a content part of type {tag!r} is not supported by this server, which "
                               f"reads {types} parts; send the message as those", param=where,
                               code="unsupported_content_part") from None
        if first["type"] == "union_tag_not_found":
            raise RequestError(f"{where}: a content part needs its \"type\" ({' or '.join(map(repr, PART_TYPES))}); "
                               "add it", param=where, code="invalid_request") from None
        if first["type"] == "extra_forbidden":
            raise RequestError(f"{where} is not supported by this server, which answers text chat with lossless "
                               f"decoding (no tools, functions, logit biases or response formats); "
                               f"omit {where}", param=where, code="unsupported_field") from None
        raise RequestError(f"{where}: {first['msg']}", param=where, code="invalid_request") from None
    req.check_text()
    return req
