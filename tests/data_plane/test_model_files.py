"""The fast load path (data_plane/shard/engines/model_files.py) gives what transformers gives: the same
rotary tables bit for bit, the same tokenizer, the same logits from the real model; the KV cache
is zero and writable though allocated lazily.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_model_files.py -q
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from data_plane.model_store import model_source
from data_plane.shard.engines.grammar import GrammarCompiler
from data_plane.shard.engines.llama_runner import LlamaRunner
from data_plane.shard.engines.model_files import (
    LoadPhases,
    default_rope,
    lazy_zeros,
    load_tokenizer,
    read_config,
)


@pytest.fixture(scope="module")
def folder() -> Path:
    return model_source(None).path


def test_rope_tables_match_transformers_bit_for_bit(folder: Path) -> None:
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    light = read_config(folder)
    assert light is not None and light.num_key_value_heads == 3 and light.tie_word_embeddings is True
    tables = default_rope(light, 300)
    assert tables is not None
    rotary = LlamaRotaryEmbedding(AutoConfig.from_pretrained(str(folder)))
    cos, sin = rotary(torch.zeros(1, 300, light.head_dim), torch.arange(300).unsqueeze(0))
    assert torch.equal(tables[0], cos[0]) and torch.equal(tables[1], sin[0])


def test_scaled_rope_and_unknown_models_fall_back(tmp_path: Path, folder: Path) -> None:
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    scaled = read_config(tmp_path)
    assert scaled is not None and default_rope(scaled, 8) is None  # the runner uses transformers' module
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    assert read_config(tmp_path) is None


def test_tokenizer_is_the_one_autotokenizer_loads(folder: Path) -> None:
    from transformers import AutoTokenizer

    fast, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(fast) is type(auto)
    msgs = [{"role": "user", "content": "Héllo, what is 2+2? ✓"}]
    assert fast.apply_chat_template(msgs, add_generation_prompt=True) == auto.apply_chat_template(
        msgs, add_generation_prompt=True)
    assert (fast.eos_token_id, fast.bos_token_id, fast.pad_token_id) == (auto.eos_token_id, auto.bos_token_id,
                                                                        auto.pad_token_id)


def test_light_load_gives_the_logits_transformers_load_gives(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    light = LlamaRunner.from_pretrained(folder, dtype=torch.float32, max_num_seqs=1, max_len=64)
    heavy = LlamaRunner(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(),
                        dtype=torch.float32, max_num_seqs=1, max_len=64)
    ids = [1, 504, 3458, 282, 4707, 314, 253, 4632, 30]
    assert torch.equal(light.prefill(0, ids, 0), heavy.prefill(0, ids, 0))
    assert torch.equal(light.cos, heavy.cos) and torch.equal(light.sin, heavy.sin)


def test_lazy_zeros_are_zero_and_writable() -> None:
    t = lazy_zeros((4, 3, 512, 64), torch.bfloat16)  # 786 KiB: a plain torch.zeros
    big = lazy_zeros((16, 3, 2048, 64), torch.bfloat16)  # 12 MiB: mapped
    assert t.dtype == big.dtype == torch.bfloat16 and big.shape == (16, 3, 2048, 64)
    assert not big.any() and not t.any()
    big[3, 1, 100:110] = 2.5
    assert float(big.sum()) == 2.5 * 10 * 64 and big.is_contiguous()


def test_load_phases_account_wall_and_cpu() -> None:
    p = LoadPhases()
    sum(i * i for i in range(200_000))
    p.mark("work")
    p.mark("nothing")
    assert set(p.seconds) == set(p.cpu_seconds) == {"work", "nothing"}
    assert p.cpu_seconds["work"] > 0 and "work" in p.describe()


def test_grammar_compiler_builds_its_tokenizer_in_the_background(folder: Path) -> None:
    from data_plane.shard.engines.grammar import GrammarKind, GrammarSpec

    tok = load_tokenizer(folder)

    def build() -> object:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tok)

    compiler = GrammarCompiler.lazy(build)
    try:
        compiled = asyncio.run(compiler.compile(GrammarSpec(GrammarKind.REGEX, "[0-9]+")))
        assert compiled is not None and compiler.tokenizer.vocab_size >= 49152
    finally:
        compiler.close()
