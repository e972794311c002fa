"""One request inside the torch engine: its status and its one computed-token count.

    seq = SeqState(req, max_tokens=32, sink=sink, stream=TextStream(decode, ()), draws=None)
    seq.status                 # SeqStatus.WAITING -> RUNNING (-> PARKED -> RUNNING) -> FINISHED_*
    seq.num_computed_tokens    # tokens whose KV is in the sequence's slot
    seq.prefilling             # RUNNING with prompt tokens still to compute (the chunked prefill)

Built by the engine (data_plane/shard/engines/torch_engine.py) when a request arrives; planned by
the scheduler (scheduler.py), run by the executor (torch_executor.py), updated by the output
processor (torch_output.py). vLLM v1's `Request` is the model: no prefill or decode *phase* is
stored, `num_computed_tokens` catches up with the tokens (prompt + output). A RUNNING sequence
whose count is below its prompt length is being prefilled; once the prompt is in, the last
sampled token is the one not yet in the KV, so a decoding sequence always has
``num_computed_tokens == num_tokens - 1``. Where it sits (slot) and what it is (status) are
fields, not membership of some list. Neither this module nor the scheduler imports torch (an
import contract in pyproject.toml holds it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from data_plane.shard.engines.base import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

if TYPE_CHECKING:
    from data_plane.shard.engines.base import GenerationOutput, GenerationRequest, TextStream


class SeqStatus(enum.Enum):
    """vLLM's RequestStatus, with PARKED for a chunked prefill preempted by a higher priority
    (its slot and KV kept, resumed where it stopped: nothing is recomputed)."""

    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in FINISH_REASONS

    @property
    def finish_reason(self) -> str:
        return FINISH_REASONS[self]


FINISH_REASONS = {SeqStatus.FINISHED_STOPPED: FINISH_STOP, SeqStatus.FINISHED_LENGTH: FINISH_LENGTH,
                  SeqStatus.FINISHED_ABORTED: FINISH_ABORT}
STATUS_OF_REASON = {reason: status for status, reason in FINISH_REASONS.items()}


@dataclass(eq=False)
class SeqState:
    """One request inside the engine, from arrival to finish (scheduler thread only, but `status`
    which the event loop may read). Compared by identity."""

    req: GenerationRequest
    max_tokens: int
    sink: Callable[[GenerationOutput | BaseException], None]
    stream: TextStream
    draws: Any  # torch_sampling.Draws | None (None: greedy; typed loosely: this module never imports torch)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the slot
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    last_token: int = -1  # the last sampled token (an EOS is sampled but never appended to output_ids)
    admitted_at: float = 0.0
    prefill_done_at: float = 0.0
    first_token_at: float | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    held: list[int] = field(default_factory=list)  # prefix-cache blocks referenced by this sequence
    spec: Any = None  # speculation.SeqSpec (torch_spec.py), when drafting is on
    spec_ctx: list[int] = field(default_factory=list)  # prompt + output, append-only, for the n-gram index
    prompt_logprobs: list[Any] | None = None  # base.TokenLogprob | None per prompt token so far (prompt_logprobs.py)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def priority(self) -> int:
        return self.req.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def position(self) -> int:
        """The output position sampled next (an EOS, never appended, ends the sequence)."""
        return len(self.output_ids)

    def draw(self) -> Any:
        """The generator for the token sampled next (torch_sampling.Draws.at), None for greedy."""
        return None if self.draws is None else self.draws.at(self.position)

    @property
    def prefilling(self) -> bool:
        """Prompt tokens are still to be computed (RUNNING or PARKED)."""
        return self.num_computed_tokens < len(self.req.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    # Names the engine's tests and listeners read (the old engine kept these as counters).
    @property
    def prefilled(self) -> int:
        """Prompt tokens in the KV."""
        return min(self.num_computed_tokens, len(self.req.prompt_ids))
