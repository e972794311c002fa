"""The legacy Completions API's request (`POST /v1/completions`), as a chat request with a raw prompt.

    legacy = parse_completion_request(raw, content_type)   # 400s in OpenAI's words, naming the param
    req = legacy.chat                                      # what the chat path serves (raw_prompt: no template)

The prompt is a string, a list of strings, a list of token ids or a list of lists of token ids (each list
item one prompt: its choices are indexed prompt_index * n + i, as OpenAI's). `max_tokens` defaults to 16,
`logprobs` is an int 0..5 (the legacy format), `echo` puts the prompt before each choice's text. What the
served model cannot do is a 400 naming the field: `suffix` (no fill-in-the-middle), `best_of` other than
`n`, as vLLM v1's. `echo` with `logprobs` asks the prompt's logprobs too (`prompt_logprobs` to the shard: the
torch engine computes them); `max_tokens: 0` with `echo` returns the prompt alone (lm-eval-harness's
loglikelihood requests), as vLLM serves it: one token is generated and left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from data_plane.chat_messages import ChatMessage, valid_unicode
from data_plane.common.errors import InvalidRequest, UnsupportedParameter
from data_plane.protocol import MAX_N, ChatCompletionRequest, StreamOptions
from data_plane.request_checks import WholeNumber, json_body, validated

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for the legacy endpoint (the chat path's default is the tier's cap)."""
MAX_LOGPROBS = 5
MAX_PROMPTS = 32
"""Prompts in one request (each one is `n` generations, admitted and billed together): LangChain's `OpenAI`
sends up to 20 in one request (its batch_size)."""
MAX_COMPLETIONS = 64
"""n x prompts: the generations of one request."""
MAX_TOKEN_ID = 2**31 - 1
"""Past any vocabulary: a larger id (2**32 and up) overflowed the gateway's decode for the input filters, a 500
(ids within it but past the model's vocabulary are the shard's 400)."""


class CompletionRequest(BaseModel):
    """OpenAI's CreateCompletionRequest, with vLLM's sampling extensions the chat path also takes."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(default="", max_length=256)
    prompt: str | list[str] | list[WholeNumber] | list[list[WholeNumber]]
    suffix: str | None = None
    max_tokens: WholeNumber | None = Field(default=DEFAULT_MAX_TOKENS, ge=0, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: WholeNumber | None = Field(default=None, ge=1, le=MAX_N)
    best_of: WholeNumber | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: WholeNumber | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=256)
    seed: WholeNumber | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    # vLLM's sampling extensions, as the chat path takes them
    top_k: WholeNumber | None = Field(default=None, ge=-1, le=100_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: WholeNumber | None = Field(default=None, ge=0, le=1_000_000)
    ignore_eos: bool | None = None

    @field_validator("stream", mode="before")
    @classmethod
    def _stream(cls, v: Any) -> Any:
        return False if v is None else v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        return ChatCompletionRequest._stop(v)  # type: ignore[no-any-return]  # the chat request's checks

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return ChatCompletionRequest._logit_bias(v)  # type: ignore[no-any-return]

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, v: Any) -> Any:
        return DEFAULT_MAX_TOKENS if v is None else v  # null is the default, as OpenAI's spec makes it nullable


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, or its token ids (`text` then empty)."""

    text: str
    ids: list[int] | None = None


@dataclass(frozen=True)
class LegacyRequest:
    """A valid legacy request: its prompts, what the reply's shape needs, and the chat request served."""

    prompts: list[Prompt]
    n: int
    echo: bool
    logprobs: int | None
    chat: ChatCompletionRequest
    """Every prompt as a user message with `raw_prompt`, `n` their choices together (n x prompts): what the
    gateway budgets, admits and bills; each prompt goes to a shard as its own request (`for_prompt`)."""
    echo_only: bool = False
    """`max_tokens: 0` with `echo`: the reply is the prompt (and its logprobs) alone; the one token the shard
    generates is left out of it."""

    def for_prompt(self, k: int) -> ChatCompletionRequest:
        """Prompt `k`'s own chat request (`n` choices)."""
        p = self.prompts[k]
        return self.chat.model_copy(update={"messages": [self.chat.messages[k]], "n": self.n,
                                            "prompt_token_ids": p.ids})


