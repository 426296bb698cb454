"""What the server accepts and answers: strict pydantic bodies (unknown fields refused by name,
OpenAI options not implemented here only at their do-nothing value), and OpenAI's error body quoting
a short excerpt of what was sent."""

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, create_model
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException

# only ids a tokenizer could produce; the route checks them against the vocabulary
TOKEN_ID_MAX = 2**31 - 1


class APIError(HTTPException):
    """An error in OpenAI's body (``response()``), raised to the app's handler of HTTPException or
    answered directly."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(status, message, headers)
        self.type, self.param, self.code = type_, param, code

    def response(self) -> JSONResponse:
        error = {"message": self.detail, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status_code, headers=self.headers)


def excerpt(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: errors never echo a whole request back."""
    if isinstance(value, (str, bytes, list, dict)) and len(value) > 4 * limit:
        value = value[: 4 * limit] if not isinstance(value, dict) else dict(list(value.items())[:4])
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"character {error.start} is a lone surrogate ({text[error.start]!r}), which is not "
            "valid Unicode; send UTF-8 text"
        ) from None
    return text


# JSON has one number type: 2.0 is the integer 2, as JSON Schema says ("2" and true are not)
def _integral(value):
    return int(value) if type(value) is float and value.is_integer() else value


def _boolean(value):  # 0 is not false
    if not isinstance(value, bool):
        raise ValueError("Input should be a valid boolean")
    return value


def Int(**limits) -> Any:  # noqa: N802 (a type): an integer within ``limits`` (``ge``, ``le``), documented as such
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]


def Nullable(kind: type, default, **limits) -> Any:  # noqa: N802 (a type): null is the default, as in OpenAI's API
    return Annotated[
        kind | None, Field(**limits), AfterValidator(lambda v: default if v is None else v)
    ]


Text = Annotated[str, AfterValidator(_encodable)]
NonEmpty = Annotated[Text, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


TextFormat = create_model("TextFormat", __base__=_Strict, type=Literal["text"])
StreamOptions = create_model(
    "StreamOptions",
    __base__=_Strict,
    include_usage=(bool, False),
    continuous_usage_stats=(
        bool,
        Field(False, description="with include_usage: the usage so far on every chunk (vLLM's)"),
    ),
)
TextPart = create_model("TextPart", __base__=_Strict, type=Literal["text"], text=NonEmpty)
Message = create_model(
    "Message",
    __base__=_Strict,
    content=NonEmpty | Annotated[list[TextPart], Field(min_length=1)],
    role=(
        Literal["system", "developer", "user", "assistant"],
        Field(description="developer is read as system"),
    ),
    name=(Text | None, Field(None, description="accepted, not used")),
)


def _only(value) -> Any:  # a bare Literal[1] would take true, Literal[False] would take 0
    if type(value) in (int, float):
        return (
            Int(ge=value, le=value)
            if type(value) is int
            else Annotated[float, Field(ge=value, le=value)]
        )
    return (
        Annotated[Literal[value], BeforeValidator(_boolean)]
        if type(value) is bool
        else Literal[value]
    )


# OpenAI options not implemented here, each typed to accept only its do-nothing value (None: only
# null).
UNSUPPORTED: dict[str, Any] = {
    "n": _only(1),
    "best_of": _only(1),
    "logprobs": _only(False),
    "top_logprobs": _only(0),
    "echo": _only(False),
    "presence_penalty": _only(0.0),
    "frequency_penalty": _only(0.0),
    "logit_bias": Annotated[dict, Field(max_length=0)],
    "tools": Annotated[list, Field(max_length=0)],
    "functions": Annotated[list, Field(max_length=0)],
    "tool_choice": _only("none"),
    "function_call": _only("none"),
    "parallel_tool_calls": bool,
    "response_format": TextFormat,
    "modalities": list[Literal["text"]],
    "store": _only(False),
    "service_tier": Literal["auto", "default"],
    "suffix": None,
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "reasoning_effort": None,
    "metadata": None,
}
_Unsupported = create_model(
    "_Unsupported",
    __base__=_Strict,
    **{
        name: (
            None if kind is None else kind | None,
            Field(None, description="not supported: only its do-nothing value"),
        )
        for name, kind in UNSUPPORTED.items()
    },
)


class _Sampling(_Strict):
    model: Text | None = None
    max_tokens: Int(ge=1) | None = Field(None, description="default: the server's --max-tokens")
    temperature: Nullable(float, 1.0, ge=0, le=2, allow_inf_nan=False) = Field(
        1.0, description="0 is greedy"
    )
    top_p: Nullable(float, 1.0, gt=0, le=1, allow_inf_nan=False) = 1.0
    top_k: Nullable(Int(ge=-1, le=TOKEN_ID_MAX), 0) = Field(0, description="vLLM's; 0 or -1: none")
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=4)] | None = None
    seed: Int() | None = Field(
        None, description="any integer; its value modulo 2**64 seeds the sampler"
    )
    ignore_eos: Nullable(bool, False) = Field(
        False, description="vLLM's: generate past the end-of-sequence token, up to max_tokens"
    )


class _OpenAIRequest(_Sampling, _Unsupported):
    stream: Nullable(bool, False) = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, description="accepted, not used")


class ChatRequest(_OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int(ge=1) | None = Field(
        None, description="OpenAI's newer name of max_tokens"
    )


def _prompt(*checks, **token_id) -> Any:  # text, token ids, or one text in a list
    token_ids = Annotated[
        list[Int(ge=0, le=TOKEN_ID_MAX, **token_id)], Field(min_length=1), *checks
    ]
    return NonEmpty | token_ids | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]


