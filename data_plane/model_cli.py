"""`switchboard model prepare [--model PATH]`: convert a model once, ahead of serving (the dense safetensors
copy, and for a Q4/Q8 GGUF its blocks unpacked for the int4/int8 formats: prepared_weights.py; the
blockq kernel built for this CPU: blockq.py).

    switchboard model prepare            # the default SmolLM2-135M-Instruct GGUF
    switchboard model prepare --model /m/llama.gguf
"""

from __future__ import annotations

import argparse
import sys

from data_plane.model_store import ModelNotAvailable, model_source


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="switchboard model")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="convert a GGUF to a cached safetensors folder")
    prep.add_argument("--model", default=None, help="local HF folder or GGUF file (default: SmolLM2)")
    args = parser.parse_args(argv)
    try:
        src = model_source(args.model)
    except ModelNotAvailable as exc:
        print(f"switchboard: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if src.gguf is not None and src.kind in ("q4", "q8"):
        # The quantized formats' weights, unpacked once: a quantized shard then starts as fast as a dense one.
        from transformers import AutoConfig

        from data_plane.shard.engines.prepared_weights import load_or_prepare

        cfg = AutoConfig.from_pretrained(str(src.path))
        load_or_prepare(src.gguf, src.path, cfg.num_attention_heads,
                        getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        # The block-quantized kernel, built now so the first shard does not compile it (blockq.py).
        from data_plane.shard.engines import blockq

        kernel = blockq.load()
        print(f"blockq: {kernel.isa_name if kernel else 'unavailable (torch kernels serve quantized weights)'}",
              file=sys.stderr)
    print(src.path)
