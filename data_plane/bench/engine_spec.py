"""Speculative decoding in `switchboard bench engine`: the quote workload and the acceptance report.

    switchboard bench engine --workload quote --speculation on,off --concurrency 1,16 --max-tokens 64
    prompts = workload_prompts("quote")        # texts; engine.encode_prompts templates them
    counter = AcceptanceCounter()              # a StepListener: TorchEngine(config, counter)
    row.update(counter.report()); counter.reset()

`quote` asks the model to summarise, rewrite or edit a passage or code given in the prompt, so the
reply repeats the prompt (where n-gram drafts pay); `chat` is the open-ended PROMPTS. The
report: acceptance rate (accepted / draft tokens), mean accepted length (1 + accepted / drafts:
tokens a drafting step yields), and per draft position the share of drafts accepted there.
"""

from __future__ import annotations

from typing import Any

from data_plane.bench.common import PROMPTS
from data_plane.shard.engines.pipeline import PassTiming
from data_plane.shard.engines.torch_engine import StepListener

_CODE = '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments and blank lines."""
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result
'''
_PASSAGE = ("The printing press, developed by Johannes Gutenberg around 1440, made books cheaper and faster "
            "to produce. Before it, scribes copied texts by hand, which took months for a single book. "
            "Within fifty years, presses in more than two hundred European cities had printed millions of "
            "volumes, and literacy, science and religious debate spread faster than ever before.")
_BIKE = ("To adjust a rear derailleur, shift to the smallest cog, loosen the cable bolt, and set the high "
         "limit screw so the jockey wheel lines up with the cog. Pull the cable tight, tighten the bolt, "
         "then shift to the largest cog and set the low limit screw. Finally, turn the barrel adjuster "
         "until every shift is quick and quiet.")

QUOTE_PROMPTS: tuple[str, ...] = (
    "Rename the function below to load_settings and change nothing else. Reply with the full code.\n\n" + _CODE,
    "Add type hints to this function and reply with the complete code:\n\n" + _CODE,
    "Copy this paragraph exactly, fixing only typos:\n\n" + _PASSAGE,
    "Rewrite the following instructions as a numbered list, keeping the wording:\n\n" + _BIKE,
    "Summarise this paragraph, quoting its key sentences:\n\n" + _PASSAGE,
    "Repeat the following code, adding a comment above the return statement:\n\n" + _CODE,
    "Edit this text so that it is in the past tense; otherwise keep it as it is:\n\n" + _BIKE,
    "Quote the first two sentences of this paragraph, then explain them:\n\n" + _PASSAGE,
)
"""Prompts whose reply repeats the prompt: summarise, rewrite or edit a given passage or code."""

WORKLOADS = {"chat": PROMPTS, "quote": QUOTE_PROMPTS}


def workload_prompts(workload: str) -> tuple[str, ...]:
    return WORKLOADS[workload]


class AcceptanceCounter(StepListener):
    """Counts what the engine's speculation hooks report (called on the scheduler thread)."""

    def __init__(self) -> None:
        self.threads = 0  # intra-op threads the engine set last (on_threads: at start, then each switch)
        self.thread_switches = 0
        self.reset()

    def on_threads(self, threads: int, reason: str) -> None:
        self.threads = threads
        self.thread_switches += reason == "probe"

    def reset(self) -> None:
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.per_pos: dict[int, int] = {}
        self.steps = 0
        self.step_tokens = 0
        self.stage_busy: list[float] = []  # pipeline: each stage's compute seconds
        self.active_s = 0.0  # pipeline: wall seconds with a pass in flight (overlap counted once)
        self.max_in_flight = 0
        self.max_steps_in_flight = 0  # pipeline: the batch queue's plans in flight at most

    def on_pipeline_pass(self, timing: PassTiming) -> None:
        """The shard's pipeline metrics' inputs (stage_step_seconds, active_seconds, passes_in_flight)."""
        if not self.stage_busy:
            self.stage_busy = [0.0] * len(timing.step_s)
        for i, busy in enumerate(timing.step_s):
            self.stage_busy[i] += busy
        self.active_s += timing.active_s
        self.max_in_flight = max(self.max_in_flight, timing.in_flight)

    def on_batch_sent(self, in_flight: int, decode: bool) -> None:
        self.max_steps_in_flight = max(self.max_steps_in_flight, in_flight)

    def on_spec_draft(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        for pos in range(accepted):
            self.per_pos[pos] = self.per_pos.get(pos, 0) + 1

    def on_iteration_tokens(self, tokens: int) -> None:
        self.steps += 1
        self.step_tokens += tokens

    def report(self) -> dict[str, Any]:
        d = self.drafts
        return {
            "spec_drafts": d,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else None,
            "mean_accepted_length": 1 + self.accepted / d if d else None,
            "accepted_per_pos": [self.per_pos.get(p, 0) / d for p in range(max(self.per_pos, default=-1) + 1)]
            if d else [],
            # 1 - stage compute / pipeline active time: each stage's idle (bubble) share, as the dashboard
            "pipeline_idle_share": [round(1 - b / self.active_s, 3) for b in self.stage_busy] if self.active_s else None,
            "pipeline_max_in_flight": self.max_in_flight or None,
            "pipeline_max_steps_in_flight": self.max_steps_in_flight or None,
        }
