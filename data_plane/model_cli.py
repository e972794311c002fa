"""`switchboard model prepare [--model PATH]`: convert a model once, ahead of serving.

    switchboard model prepare            # the default SmolLM2-135M-Instruct GGUF
    switchboard model prepare --model /m/llama.gguf
"""

from __future__ import annotations

import argparse
import sys

from data_plane.model_store import ModelNotAvailable, resolve_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="switchboard model")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="convert a GGUF to a cached safetensors folder")
    prep.add_argument("--model", default=None, help="local HF folder or GGUF file (default: SmolLM2)")
    args = parser.parse_args(argv)
    try:
        path = resolve_model(args.model)
    except ModelNotAvailable as exc:
        print(f"switchboard: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(path)
