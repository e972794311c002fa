"""A model folder's config, tokenizer, rotary tables and dense weights read without transformers'
model classes, and a KV allocation that costs nothing until used: what makes a shard start fast.

    cfg = read_config(folder)              # LightConfig, or None: use AutoConfig (an unknown layout)
    tok = load_tokenizer(folder)           # the fast tokenizer, without AutoConfig
    cos, sin = default_rope(cfg, max_len)  # float32 [max_len, head_dim]; None for scaled rope variants
    state = read_dense(folder, torch.bfloat16)   # model.safetensors as a state dict, or None
    state = read_dense(folder, torch.float32, keep=stage_tensors(15, 30, head=False))  # a stage's tensors only
    kv = lazy_zeros((16, 3, 2048, 64), torch.bfloat16)

Why: a shard's start-up was mostly imports and page faults, not work (`switchboard bench coldstart`,
data_plane/bench/coldstart.py). `AutoConfig` / `AutoTokenizer` import the model family's config
module, which pulls torch.distributed.tensor, accelerate and sympy through transformers' loading
helpers; building even a weightless (meta) model imports the modeling module and with it
torch._dynamo and the generation utilities. A Llama-shaped folder needs none of that: its
config.json, tokenizer.json and model.safetensors are read directly. Anything else (a sharded
checkpoint, a rope scaling variant, a tokenizer class of its own) falls back to transformers, so
every model that loaded before still loads. `lazy_zeros` maps anonymous memory: the kernel hands
out zero pages on first touch, so a 755 MiB KV cache costs no start-up time and only the slots
used ever become resident.
"""

from __future__ import annotations

import json
import math
import mmap
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

LLAMA_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 2048,
    "eos_token_id": None, "bos_token_id": None,
}
"""LlamaConfig's defaults for the fields the engine reads that a config.json may omit."""
LIGHT_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
FAST_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
LAZY_ZEROS_MIN_BYTES = 1 << 20


class LoadPhases:
    """Where a load's time went: `mark(name)` closes the phase that began at the previous mark.

        phases = LoadPhases(); ...; phases.mark("tokenizer"); ...; phases.mark("weights")
        phases.seconds            # {"tokenizer": 0.21, "weights": 0.93}: wall clock
        phases.cpu_seconds        # the process's CPU time in each (less stretched by a loaded host)
    """

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._last_cpu = time.process_time()
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now, cpu = time.monotonic(), time.process_time()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu

    def describe(self) -> str:
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())


class Weightless:
    """A model seen through its config only (LlamaRunner reads `.config`; the weights come from a
    WeightBuilder and the rotary tables from `default_rope`)."""

    def __init__(self, config: Any) -> None:
        self.config = config


def read_config(folder: Path) -> SimpleNamespace | None:
    """config.json as attributes (with Llama's defaults), or None when transformers must read it."""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if raw.get("model_type") not in LIGHT_MODEL_TYPES:
        return None
    if any(k not in raw for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")):
        return None
    cfg = {**LLAMA_DEFAULTS, **raw}
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg["num_key_value_heads"] = cfg["num_key_value_heads"] or cfg["num_attention_heads"]
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["head_dim"] = cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.setdefault("architectures", None)
    return SimpleNamespace(**cfg)


def rope_theta(cfg: Any) -> float | None:
    """The base of a plain (unscaled) rotary embedding, or None for a scaled variant (llama3, yarn, ...)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        return None
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    return float(theta) if theta is not None else 10000.0


def default_rope(cfg: Any, max_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin [max_len, head_dim] in float32, computed as transformers' default rotary module
    does (the same ops in the same order, so the tables are bit-identical); None for scaled variants."""
    theta = rope_theta(cfg)
    if theta is None:
        return None
    dim = int(cfg.head_dim)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    pos = torch.arange(max_len).unsqueeze(0)
    freqs = pos[..., None].float() * inv_freq.to(dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * 1.0)[0], (emb.sin() * 1.0)[0]


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer: the fast (tokenizers) class directly when tokenizer_config.json names
    it, else AutoTokenizer (which reads the model's config to pick a class)."""
    try:
        cls = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls in FAST_TOKENIZER_CLASSES and (folder / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def read_dense(folder: Path, dtype: torch.dtype,
               keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor] | None:
    """A single-file safetensors checkpoint as a state dict in `dtype`, or None (sharded or absent:
    transformers loads it). `keep`: read only the tensors it accepts (a pipeline stage's layers,
    `stage_tensors`); the others are never read from the file."""
    path = folder / "model.safetensors"
    if not path.exists():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = [k for k in f.keys() if keep is None or keep(k)]  # noqa: SIM118 - safe_open has no iterator
        # Copies: a tensor left a view of the file would keep all of its mapped pages resident.
        return {k: f.get_tensor(k).to(dtype, copy=True) for k in names}


def stage_tensors(first: int, end: int, *, head: bool) -> Callable[[str], bool]:
    """Which checkpoint tensors a runner of layers [first, end) reads: its layers' and, with `head`
    (a pipeline's stage 0, which embeds and applies the norm and LM head), the embedding, final
    norm and head. Tensors of no layer and not those three (rotary buffers) are read by every stage."""
    tops = ("model.embed_tokens.", "model.norm.", "lm_head.")

    def keep(name: str) -> bool:
        if name.startswith("model.layers."):
            return first <= int(name.split(".", 3)[2]) < end
        return head or not name.startswith(tops)

    return keep


def read_tables(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Just the named tensors of a single-file safetensors checkpoint, in its dtype (absent ones left out)."""
    path = folder / "model.safetensors"
    if not path.exists():
        return {}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        # Copies, as read_dense: a view of the file would keep its mapped pages resident.
        return {n: f.get_tensor(n).clone() for n in names if n in f.keys()}  # noqa: SIM118 (no __contains__)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the kernel supplies on first touch (anonymous mmap), so allocating
    it is instant and untouched parts use no memory; small ones are plain `torch.zeros`."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if size < LAZY_ZEROS_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, size)  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=dtype).view(shape)