def prompts_of(value: str | list[Any]) -> list[Prompt]:
    """The request's prompts (a 400 naming `prompt` when there are none or too many)."""
    if isinstance(value, str):
        out = [Prompt(value)]
    elif not value:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    elif all(isinstance(v, str) for v in value):
        out = [Prompt(v) for v in value]
    elif all(isinstance(v, int) for v in value):
        out = [Prompt("", list(value))]
    else:
        out = [Prompt("", list(v)) for v in value]
    if len(out) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts are allowed per request", param="prompt")
    for i, p in enumerate(out):
        where = "prompt" if len(out) == 1 else f"prompt.{i}"
        if p.ids is None:
            valid_unicode(p.text)
        elif any(i < 0 for i in p.ids):
            raise InvalidRequest(f"{where}: token ids are 0 or above", param=where)
        elif (big := next((i for i in p.ids if i > MAX_TOKEN_ID), None)) is not None:
            raise InvalidRequest(f"{where}: token id {big} is out of vocabulary", param=where)
        if not p.text and not p.ids:
            raise InvalidRequest(f"{where} must not be empty", param=where)
    return out


def parse_completion_request(raw: bytes, content_type: str | None) -> LegacyRequest:
    """A legacy completions body, validated (4xx SwitchboardError), as the chat request the gateway serves."""
    body = json_body(raw, content_type)
    legacy = validated(CompletionRequest, body)
    if legacy.suffix:
        raise UnsupportedParameter("suffix is not supported: this model has no fill-in-the-middle", param="suffix")
    n = legacy.n or 1
    if legacy.best_of is not None and legacy.best_of != n:
        raise InvalidRequest(f"best_of ({legacy.best_of}) must equal n ({n}): only n completions are generated, "
                             "none are ranked", param="best_of")
    echo_only = legacy.max_tokens == 0
    if echo_only and not legacy.echo:
        raise InvalidRequest("max_tokens must be at least 1 (0 is allowed with echo: the prompt alone)",
                             param="max_tokens")
    prompts = prompts_of(legacy.prompt)
    total = n * len(prompts)
    if total > MAX_COMPLETIONS:
        raise InvalidRequest(f"n x prompts is {total}, above the {MAX_COMPLETIONS} completions allowed per request",
                             param="n")
    fields = {name: getattr(legacy, name) for name in (
        "model", "temperature", "top_p", "stream", "stream_options", "stop", "presence_penalty", "frequency_penalty",
        "logit_bias", "user", "seed", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos")
        if getattr(legacy, name) is not None}
    if legacy.logprobs is not None:
        fields.update(logprobs=True, top_logprobs=legacy.logprobs)
        if legacy.echo:  # the prompt's logprobs too, top-N each
            fields.update(prompt_logprobs=legacy.logprobs)
    try:
        chat = ChatCompletionRequest(
            messages=[ChatMessage(role="user", content=p.text) for p in prompts], max_tokens=legacy.max_tokens or 1,
            n=legacy.n, raw_prompt=True, continue_final_message=True, add_generation_prompt=False,
            prompt_token_ids=prompts[0].ids if len(prompts) == 1 else None, **fields)
    except ValidationError:  # the fields were checked above as the chat request checks them: the prompt's size
        raise InvalidRequest("prompt is too large", param="prompt") from None
    if len(prompts) > 1:  # every prompt's choices: what is budgeted and admitted (each shard request has its n)
        chat = chat.model_copy(update={"n": total})
    chat.check_supported()
    return LegacyRequest(prompts, n, bool(legacy.echo), legacy.logprobs, chat, echo_only)
