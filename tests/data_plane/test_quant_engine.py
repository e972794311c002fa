"""The real model served in each weight format (in-process torch engine, speculation on):
- int4 (the GGUF's Q4_1 blocks, bf16 activations: `--quantization auto`'s choice for the default model),
- int8 (per channel, bf16 activations),
- int4 on blockq's two int8 planes (``--quantization-kernel blockq_x2``: float32 activations, dtype reason
  ``agreement``, the GGUF's Q8_0 table), held to issue 23's greedy agreement (>= 90 % of prompts),
- int4 with float32 activations (the exact mode, `--dtype float32 --quantization int4`: blockq's float path,
  native/blockq_exact.c, on the GGUF's own Q4_1 projections and Q8_0 table, so it computes the float32
  reference's own weights in float32; torch's int4 kernel where blockq is not built).
The float32 reference is float32 dense, whose weights *are* the GGUF's blocks dequantized (the
converted checkpoint); so every difference below is rounding, never other weights.
Each format: the text is sane; a repeated prompt hits the prefix cache; speculation drafts and is
accepted. Greedy text is identical with speculation on and off only where the format is
batch-invariant (float32 activations): with bf16 activations a verify pass's rows go through other
GEMM/attention shapes than a decode step's, so near-ties may break the other way (as for dense bf16),
and that format is only required to speculate and stay sane.

Quality bounds, from `switchboard bench quality --formats bfloat16:int4` here (12 prompts x 32
tokens; float32 8.700 perplexity): dense bf16 +0.13 %, 67 % of prompts identical; bf16 int4 +0.86 %,
50 %; float32 int4 (`--formats float32:int4`, the exact mode) +0.00 %, 100 %. With bf16 activations every first difference came where the
float32 reference's top-1 and top-2 logits were within 0.17 of each other (median step margin 1.33): near
ties that bf16 rounding (activations, bf16 scales/zeros, the per-row int8 head) breaks either way, so
a bf16 format is held to perplexity within 3 %, a mean shared prefix >= 0.5 and every divergence at a
near-tie (margin < 0.5), not to identical tokens. blockq (int8 activations x the weight blocks, either
activation dtype) is held to perplexity within 3 % (bf16) or 2 % (float32), the same near-tie rule and a
mean shared prefix >= 0.2 (test_quality_against_float32 gives its figures). blockq_x2 (two int8 planes,
float32 around them: float32's greedy tokens on 12 of 12 of the bench's prompts, perplexity +0.00 %) is held
to >= 90 % of prompts identical and perplexity within 0.5 %. The exact mode is held to the
reference's perplexity within 0.1 % and its greedy tokens, a difference allowed only at a true tie (accumulation
order only); on torch's kernel (no C compiler) to its logits on a short prefill (~0.6 s a row there).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import torch

from data_plane.bench.quality import PROMPTS, TEXT, agreement, divergence_margins, greedy_margins, perplexity
from data_plane.model_store import model_source
from data_plane.shard.engines import blockq
from data_plane.shard.engines.base import GenerationRequest, SamplingParams
from data_plane.shard.engines.llama_runner import LlamaRunner
from data_plane.shard.engines.torch_engine import EngineConfig, StepListener, TorchEngine
from data_plane.shard.engines.weight_source import CpuCaps, resolve_plan
from tests.support.spec import pin_row_cost

PASSAGE = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
           "def add(a, b):\n    return a + b\n")
QUOTE = [{"role": "user", "content": "Copy the text below exactly, unchanged:\n" + PASSAGE * 2}]
CHAT = [{"role": "user", "content": "Name the capital of France."}]
FORMATS = [("bfloat16", "int4", "blockq"), ("float32", "int4", "blockq"), ("bfloat16", "int8", "torch"),
           ("auto", "auto", "blockq_x2"), ("float32", "int4", "auto")]
"""(dtype, quantization, kernel): blockq with both activation dtypes auto picks (bf16 where the CPU has
it natively, else float32), torch's int8 kernel, two int8 planes with what auto picks for them (float32
activations, the GGUF's Q4_1 blocks), and the exact mode (float32 asked for with int4)."""
AGREEMENT = 0.9
"""Issue 23's bound for blockq_x2: greedy tokens identical to float32 dense's for 32 tokens on >= 90 % of prompts."""
N_PROMPTS, N_TOKENS = 4, 32
PPL_TOKENS = 160
EXACT_TOKENS = 8
QUOTE_TOKENS = 24
NEAR_TIE = 0.5
"""A float32 top-1 minus top-2 logit below this is a near-tie (measured: every bf16 divergence <= 0.17)."""
TRUE_TIE = 0.01
"""Below this, two float32 GEMMs that only add in another order may pick either token."""
"""The bench's text, cut: a float32-activation int4 decode step is ~6x a dense one (quant_linear.py)."""


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    """float32 dense: the perplexity and greedy tokens every format is held against."""
    src = model_source(None)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.path))
    text = tok.encode(TEXT)[:PPL_TOKENS]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for p in PROMPTS[:N_PROMPTS]]
    runner = LlamaRunner.from_pretrained(src.path, dtype=torch.float32, max_num_seqs=N_PROMPTS, max_len=400)
    tokens, margins = greedy_margins(runner, prompts, N_TOKENS)
    return {"src": src, "text": text, "prompts": prompts, "ppl": perplexity(runner, text), "greedy": tokens,
            "margins": margins, "short": runner.prefill(0, text[:EXACT_TOKENS], 0),
            "bf16_bytes": runner.weight_bytes // 2}


class Recorder(StepListener):
    def __init__(self) -> None:
        self.weights: tuple[str, str, str, str, int] | None = None
        self.kernel = ""

    def on_weights(self, dtype: str, dtype_reason: str, quantization: str, quantization_reason: str,
                   weight_bytes: int, kernel: str = "torch") -> None:
        self.weights = (dtype, dtype_reason, quantization, quantization_reason, weight_bytes)
        self.kernel = kernel


class Engine:
    def __init__(self, dtype: str, quantization: str, kernel: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.listener = Recorder()
        self.engine = TorchEngine(EngineConfig(dtype=dtype, quantization=quantization, quantization_kernel=kernel,
                                               max_num_seqs=4,
                                               max_model_len=1024, speculation="ngram", spec_max_batch=4),
                                  self.listener)
        self.loop.run_until_complete(self.engine.start())
        self.speculator = self.engine.spec
        pin_row_cost(self.engine)

    def run(self, messages: list[dict[str, str]], max_tokens: int, spec: bool = True) -> tuple[str, object]:
        self.engine.spec = self.speculator if spec else None

        async def one() -> tuple[str, object]:
            req = GenerationRequest(uuid.uuid4().hex, self.engine.encode_chat(messages),
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens))
            text, last = "", None
            async for out in self.engine.generate(req):
                text += out.text
                last = out
            return text, last

        try:
            return self.loop.run_until_complete(one())
        finally:
            self.engine.spec = self.speculator

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.aclose())
        self.loop.close()


