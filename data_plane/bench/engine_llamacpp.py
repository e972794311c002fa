"""The llama.cpp system of `switchboard bench engine`: llama-cpp-python's low-level batch API on a GGUF.

    system = LlamaCppSystem(config)     # raises Skip at once when llama_cpp is not installed
    await system.start(); results = await system.run(prompts, 16, 128); await system.aclose()

Used by data_plane/bench/engine.py (``--systems llamacpp``). One seq_id per stream so it batches;
only when `llama_cpp` imports (`pip install llama-cpp-python`, ~8 min build). EOS is ignored so
every request yields exactly max-tokens, as for the naive system.

``--systems llamacpp-lookup`` is llama.cpp with its prompt-lookup draft
(`llama_cpp.llama_speculative.LlamaPromptLookupDecoding`, verified by the high-level `Llama.generate`),
the n-gram speculation to hold ours against. That API serves one sequence at a time, so at
concurrency N requests queue behind each other, as for the naive system.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from typing import Any

from data_plane.bench.common import RequestResult, one_at_a_time
from data_plane.bench.engine_systems import BenchConfig, Skip
from data_plane.common.cores import usable_cores

LLAMACPP_HINT = "pip install llama-cpp-python diskcache  (builds from source: 8-20 min on 2 cores)"
NO_AMX_FLAGS = ("-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
                "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
"""docs/FACTS.md: where cpuinfo lists AMX but AMX instructions fault (a VM), a native build dies with
SIGILL on the first multi-token batch; build it for AVX-512 without AMX instead."""


def build_command(cpu_flags: frozenset[str] | None = None, pip: str = "pip") -> str:
    """The command that builds llama-cpp-python for this CPU (docs/FACTS.md): native where the CPU has
    no AMX (AVX2 or AVX-512 machines), without AMX where cpuinfo lists it."""
    if cpu_flags is None:
        from data_plane.shard.engines.weight_source import CpuCaps

        cpu_flags = CpuCaps.detect().flags
    prefix = f'CMAKE_ARGS="{NO_AMX_FLAGS}" ' if any(f.startswith("amx") for f in cpu_flags) else ""
    return f"{prefix}MAKEFLAGS=-j2 nice {pip} install llama-cpp-python diskcache"


def missing_message() -> str:
    """What the bench prints when llama_cpp is absent: why, and the build command for this CPU."""
    import sys
    from pathlib import Path

    pip = str(Path(sys.executable).with_name("pip"))
    return (f"llama_cpp is not installed (llama-cpp-python is not a project dependency; it builds from source, "
            f"8-20 min with both cores busy). To compare against llama.cpp, build it once: {build_command(pip=pip)}")


class LlamaCppSystem:
    """llama.cpp's low-level batch API: every running stream decodes in one `llama_decode`,
    each under its own seq_id; new prompts are prefilled in the same batch (closed loop)."""

    def __init__(self, config: BenchConfig) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise Skip(missing_message())
        self.config = config
        self.gguf = _gguf_for(config.model)
        self.dtype = self.gguf.stem.rsplit(".", 1)[-1] if "." in self.gguf.stem else "gguf"
        self.weight_bytes = 0
        self.max_seqs = max(config.concurrency)
        self.n_batch = max(512, self.max_seqs * (config.max_prompt_len + 1))

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import llama_cpp as lib

        self.lib = lib
        if hasattr(lib, "llama_log_set") and hasattr(lib, "llama_log_callback"):
            import ctypes

            # llama.cpp logs every graph tensor at load; keep the bench's table readable.
            self._log_cb = lib.llama_log_callback(lambda level, text, user_data: None)
            lib.llama_log_set(self._log_cb, ctypes.c_void_p(0))
        lib.llama_backend_init()
        load = _first(lib, "llama_model_load_from_file", "llama_load_model_from_file")
        self.model = load(str(self.gguf).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.gguf}")
        cp = lib.llama_context_default_params()
        cp.n_ctx = self.max_seqs * self.config.max_model_len
        cp.n_batch = self.n_batch
        cp.n_seq_max = self.max_seqs
        cp.n_threads = cp.n_threads_batch = self.config.threads or usable_cores()
        self.ctx = _first(lib, "llama_init_from_model", "llama_new_context_with_model")(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        if hasattr(lib, "llama_model_get_vocab") and hasattr(lib, "llama_vocab_n_tokens"):
            self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        else:
            self.n_vocab = lib.llama_n_vocab(self.model)
        size = getattr(lib, "llama_model_size", None)
        self.weight_bytes = int(size(self.model)) if size else self.gguf.stat().st_size
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._serve([[1, 2, 3]], 1, 2)  # warm-up

    async def run(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[RequestResult]:
        return await asyncio.to_thread(self._serve, prompts, concurrency, max_tokens)

    def _serve(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[RequestResult]:
        queue = list(reversed(prompts))
        free = list(range(concurrency))
        active: dict[int, _LlamaStream] = {}
        done: list[RequestResult] = []
        while queue or active:
            now = time.perf_counter()
            while free and queue:  # closed loop: a freed worker submits its next prompt now
                ids = queue.pop()
                active[free.pop()] = _LlamaStream(RequestResult(submitted=now, prompt_tokens=len(ids)), ids)
            outputs = self._decode(active)
            now = time.perf_counter()
            for index, seq in outputs:
                stream = active[seq]
                stream.emit(self._argmax(index), now)
                if stream.result.output_tokens >= max_tokens:  # EOS ignored: always max_tokens
                    stream.result.finished = now
                    done.append(stream.result)
                    self._forget(seq)
                    del active[seq]
                    free.append(seq)
        return done

    def _decode(self, active: dict[int, _LlamaStream]) -> list[tuple[int, int]]:
        """One llama_decode over every stream's pending tokens; return (batch index, seq) with logits."""
        b, n, outputs = self.batch, 0, []
        for seq, stream in active.items():
            for j, token in enumerate(stream.pending):
                last = j == len(stream.pending) - 1
                b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, stream.pos + j, 1, last
                b.seq_id[n][0] = seq
                if last:
                    outputs.append((n, seq))
                n += 1
            stream.pos += len(stream.pending)
        b.n_tokens = n
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return outputs

    def _argmax(self, index: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
        return int(logits.argmax())

    def _forget(self, seq: int) -> None:
        lib = self.lib
        if hasattr(lib, "llama_memory_seq_rm"):
            lib.llama_memory_seq_rm(lib.llama_get_memory(self.ctx), seq, -1, -1)
        else:
            _first(lib, "llama_kv_self_seq_rm", "llama_kv_cache_seq_rm")(self.ctx, seq, -1, -1)

    async def aclose(self) -> None:
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        _first(lib, "llama_model_free", "llama_free_model")(self.model)


class LlamaCppLookupSystem:
    """llama.cpp's high-level `Llama.generate` with `LlamaPromptLookupDecoding` drafts (greedy), one
    request at a time behind a FIFO lock; EOS ignored (exactly max_tokens per request)."""

    def __init__(self, config: BenchConfig, num_pred_tokens: int = 10, max_ngram_size: int = 2) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise Skip(missing_message())
        self.config = config
        self.gguf = _gguf_for(config.model)
        self.dtype = self.gguf.stem.rsplit(".", 1)[-1] if "." in self.gguf.stem else "gguf"
        self.weight_bytes = self.gguf.stat().st_size
        self.num_pred_tokens = num_pred_tokens
        self.max_ngram_size = max_ngram_size

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import llama_cpp as lib
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = self.config.threads or usable_cores()
        self.llm = lib.Llama(model_path=str(self.gguf), n_ctx=self.config.max_model_len, n_batch=512,
                             n_threads=threads, n_threads_batch=threads, verbose=False,
                             draft_model=LlamaPromptLookupDecoding(num_pred_tokens=self.num_pred_tokens,
                                                                   max_ngram_size=self.max_ngram_size))
        self._generate([1, 2, 3], 2, RequestResult(submitted=time.perf_counter()))  # warm-up

    async def run(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[RequestResult]:
        return await one_at_a_time(prompts, concurrency, max_tokens, self._generate)

    def _generate(self, ids: list[int], max_tokens: int, r: RequestResult) -> None:
        last = 0.0
        # top_k=1 and temp 0: greedy, as every other system of the bench.
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
            now = time.perf_counter()
            if r.first_token is None:
                r.first_token = now
            else:
                r.itls.append(now - last)
            last = now
            r.output_tokens += 1
            if r.output_tokens >= max_tokens:
                break
        r.finished = time.perf_counter()

    async def aclose(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()


class _LlamaStream:
    def __init__(self, result: RequestResult, prompt: list[int]) -> None:
        self.result = result
        self.pending = list(prompt)
        self.pos = 0
        self.last = 0.0

    def emit(self, token: int, now: float) -> None:
        r = self.result
        if r.first_token is None:
            r.first_token = now
        else:
            r.itls.append(now - self.last)
        self.last = now
        r.output_tokens += 1
        self.pending = [token]


def _first(lib: Any, *names: str) -> Any:
    """The first of `names` that llama_cpp has (its C API renames functions between releases)."""
    for name in names:
        if hasattr(lib, name):
            return getattr(lib, name)
    raise Skip(f"llama_cpp has none of {names}; this llama-cpp-python is too old or too new")


def _gguf_for(model: str | None) -> Any:
    from pathlib import Path

    from data_plane.model_store import default_gguf

    if model is None:
        return default_gguf()
    if model.endswith(".gguf"):
        return Path(model).expanduser()
    raise Skip(f"llama.cpp needs a GGUF file; --model {model} is not one")


__all__ = ["LLAMACPP_HINT", "LlamaCppSystem"]
