"""Grammars for constrained decoding (llguidance): specs, an off-thread compiler with a cache, limits.

    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    compiler = GrammarCompiler(llg_tokenizer, GrammarLimits(), listener)
    compiled = await compiler.compile(spec)     # in a thread pool; GrammarError (-> a 400) when refused
    matcher = compiled.matcher()                # a fresh llguidance.LLMatcher for one sequence
    resumed = compiled.resumed('{"city":"Par')  # the same grammar, its matchers past output already sent

How vLLM v1 does it (vllm/v1/structured_output/: a request waits in WAITING_FOR_FSM while its
grammar compiles in a thread pool, the rest of the batch goes on; compiled grammars are cached)
is what this does, with the wait moved before the request reaches the scheduler at all: the shard
awaits `compile` and only then enqueues, so a constrained request never stalls anyone's step and a
grammar that cannot compile is a 400 before the first byte. Compiled grammars are cached by the
digest of (kind, text); concurrent compiles of one digest share one job.

Bounded: `GrammarLimits.max_bytes` (source size), `compile_timeout_s` (the wait; llguidance's own
fuel limits stop the work itself) and llguidance's grammar-size limit; each refusal is a
`GrammarError` whose message names the limit or, for JSON schemas, the unsupported keywords.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from data_plane.common.errors import Overloaded

log = logging.getLogger(__name__)


class GrammarKind(str, Enum):
    """What a constraint came from (a bounded metric label)."""

    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    TOOLS = "tools"
    """A tool-call envelope (a JSON schema built from the request's tools: data_plane/tool_calls.py)."""

    @property
    def noun(self) -> str:
        """What the client sent, as a refusal names it ("the regex is not valid"; the label itself read
        "the tools is not valid", "the json_schema is not valid")."""
        return _NOUNS[self]


_NOUNS = {GrammarKind.JSON_OBJECT: "the JSON object format", GrammarKind.JSON_SCHEMA: "the JSON schema",
          GrammarKind.REGEX: "the regex", GrammarKind.CHOICE: "the choice list", GrammarKind.GRAMMAR: "the grammar",
          GrammarKind.TOOLS: "the schema of the tools' parameters"}


JSON_KINDS = frozenset({GrammarKind.JSON_OBJECT, GrammarKind.JSON_SCHEMA, GrammarKind.TOOLS})


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint as the API gave it: a JSON schema (json text), a regex, a JSON list of choices, or a
    Lark/GBNF grammar."""

    kind: GrammarKind
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.kind.value}\0{self.text}".encode()).hexdigest()


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 * 1024
    """Largest grammar source accepted (a schema's JSON text), 1..1 MiB."""
    compile_timeout_s: float = 10.0
    """Longest wait for a compile, 0.1..120 s."""
    cache_size: int = 256
    """Compiled grammars kept (LRU), 1..100000."""
    max_grammar_size: int = 500_000
    """llguidance's bound on grammar symbols."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_bytes <= 1 << 20:
            raise ValueError("max_bytes must be in 1..1048576")
        if not 0.1 <= self.compile_timeout_s <= 120:
            raise ValueError("compile_timeout_s must be in 0.1..120")
        if not 1 <= self.cache_size <= 100_000:
            raise ValueError("cache_size must be in 1..100000")


class GrammarError(ValueError):
    """A grammar the server refuses: `reason` is a bounded label (too_large, timeout, unsupported, invalid,
    resume_rejected)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class GrammarListener(Protocol):
    def on_grammar_compile(self, kind: str, seconds: float, outcome: str) -> None:
        """outcome: ``compiled``, ``cache_hit`` or a GrammarError reason."""


class CompiledGrammar:
    """A validated grammar: `matcher()` gives each sequence its own matcher (a copy of a template)."""

    def __init__(self, spec: GrammarSpec, template: Any, vocab_size: int, tokenizer: Any = None) -> None:
        self.spec = spec
        self._template = template
        self.vocab_size = vocab_size
        """The tokenizer's vocabulary (the bitmask's width; the model's logits may be wider)."""
        self._tokenizer = tokenizer
        self.resumed_tokens = 0
        """Tokens of output already sent that the template's matcher has consumed (`resumed`)."""

    def matcher(self) -> Any:
        return self._template.deep_copy()

    def resumed(self, text: str) -> CompiledGrammar:
        """This grammar with its matchers already past `text`: output a failed shard sent before a stream
        resumed here (data_plane/routing/resume.py), so the continuation continues the grammar. The text
        is tokenized afresh: llguidance's lexer works on bytes, so any tokenization of the same text
        leads to the same state. GrammarError ("resume_rejected") when the grammar does not allow it."""
        if not text:
            return self
        assert self._tokenizer is not None, "a grammar compiled without its tokenizer cannot resume"
        tokens = self._tokenizer.tokenize_str(text)
        m = self._template.deep_copy()
        taken = m.try_consume_tokens(tokens)
        if taken != len(tokens) or m.is_error():
            raise GrammarError(f"the output already sent does not follow {self.spec.kind.noun} "
                               f"(rejected after {taken} of {len(tokens)} tokens)", "resume_rejected")
        out = CompiledGrammar(self.spec, m, self.vocab_size, self._tokenizer)
        out.resumed_tokens = len(tokens)
        return out


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar text for `spec` (GrammarError when the source is malformed)."""
    import llguidance

    if spec.kind in JSON_KINDS:
        return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides={"whitespace_flexible": False}))
    if spec.kind == GrammarKind.REGEX:
        return str(llguidance.LLMatcher.grammar_from_regex(spec.text))
    if spec.kind == GrammarKind.CHOICE:
        return str(llguidance.grammar_from("choice", json.loads(spec.text)))
    try:
        return str(llguidance.grammar_from("grammar", spec.text))
    except ValueError as exc:
        raise GrammarError(f"the grammar does not parse: {exc}", "invalid") from None


PENDING_PER_WORKER = 8
"""Distinct compiles queued or running per pool worker before another is refused with a 503: one that
timed out keeps its worker until it ends (a thread cannot be stopped), so a flood of slow grammars
must not queue every later constrained request behind it."""


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer in a small thread pool, caching the results."""

    def __init__(self, tokenizer: Any, limits: GrammarLimits | None = None,
                 listener: GrammarListener | None = None, workers: int = 2) -> None:
        self._tokenizer: Future[Any] = Future()
        self._tokenizer.set_result(tokenizer)
        self.limits = limits or GrammarLimits()
        self.listener = listener
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._refusals: OrderedDict[str, GrammarError | None] = OrderedDict()
        """`refusal`'s verdicts by digest: a client that resends its bad tools pays for them once."""
        self._jobs: dict[str, asyncio.Future[CompiledGrammar]] = {}
        self._max_jobs = PENDING_PER_WORKER * workers

    @classmethod
    def lazy(cls, build_tokenizer: Callable[[], Any], **kwargs: Any) -> GrammarCompiler:
        """A compiler whose llguidance tokenizer is built in its pool from now on (it takes ~0.6 s; a
        shard is ready without waiting for it); the first compile, or `.tokenizer`, waits for it."""
        self = cls(None, **kwargs)
        self._tokenizer = self._pool.submit(build_tokenizer)
        return self

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        kind = spec.kind.value
        if len(spec.text.encode()) > self.limits.max_bytes:
            self._observe(kind, 0.0, "too_large")
            raise GrammarError(f"{spec.kind.noun} is {len(spec.text.encode())} bytes; at most {self.limits.max_bytes} "
                               "are accepted", "too_large")
        key = spec.digest
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self._observe(kind, 0.0, "cache_hit")
            return hit
        joined = key in self._jobs  # the same grammar is compiling for another request: wait for that one
        job = self._job(spec)
        if job is None:
            self._observe(kind, 0.0, "busy")
            raise Overloaded(f"{len(self._jobs)} grammars are compiling on this shard; retry shortly",
                             code="grammar_compiler_busy", retry_after=1)
        t0 = time.monotonic()
        try:
            compiled = await asyncio.wait_for(asyncio.shield(job), self.limits.compile_timeout_s)
        except TimeoutError:
            self._observe(kind, time.monotonic() - t0, "timeout")
            raise GrammarError(f"{spec.kind.noun} took longer than {self.limits.compile_timeout_s:g} s to compile",
                               "timeout") from None
        except GrammarError as exc:
            self._observe(kind, time.monotonic() - t0, exc.reason)
            raise
        self._cache[key] = compiled
        while len(self._cache) > self.limits.cache_size:
            self._cache.popitem(last=False)
        self._observe(kind, time.monotonic() - t0, "cache_hit" if joined else "compiled")
        return compiled

    async def refusal(self, spec: GrammarSpec) -> GrammarError | None:
        """Why `spec` does not compile, or None (it does, or took too long to tell): a part of a grammar
        that was refused, checked alone to name it. Not counted as a compile; its verdict is kept (by
        digest, as many as compiled grammars), its grammar is not."""
        key = spec.digest
        if key in self._refusals:
            self._refusals.move_to_end(key)
            return self._refusals[key]
        job = self._job(spec)
        if job is None:
            return None  # the pool is full: not known now
        verdict: GrammarError | None = None
        try:
            await asyncio.wait_for(asyncio.shield(job), self.limits.compile_timeout_s)
        except GrammarError as exc:
            verdict = exc
        except TimeoutError:
            return None  # not known: asked again, it is tried again
        self._refusals[key] = verdict
        while len(self._refusals) > self.limits.cache_size:
            self._refusals.popitem(last=False)
        return verdict

    def _job(self, spec: GrammarSpec) -> asyncio.Future[CompiledGrammar] | None:
        """The pool's build of `spec`: the one already running for it (a compile or a refusal check of the
        same digest), or a new one; None when the pool already holds as many as it may."""
        job = self._jobs.get(spec.digest)
        if job is None:
            if len(self._jobs) >= self._max_jobs:
                return None
            job = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(self._pool, self._build, spec))
            self._jobs[spec.digest] = job
            job.add_done_callback(functools.partial(self._forget, spec.digest))
        return job

    def _forget(self, key: str, job: asyncio.Future[CompiledGrammar]) -> None:
        self._jobs.pop(key, None)
        if not job.cancelled():
            job.exception()  # retrieved: a refusal nobody waited for (they timed out) is not an asyncio error log

    def _observe(self, kind: str, seconds: float, outcome: str) -> None:
        if self.listener is not None:
            self.listener.on_grammar_compile(kind, seconds, outcome)

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        t0 = time.monotonic()
        try:
            grammar = to_llguidance(spec)
        except ValueError as exc:
            if isinstance(exc, GrammarError):
                raise
            raise GrammarError(f"{spec.kind.noun} is not valid: {exc}", "invalid") from None
        limits = llguidance.LLParserLimits(max_grammar_size=self.limits.max_grammar_size)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer,
                                                                                limits=limits)
        if is_error:
            raise _refusal(spec, messages[0] if messages else "invalid grammar")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise _refusal(spec, matcher.get_error())
        # The first mask builds the lexer states the start needs (shared by every copy): here, not in a step.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error() or (probe.is_stopped() and not probe.is_accepting()):
            # No first token and nothing accepted yet: the grammar admits no output at all (a $ref
            # cycle, a regex matching nothing). Served, the reply would be "" with finish_reason
            # "stop", which no parser of the schema accepts: refuse it, as an empty anyOf is refused.
            raise GrammarError(f"{spec.kind.noun} is not valid: no output satisfies it", "invalid")
        log.debug("compiled a %s grammar (%d bytes) in %.1f ms", spec.kind.value, len(spec.text),
                  (time.monotonic() - t0) * 1000)
        return CompiledGrammar(spec, matcher, int(self.tokenizer.vocab_size), self.tokenizer)


def _refusal(spec: GrammarSpec, message: str) -> GrammarError:
    found = _UNIMPLEMENTED.search(message)
    if found:
        keys = [k.strip().strip('"') for k in found.group(1).split(",") if k.strip()]
        return GrammarError(f"JSON schema keyword(s) not supported: {', '.join(keys)}", "unsupported")
    if "size" in message.lower() and "limit" in message.lower():
        return GrammarError(f"{spec.kind.noun} is too large to compile: {message[:300]}", "too_large")
    return GrammarError(f"{spec.kind.noun} is not valid: {message[:300]}", "invalid")