@pytest.fixture(scope="module", params=FORMATS, ids=lambda f: "-".join(f))
def served(request: pytest.FixtureRequest) -> Iterator[Engine]:
    if request.param[2] in ("blockq", "blockq_x2") and blockq.load() is None:
        pytest.skip("no C compiler here: blockq is not built (torch's kernels serve)")
    e = Engine(*request.param)
    yield e
    e.close()


def test_format_is_what_was_asked_and_weights_shrink(served: Engine, reference: dict[str, object]) -> None:
    cfg = served.engine.config
    assert served.listener.weights is not None
    dtype, dtype_reason, quant, reason, nbytes = served.listener.weights
    x2 = cfg.quantization_kernel == "blockq_x2"
    if x2:  # auto around two planes: float32 activations (agreement), the GGUF's Q4_1 blocks
        assert (dtype, dtype_reason, quant, reason) == ("float32", "agreement", "int4", "gguf_q4")
    else:
        assert (dtype, quant, reason) == (cfg.dtype, cfg.quantization, "requested")
    runner = served.engine._runner
    assert runner.weight_bytes == nbytes
    # x dense bf16 (tied head counted once); scales/zeros are held in the activation dtype (fp32: twice),
    # and float32 activations keep the table float32 (exact), 4x its int8 bytes
    # blockq: the GGUF's Q4_1 blocks as they are and its Q8_0 table at 6 bits, whatever the activations
    # (measured 0.332x; issue 23's bound is 0.35x); two planes and the exact mode keep the Q8_0 table as it
    # is (0.359x read, 0.297x resident)
    blockq = cfg.quantization_kernel == "blockq"
    exact = served.listener.kernel.startswith("blockq_exact")
    assert served.listener.kernel.startswith("blockq_x2_" if x2 else "blockq_" if blockq
                                             else ("blockq_exact_", "torch"))
    assert runner.weights.plan.kernel_choice == (cfg.quantization_kernel if blockq or x2 else
                                                 "blockq_exact" if exact else "torch")
    bound = (0.34 if blockq else 0.37 if exact or x2
             else {("bfloat16", "int8"): 0.52, ("float32", "int4"): 0.75}[(dtype, quant)])
    assert nbytes <= reference["bf16_bytes"] * bound, nbytes / reference["bf16_bytes"]  # type: ignore[operator]
    if quant == "int4":  # the GGUF's own blocks (torch's int8 kernel: its Q8_0 head requantized per row)
        assert runner.weight_format == ("int4a8[q4_1,q6,q8_0]" if blockq else "int4a8x2[q4_1,q8_0]" if x2
                                        else "int4a32[q4_1,q8_0]" if exact else "int4[q4_1,q8_0]")


