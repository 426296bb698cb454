"""What the server accepts: strict request bodies, the OpenAI options it refuses, OpenAI-shaped errors.

Every body is parsed here, off the event loop (``parse_request``): JSON only (other content
types get 415), one JSON object, then a pydantic model in strict mode, so ``true`` is not an
integer, ``"10"`` is not a number and ``"yes"`` is not a boolean. Unknown fields are refused by
name; OpenAI options this server does not implement (``logprobs``, ``n > 1``, ``tools``, ...) are
refused by name unless sent with their neutral value (``"logprobs": false``, ``"n": 1``), which
changes nothing. An error quotes at most a short excerpt of what was sent.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from gemma_nb.generation import SEED_MAX, SEED_MIN

MAX_STOP_SEQUENCES = 4
EXCERPT_CHARS = 40
# Only ids a tokenizer could produce; the route checks them against the model's vocabulary.
TOKEN_ID_MAX = 2**31 - 1


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters: errors never echo a whole request back."""
    if isinstance(value, (str, bytes, list, dict)) and len(value) > 4 * limit:
        value = value[: 4 * limit] if not isinstance(value, dict) else dict(list(value.items())[:4])
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --------------------------------------------------------------------------------------------
# The request bodies


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"character {error.start} is a lone surrogate ({text[error.start]!r}), which is not "
                         "valid Unicode; send UTF-8 text") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]


def _check_stop(stop: str | list[str] | None) -> str | list[str] | None:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise ValueError(f"{len(stops)} stop sequences; give up to {MAX_STOP_SEQUENCES} non-empty strings")
    return stop


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=TOKEN_ID_MAX, description="0 or -1: no top-k")
    stop: Annotated[Text | list[Text] | None, AfterValidator(_check_stop)] = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False


class _OpenAIRequest(_Sampling):
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # OpenAI's end-user id for abuse monitoring: accepted, changes nothing


class TextPart(_Strict):
    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text":
            raise ValueError(f"a content part of type {excerpt(data.get('type'))} is not supported; send text parts only")
        return data


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart] | None


class ChatRequest(_OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_OpenAIRequest):
    prompt: Text | list[TokenId] | list[Text]


class GenerateRequest(_Sampling):
    prompt: Text
    temperature: float = Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False)


# OpenAI options this server does not implement, with the values that ask for nothing (accepted
# and dropped). Anything else for them is a 400 naming the option.
UNSUPPORTED_OPTIONS: dict[str, tuple] = {
    "n": (1,), "best_of": (1,), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "suffix": (),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},), "modalities": (["text"],),
    "audio": (), "prediction": (), "web_search_options": (), "reasoning_effort": (), "store": (False,),
    "metadata": (), "service_tier": ("auto", "default"),
}


def _is_neutral(value: Any, neutral: tuple) -> bool:
    return value is None or any(type(value) is type(n) and value == n for n in neutral)


def _drop_unsupported(data: dict) -> dict:
    for name, neutral in UNSUPPORTED_OPTIONS.items():
        if name in data:
            if not _is_neutral(data[name], neutral):
                raise APIError(400, f"'{name}' = {excerpt(data[name])} is not supported by this server; leave it out"
                               + (f" or send {excerpt(neutral[0])}" if neutral else ""), param=name,
                               code="unsupported_parameter")
            data = {k: v for k, v in data.items() if k != name}
    return data


_FIELD_NAMES = frozenset(name for model in (ChatRequest, CompletionRequest, GenerateRequest, Message, TextPart,
                                            StreamOptions) for name in model.model_fields)


def _param(loc: tuple) -> str | None:
    """``("messages", 0, "content", "str")`` -> ``"messages.0.content"``: drop pydantic's union tags."""
    return ".".join(str(p) for p in loc if isinstance(p, int) or p in _FIELD_NAMES) or None


def validation_error(error: ValidationError, model: type[BaseModel]) -> APIError:
    """The most specific problem pydantic found, as a 400 naming the field.

    Of a union's alternatives (a prompt as text or as token ids) the one that got furthest into
    the value is the one the client meant: ``[-1]`` is a bad token id, not a bad string.
    """
    problems = error.errors(include_url=False)
    first = max(problems, key=lambda p: len(p["loc"]))  # max keeps the first of equals
    param, kind = _param(first["loc"]), first["type"]
    if kind == "missing":
        return APIError(400, f"'{param}' is required", param=param, code="missing_parameter")
    if kind == "extra_forbidden":
        param = ".".join(str(p) for p in first["loc"])
        known = ", ".join(sorted(model.model_fields)) if "." not in (param or "") else ""
        return APIError(400, f"unknown field '{param}'" + (f"; this endpoint takes {known}" if known else ""),
                        param=param, code="unknown_parameter")
    message = first["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param or 'body'}: {message} (got {excerpt(first.get('input'))})", param=param,
                    code="invalid_value")


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_request(raw: bytes, content_type: str | None, model: type[BaseModel]) -> BaseModel:
    """The request body ``raw`` as ``model``, or an ``APIError`` (400 / 415) saying what is wrong.

    CPU work (JSON parsing of up to the body limit): call it on a worker thread.
    """
    if content_type:
        media = content_type.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"Content-Type {excerpt(media)} is not supported; send the body as JSON with "
                           "'Content-Type: application/json'", code="unsupported_media_type")
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as error:  # JSONDecodeError, bad UTF-8, NaN, an integer of over 4300 digits
        raise APIError(400, f"request body is not valid JSON: {str(error)[:120]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_body")
    try:
        return model.model_validate(_drop_unsupported(data))
    except ValidationError as error:
        raise validation_error(error, model) from None