class CompletionRequest(_OpenAIRequest):
    prompt: _prompt()


class GenerateRequest(_Sampling):
    prompt: NonEmpty
    temperature: Nullable(float, 0.0, ge=0, le=2, allow_inf_nan=False) = Field(
        0.0, description="0 (the default) is greedy"
    )


def served(model: type[BaseModel], cap: int, engine) -> type[BaseModel]:
    """``model`` as one server takes it: ``max_tokens`` up to ``cap``, token ids up to
    ``engine.max_prompt_tokens`` of them, documented up to ``engine.vocab_size``."""
    fields = {
        name: (
            Int(ge=1, le=cap) | None,
            Field(None, description=f"default: the server's --max-tokens; at most {cap}"),
        )
        for name in ("max_tokens", "max_completion_tokens")
        if name in model.model_fields
    }
    if model is CompletionRequest:

        def bound(json_schema: dict) -> None:
            if engine.vocab_size:
                json_schema["maximum"] = engine.vocab_size - 1

        def short_enough(ids):  # before each id is read: a long list costs the server nothing
            most = engine.max_prompt_tokens
            if isinstance(ids, list) and most is not None and len(ids) > most:
                raise PydanticCustomError(
                    "context_length_exceeded",
                    "{count} token ids; a prompt holds at most {most}: shorten it",
                    {"count": len(ids), "most": most},
                )
            return ids

        fields["prompt"] = (_prompt(BeforeValidator(short_enough), json_schema_extra=bound), ...)
    return create_model(model.__name__, __base__=model, **fields)


# The responses, as /openapi.json documents them.
Reason = Literal["stop", "length"] | None
ErrorDetail = create_model("ErrorDetail", message=str, type=str, param=str | None, code=str | None)
ErrorBody = create_model("ErrorBody", error=ErrorDetail)
Usage = create_model("Usage", prompt_tokens=int, completion_tokens=int, total_tokens=int)
AssistantMessage = create_model("AssistantMessage", role=Literal["assistant"], content=str)
ChatChoice = create_model(
    "ChatChoice", index=int, message=AssistantMessage, logprobs=None, finish_reason=Reason
)
TextChoice = create_model("TextChoice", index=int, text=str, logprobs=None, finish_reason=Reason)
ChatCompletion, Completion = (
    create_model(name, id=str, object=kind, created=int, model=str, choices=choices, usage=Usage)
    for name, kind, choices in (
        ("ChatCompletion", Literal["chat.completion"], list[ChatChoice]),
        ("Completion", Literal["text_completion"], list[TextChoice]),
    )
)
Generated = create_model(
    "Generated",
    text=str,
    tokens=int,
    token_ids=list[int],
    prompt_tokens=int,
    finish_reason=Reason,
    seconds=float,
    tok_s=float | None,
)
ModelCard = create_model("ModelCard", id=str, object=Literal["model"], created=int, owned_by=str)
ModelList = create_model("ModelList", object=Literal["list"], data=list[ModelCard])
Health = create_model("Health", status=Literal["ok", "loading", "error"], error=(str | None, None))
# Errors that say the most (a list of two prompts, too many token ids), whatever else failed.
SAYS_MOST = ("too_long", "too_short", "context_length_exceeded")
_FIELD_NAMES = frozenset(
    name
    for model in (
        ChatRequest,
        CompletionRequest,
        GenerateRequest,
        Message,
        TextPart,
        StreamOptions,
        TextFormat,
    )
    for name in model.model_fields
)


def validation_error(
    error: RequestValidationError, content_type: str | None, fields=()
) -> APIError:
    """The most specific problem in a body as a 400 naming the field (415: not JSON). Of a union's
    alternatives, the one that got furthest into the value is what the client meant: ``[-1]`` is a
    bad token id, not a bad string."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        return APIError(
            415,
            f"Content-Type {excerpt(media)} is not supported; send JSON ('Content-Type: "
            "application/json')",
            code="unsupported_media_type",
        )
    # max keeps the first of equals
    first = max(error.errors(), key=lambda p: (p["type"] in SAYS_MOST, len(p["loc"])))
    kind, loc = first["type"], first["loc"]
    # ("body", "messages", 0, "content", "str") names "messages.0.content": pydantic's union tags
    # dropped
    param = ".".join(str(p) for p in loc[1:] if isinstance(p, int) or p in _FIELD_NAMES) or None
    if kind == "json_invalid":
        return APIError(
            400,
            f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
            code="invalid_json",
        )
    if kind == "missing":
        return APIError(
            400,
            f"'{param}' is required" if param else "a JSON object body is required",
            param=param,
            code="missing_parameter",
        )
    if kind == "extra_forbidden":  # the name only as an excerpt: it may be a megabyte long
        name = ".".join(str(p) for p in loc[1:])
        known = (
            f"; this endpoint takes {', '.join(sorted(fields))}" if fields and len(loc) == 2 else ""
        )
        return APIError(
            400,
            f"unknown field {excerpt(name)}{known}",
            param=name if len(name) <= 40 else name[:40] + "...",
            code="unknown_parameter",
        )
    if len(loc) > 1 and loc[1] in UNSUPPORTED:
        return APIError(
            400,
            f"'{loc[1]}' = {excerpt(first.get('input'))} is not supported by this server; leave "
            f"it out ({first['msg']})",
            param=loc[1],
            code="unsupported_parameter",
        )
    message = first["msg"].removeprefix("Value error, ")
    return APIError(
        400,
        f"{param or 'body'}: {message} (got {excerpt(first.get('input'))})",
        param=param,
        code=kind if kind == "context_length_exceeded" else "invalid_value",
    )