def test_quality_against_float32(served: Engine, reference: dict[str, object]) -> None:
    runner = served.engine._runner  # the engine's own: its slots are free between this module's requests
    if runner.weights.plan.exact:  # the reference's weights in float32: perplexity and greedy tokens kept
        got, _ = greedy_margins(runner, reference["prompts"], N_TOKENS)  # type: ignore[arg-type]
        ties = divergence_margins(reference["greedy"], reference["margins"], got)  # type: ignore[arg-type]
        assert all(m < TRUE_TIE for m in ties), ties
        ppl = perplexity(runner, reference["text"])  # type: ignore[arg-type]
        assert abs(ppl / reference["ppl"] - 1) < 0.001, (ppl, reference["ppl"])  # type: ignore[operator]
        return
    if runner.weights.plan.planes == 2:  # issue 23's agreement bound
        got, _ = greedy_margins(runner, reference["prompts"], N_TOKENS)  # type: ignore[arg-type]
        same, _ = agreement(reference["greedy"], got)  # type: ignore[arg-type]
        # one int8 plane read 1 of these 4 prompts in float32, 0 in bf16 (Intel Xeon)
        assert same >= AGREEMENT, (same, divergence_margins(reference["greedy"], reference["margins"], got))  # type: ignore[arg-type]
        ppl = perplexity(runner, reference["text"])  # type: ignore[arg-type]
        assert abs(ppl / reference["ppl"] - 1) < 0.005, (ppl, reference["ppl"])  # type: ignore[operator]
        return
    exact = served.engine.config.dtype == "float32" and served.listener.kernel == "torch"
    if exact:  # torch's exact kernel (no C compiler): the reference's weights, other summation order only
        short = runner.prefill(0, reference["text"][:EXACT_TOKENS], 0)  # type: ignore[index]
        ref = reference["short"]
        assert int(short.argmax()) == int(ref.argmax())  # type: ignore[attr-defined]
        assert (short - ref).abs().max() < 1e-3, (short - ref).abs().max()  # type: ignore[operator]
        return
    prompts: list[list[int]] = reference["prompts"]  # type: ignore[assignment]
    ppl = perplexity(runner, reference["text"])  # type: ignore[arg-type]
    got, _ = greedy_margins(runner, prompts, N_TOKENS)
    _, tokens = agreement(reference["greedy"], got)  # type: ignore[arg-type]
    # blockq rounds activations to int8 per 32 too (llama.cpp's numerics) and holds the table at 6 bits:
    # more near-ties break. Measured with `switchboard bench quality` (12 prompts x 32 tokens, ~280 tokens
    # of text): bf16 +1.45 %, 48 % of tokens before the first difference; float32 +0.27 %, 62 %; every
    # first difference at a float32 margin <= 0.31 (median 1.34); here (4 prompts, 160 tokens of text)
    # bf16 +2.1 %. bf16 is held to the bf16 formats' 3 %, float32 to the issue's 2 %, both to the near-tie
    # rule below; the shared prefix only loosely (0.2): near-ties break differently with each CPU's sums.
    blockq = served.engine.config.quantization_kernel == "blockq"
    bound = 1.02 if blockq and served.engine.config.dtype == "float32" else 1.03
    assert ppl <= reference["ppl"] * bound, (ppl, reference["ppl"])  # type: ignore[operator]
    assert tokens >= (0.2 if blockq else 0.5), tokens
    ties = divergence_margins(reference["greedy"], reference["margins"], got)  # type: ignore[arg-type]
    assert all(m < NEAR_TIE for m in ties), ties


