"""A chat-completions request as the engine's requests: one `GenerationRequest` per choice.

    gens = generation_requests(req, engine, request_id, settings.kv_public_prefix, req.output_plan())
    async for out in engine.generate(gens[0]): ...

The prompt is encoded once (restored to the exact tokens an earlier turn generated when the engine
keeps transcripts, `kv_transcript.py`); choice i gets seed `seed + i` and id `request_id-i`; an
operator-marked public system prompt's tokens are counted for the shared KV. Called by the shard's
app (`app.py`, per request) and by `data_plane/bench/engine_structured.py` (the same requests, no
HTTP).
"""

from __future__ import annotations

import dataclasses

from data_plane.common.errors import InvalidRequest
from data_plane.protocol import ChatCompletionRequest
from data_plane.shard.engines.base import Engine, GenerationRequest, SamplingParams
from data_plane.shard.engines.grammar import GrammarKind, GrammarSpec
from data_plane.structured import OutputPlan, ToolMode


def generation_requests(req: ChatCompletionRequest, engine: Engine, request_id: str,
                         public_prefixes: list[str] | tuple[str, ...], plan: OutputPlan) -> list[GenerationRequest]:
    """One engine request per choice (`n`): the same prompt, seeds `seed + i`."""
    messages, ids = prompt_ids(req, engine)
    if req.prompt_logprobs is not None and not getattr(engine, "prompt_logprobs", False):
        raise InvalidRequest("this shard's engine computes no prompt logprobs (echo with logprobs): the torch "
                             "engine does", param="echo")
    # A continued final message (the gateway's mid-stream resume sends the text already sent so) is output
    # already made: a grammar continues after it, and a seeded sample draws on from the position after it
    # (torch_sampling.Draws), so a resumed stream gives the unbroken stream's text. It was set only under a
    # grammar, and a plain seeded stream resumed on another shard started its draws over.
    # A raw prompt (the legacy Completions API) is always a continued message, its text the client's prompt, not
    # output: counted as made it ate into min_tokens and drew presence/frequency penalties. (Its resume, the
    # prompt and the output as one text, so starts its draws over.)
    resumed = messages[-1]["content"] if req.continue_final_message and not req.raw_prompt else ""
    grammar = None
    if plan.constraint is not None:
        grammar = GrammarSpec(GrammarKind(plan.constraint.kind), plan.constraint.text)
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),  # vLLM's -1 (every token) is 0 here
        max_tokens=req.output_limit,
        stop=tuple(req.stop or ()) if plan.tool_mode == ToolMode.NONE else (),  # under tools: choices.ContentStop
        seed=req.seed,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        logit_bias=tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items()),
        min_tokens=req.min_tokens or 0,
        ignore_eos=bool(req.ignore_eos),
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        prompt_logprobs=req.prompt_logprobs,
        grammar=grammar,
    )
    public = public_tokens(messages, ids, engine, public_prefixes)
    out = []
    for i in range(req.n or 1):
        p = params if i == 0 or req.seed is None else dataclasses.replace(params, seed=req.seed + i)
        out.append(GenerationRequest(request_id if i == 0 else f"{request_id}-{i}", list(ids), p,
                                     priority=req.priority or 0, deadline=req.deadline, cache_salt=req.cache_salt,
                                     public_prefix_tokens=public, resumed_text=resumed))
    return out


def prompt_ids(req: ChatCompletionRequest, engine: Engine) -> tuple[list[dict[str, str]], list[int]]:
    """The request's messages as the chat template sees them (tools' prompt included) and the prompt's
    token ids, as generated from: also what `POST /v1/chat/completions/input_tokens` counts, so a
    count is the `prompt_tokens` the same request is billed."""
    messages = req.plain_messages()
    if req.raw_prompt:  # the legacy Completions API's: no chat template
        return messages, raw_prompt_ids(req, messages, engine)
    ids = engine.encode_chat(messages, continue_final=req.continue_final_message)
    restore = getattr(engine, "restore_generated", None)  # token-exact transcripts (data_plane/shard/kv_transcript.py)
    if restore is not None:
        ids = restore(messages, ids, req.cache_salt)
    return messages, ids


def raw_prompt_ids(req: ChatCompletionRequest, messages: list[dict[str, str]], engine: Engine) -> list[int]:
    """A raw prompt's ids: its token ids (each checked against the vocabulary), then its text encoded as it is
    (a resume's output so far follows the prompt in it)."""
    encode = getattr(engine, "encode_text", None)
    if encode is None:
        raise InvalidRequest("this shard's engine serves chat completions only", param="prompt")
    ids = list(req.prompt_token_ids or [])
    vocab = getattr(engine, "vocab_size", None)  # a negative id, or one past it, killed the engine (an index error)
    bad = next((i for i in ids if i < 0 or (vocab and i >= vocab)), None)
    if bad is not None:
        span = f"0..{vocab - 1}" if vocab else "0 or above"
        raise InvalidRequest(f"prompt token id {bad} is out of vocabulary ({span})", param="prompt")
    text = "".join(m["content"] for m in messages)
    return ids + (encode(text, not ids) if text else [])


def public_tokens(messages: list[dict[str, str]], ids: list[int], engine: Engine,
                   public_prefixes: list[str] | tuple[str, ...]) -> int:
    """How many leading prompt tokens are an operator-marked public system prompt (shared KV)."""
    if not public_prefixes or messages[0]["role"] != "system" or messages[0]["content"] not in public_prefixes:
        return 0
    head = engine.encode_chat(messages[:1], continue_final=True)
    return len(head) if ids[: len(head)] == head else 0
