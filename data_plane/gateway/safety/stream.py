"""The streaming output filter: release every character that cannot become part of a blocked match.

    stream = policy.output_stream()          # an OutputStreamFilter over the policy's output filters
    for delta in deltas:
        send(stream.feed(delta))             # what is safe to emit now ("" while held)
        if stream.verdict is not None:       # blocked: the gateway ends with "content_filter"
            break
    else:
        send(stream.finish())                # the checked tail

Used by the gateway (``data_plane.gateway.stream``) for every reply, streamed or not.

What is held back, and for how long. After each delta the stream asks every filter where a
match could still begin (``possible_start``: the ``regex`` package's partial matching) and
releases everything before the earliest such place. Benign text therefore goes out in the same
call it arrives in; ``"The answer is 4"`` holds only ``"4"`` (it may start a card number)
until the next character shows it does not. Besides that, a *complete* match counts only once
two characters follow it (so ``bomb`` is not taken for ``bombshell``): its text stays held for
those two characters. When a filter blocks, at most the text before the match is released and
:attr:`OutputStreamFilter.verdict` is set.

The bounded worst case, by rule: a possible match is held for at most ``window`` characters
(the policy's ``window``, 64 by default). A tail that still "looks like a beginning" after
``window`` characters (say ``how to`` followed by endless spaces) is released; if it does
become a match later, the stream still blocks then, but what was released stays sent. So a
match no longer than ``window`` is never partly sent; keep phrases shorter than the window.
A filter without ``possible_start`` (a third-party strategy) gets the conservative fallback:
the last ``window`` + 2 characters stay held while it is in the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence

from data_plane.gateway.safety.filters import RIGHT_CONTEXT, Filter, Match, PrefixAware, Verdict

DEFAULT_WINDOW = 64
"""Characters a possible match may be held by default: a bound on the longest blockable match."""


def first_block(
    filters: Sequence[Filter], text: str, decided_end: int, start: int = 0
) -> tuple[Match | None, int]:
    """The leftmost match at or after ``start`` over all filters that ends by ``decided_end``,
    and the start of the leftmost undecided match before it (``len(text)`` if none): text
    before both is safe to release."""
    best: Match | None = None
    undecided = len(text)
    for f in filters:
        pos = start
        while (m := f.find(text, pos)) is not None:
            if m.end <= decided_end:
                if best is None or m.start < best.start:
                    best = m
                break
            undecided = min(undecided, m.start)
            pos = m.start + 1  # an undecided match near the end: look for a decided one after it
    return best, undecided


class OutputStreamFilter:
    """Filters a stream of output deltas, holding back only what could still become a match.

        stream = OutputStreamFilter([RuleSet({...}), PiiFilter()], window=64)
        safe = stream.feed(delta)   # may be "" while a possible match is held
        tail = stream.finish()      # once the upstream stream ends (unless already blocked)

    After a block, :attr:`verdict` is set, the held text is dropped and ``feed``/``finish``
    return "". Every character :meth:`feed` returns stays emitted, so the stream only grows.
    :attr:`max_held` is the most characters held at once (a span attribute at the gateway).
    """

    def __init__(self, filters: Sequence[Filter], window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._filters = tuple(filters)
        self._aware = tuple(f for f in self._filters if isinstance(f, PrefixAware))
        self._blind_hold = window + RIGHT_CONTEXT if len(self._aware) < len(self._filters) else 0
        self._window = window
        # The tail of released text. Matches are looked for from its last `window` characters
        # on, so each candidate sees `window` characters of true left context (lookbehinds,
        # word boundaries) instead of an artificial start of text.
        self._context = ""
        self._pending = ""
        self._finished = False
        self.verdict: Verdict | None = None
        self.max_held = 0

    def feed(self, delta: str) -> str:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self.verdict is not None or not delta:
            return ""
        if not self._filters:
            return delta  # nothing to hold back for
        self._pending += delta
        return self._advance(final=False)

    def finish(self) -> str:
        if self._finished:
            return ""
        self._finished = True
        if self.verdict is not None:
            return ""
        return self._advance(final=True)

    def _possible_start(self, region: str, search_from: int) -> int:
        """Where a match could still begin in the region's tail (len(region) if nowhere), looking
        no further back than ``window`` characters: the bounded worst case."""
        n = len(region)
        earliest = n
        pos = max(search_from, n - self._window)
        for f in self._aware:
            at = f.possible_start(region, pos)
            if at is not None and at < earliest:
                earliest = at
        return earliest

    def _advance(self, final: bool) -> str:
        off = len(self._context)
        region = self._context + self._pending
        n = len(region)
        decided_end = n if final else n - RIGHT_CONTEXT
        search_from = max(0, off - self._window)
        block, undecided = first_block(self._filters, region, decided_end, search_from)
        cut = n
        if not final:
            # a complete match still waiting for its right context stays held, whatever its length
            cut = min(undecided, self._possible_start(region, search_from), n - self._blind_hold)
        if block is not None:
            self.verdict = block.verdict
            self._pending = ""
            # A match that began in released text (past the window) releases nothing more.
            return region[off : max(off, min(cut, block.start))]
        cut = max(off, cut)
        out = region[off:cut]
        self._pending = region[cut:]
        self.max_held = max(self.max_held, len(self._pending))
        self._context = (self._context + out)[-2 * self._window :]
        return out