def test_text_sane_prefix_cache_hits_and_speculation(served: Engine) -> None:
    cfg = served.engine.config
    # torch's float32 int4 kernel is its slow path (quant_linear.py), and a verify pass's rows go through it
    # at a pinned row price: the 24-token quote took 61 s with speculation on against 10.5 s off (in
    # process, Zen 4, under load), and this case 67 s of an AVX2 host's suite. At 12 tokens its first
    # draft already copies 11 tokens of the passage (5.7 s), which is what is checked; the other formats
    # keep the longer runs.
    slow = cfg.dtype == "float32" and served.listener.kernel == "torch"
    chat_tokens, quote_tokens = (8, 12) if slow else (16, QUOTE_TOKENS)
    text, out = served.run(CHAT, chat_tokens)
    assert "Paris" in text, text
    _, again = served.run(CHAT, 1)  # the hit is the prompt's: one token of reply shows it
    assert again.cached_tokens >= 16  # type: ignore[attr-defined]
    # 24 tokens (was 40): the float32-activation int4 format decodes at ~6x a dense step, and its
    # speculation-off run drafts nothing; this test took ~100 s of the suite under load
    quote, out = served.run(QUOTE, quote_tokens)
    assert "quick brown fox" in quote, quote
    assert out.spec_drafts > 0 and out.spec_accepted_tokens > 0  # type: ignore[attr-defined]
    if served.engine._runner.dtype == torch.float32:  # batch-invariant: greedy identical with speculation off
        off, _ = served.run(QUOTE, quote_tokens, spec=False)
        assert off == quote


def test_auto_picks_what_the_cpu_and_model_call_for() -> None:
    caps = CpuCaps.detect()
    plan = resolve_plan("auto", "auto", source=model_source(None).kind, caps=caps)
    # the default model ships Q4_1 blocks: int4 everywhere; bf16 activations only where the CPU has
    # native bf16 (an AVX2-only CPU gets float32: this read bfloat16 whatever the CPU, red on one)
    assert (plan.dtype, plan.quantization) == ("bfloat16" if caps.native_bf16 else "float32", "int4")
    assert (plan.planes, plan.kernel_choice) == (1, "blockq" if caps.blockq else "torch")
    assert resolve_plan("auto", "none", source="q4", caps=caps).dtype == ("bfloat16" if caps.native_bf16 else "float32")


def test_prepared_file_builds_the_same_layers_as_the_gguf(tmp_path: object) -> None:
    """The unpacked file `switchboard model prepare` writes (prepared_weights.py) serves bit-identical logits.

    On the model's first two layers (every layer holds the same tensor kinds, checked): unpacking and
    packing all 30 took ~110 s of the suite under load, two ~15 s, and every kind of tensor (the Q4_1
    blocks, the Q8_0 table requantized to int8, the float32 norms) goes through both paths all the same."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from data_plane.shard.engines.gguf_weights import GGUFWeights
    from data_plane.shard.engines.model_files import stage_tensors
    from data_plane.shard.engines.prepared_weights import PreparedWeights, write_prepared
    from data_plane.shard.engines.weight_source import WeightBuilder

    src = model_source(None)
    assert src.gguf is not None
    cfg = AutoConfig.from_pretrained(str(src.path))
    whole = GGUFWeights.open(src.gguf, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads)
    keep = stage_tensors(0, 2, head=True)
    g = GGUFWeights({n: t for n, t in whole._tensors.items() if keep(n)}, cfg.num_attention_heads,
                    cfg.num_key_value_heads)
    assert set(g.kinds()) == set(whole.kinds()) and g.kinds()["Q4_1"] == 2 * 7, g.kinds()
    cfg.num_hidden_layers = 2
    path = write_prepared(g, Path(str(tmp_path)) / "prepared.safetensors")
    labels = {"torch": "int4[q4_1,q8_0]", "blockq": "int4a8[q4_1,q6,q8_0]", "blockq_x2": "int4a8x2[q4_1,q8_0]"}
    for kernel in labels:  # blockq builds its table from the Q8_0 table's own blocks (file v2)
        plan = resolve_plan("bfloat16", "int4", source="q4", caps=CpuCaps.detect(), kernel=kernel)
        logits = []
        for source in (g, PreparedWeights.open(path)):
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            runner = LlamaRunner(model, dtype=torch.bfloat16, max_num_seqs=1, max_len=64,
                                 weights=WeightBuilder(plan, gguf=source))
            assert runner.weight_format == labels[plan.kernel_choice]
            logits.append(runner.prefill(0, list(range(200, 230)), 0))
        assert torch.equal(logits[0], logits[1]), kernel
