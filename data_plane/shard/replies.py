"""What a shard says in OpenAI's shapes beside its choices (data_plane/shard/choices.py): its model card
and a generation's usage.

    card = model_card(engine, started)        # one entry of GET /v1/models
    usage = usage_of(output)                  # a GenerationOutput's `usage` object

The card names the engine's `system_fingerprint` (data_plane/shard/engines/fingerprint.py), the value every
body and chunk of this shard carries: where an operator reads which numerics a shard serves.
"""

from __future__ import annotations

from typing import Any

from data_plane.protocol import PromptTokensDetails, Usage
from data_plane.shard.engines.base import Engine, GenerationOutput


def model_card(engine: Engine, started: int) -> dict[str, Any]:
    """The served model as /v1/models lists it (`started`: the shard's start, unix seconds)."""
    return {"id": engine.model_name, "object": "model", "created": started, "owned_by": "switchboard",
            "max_model_len": engine.max_model_len, "system_fingerprint": engine.system_fingerprint or None}


def usage_of(out: GenerationOutput) -> Usage:
    return Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                 total_tokens=out.prompt_tokens + out.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.cached_tokens))
