"""The chat-completions request as OpenAI defines it, validated strictly (pydantic), and what greedy
decoding cannot honour refused by name: a field this server does not act on (tools, response formats,
logit biases, ...) is a 400 naming it, never ignored."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .openai_errors import RequestError


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto"] | None = None  # the image is read as sent: "low" and "high" would be ignored


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
    seed: int | None = None
    user: str | None = None

    def refuse_sampling(self) -> None:
        """The server decodes greedily and losslessly: any request for something else is a 400, never ignored."""
        asked = [f"{name}={value}" for name, value, neutral in (
            ("temperature", self.temperature, 0), ("top_p", self.top_p, 1), ("n", self.n, 1),
            ("presence_penalty", self.presence_penalty, 0), ("frequency_penalty", self.frequency_penalty, 0),
            ("logprobs", self.logprobs, False)) if value is not None and value != neutral]
        if asked:
            raise RequestError(f"{', '.join(asked)} asks for sampling, but this server decodes greedily and losslessly "
                               "(the target model's own greedy answer, token for token); omit it or send "
                               "temperature 0, top_p 1, n 1", param=asked[0].split("=")[0], code="sampling_unsupported")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse_request(raw: Any) -> ChatRequest:
    """The validated request, or a 400 naming the first field at fault."""
    try:
        return ChatRequest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise RequestError(f"{where} is not supported by this server, which answers text chat with greedy, "
                               f"lossless decoding (no tools, functions, logit biases, response formats or log-probs); "
                               f"omit {where}", param=where, code="unsupported_field") from None
        raise RequestError(f"{where}: {first['msg']}", param=where, code="invalid_request") from None
