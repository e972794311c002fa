"""One writer at a time per stored conversation on this gateway: the lock that stops lost turns.

    locks = RecordLocks()
    await locks.acquire("conv_...", wait_s=5.0, generation=True)  # 400 conversation_locked: another turn holds it
    ...load the record, generate, save it...
    locks.release("conv_...")

Why: a conversation (Responses API), and a chat session (X-Session-Id), is stored as one whole record
on the cache nodes, rewritten on every turn: load it, append the turn, save it with version + 1. Two
requests on one conversation at once both load version v and both save v + 1; the nodes keep the
last of two equal versions, so one turn (its input and the model's reply) vanished while both
clients were told 200. OpenAI refuses the second request instead: 400 ``conversation_locked``,
"Another process is currently operating on this conversation. Please retry in a few seconds."
That is what this lock gives: a response in a conversation holds it from the load to the save (so
for the whole generation) and a second one is refused (after a quarter second's grace: the first one's
client may have just left, and then the second waits for its end); the conversation's item edits (add,
delete, metadata) and its background compaction hold it for milliseconds, and a turn or an edit
waits a few seconds for them; an edit is refused only when a generation holds the lock longer.

The lock is per gateway process; two gateways (zones, or several behind a load balancer) meet on the
cache nodes instead: a turn's save is written ``only_newer`` (data_plane/cache/client.py), to the first
replica that answers before the others, and that node refuses the second write of one version, which
:func:`lost_race` turns into the same 400 (after its generation, so a stream ends with it as an error
event): one turn stored, the other refused, none lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from data_plane.cache.model import VersionConflict
from data_plane.common.errors import InvalidRequest

ITEM_EDIT_WAIT_S = 5.0
"""How long an item edit waits for another write on its conversation before it is refused."""
GENERATION_GRACE_S = 0.25
"""How long a turn looks again before it is refused for another generation: a client that gave up on its
last turn (a timeout, a stop button) and sends the next at once reaches the lock ~1 ms before this process
has read the first connection's close (then `winding_down`), and was refused for its own abandoned turn."""
GRACE_POLL_S = 0.01


def record_key(owner: str, record_id: str) -> str:
    """The lock's key for a stored record: bound to its owner (the key's digest), so another key's
    request never contends for it."""
    return f"{owner}/{record_id}"


def locked_error(param: str) -> InvalidRequest:
    """OpenAI's answer to a second writer on a conversation."""
    return InvalidRequest("Another process is currently operating on this conversation. Please retry in a few "
                          "seconds.", param=param, code="conversation_locked")


@contextlib.contextmanager
def lost_race(param: str) -> Iterator[None]:
    """Around a turn's ``only_newer`` save: the cache's 409 (this version is stored already, another
    gateway's turn) is OpenAI's ``conversation_locked``, as the lock's own refusal is."""
    try:
        yield
    except VersionConflict:
        raise locked_error(param) from None


class RecordLocks:
    """Per-record locks, created on first use and dropped when nobody holds or waits for them (so
    the table never grows with the number of conversations ever written)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}
        self._generating: set[str] = set()
        """Records whose lock a generation holds (a second generation is refused without waiting)."""

    def __len__(self) -> int:
        return len(self._locks)

    async def acquire(self, record_id: str, *, wait_s: float, param: str = "conversation",
                      generation: bool = False) -> None:
        """Hold `record_id`'s lock, waiting at most `wait_s` (0: only if free now); else 400
        ``conversation_locked``. A `generation` (a turn that will rewrite the record) is refused while
        another generation holds it (after GENERATION_GRACE_S), and waits `wait_s` only for the short holders: an
        item edit, or the background compaction that may start the moment a turn is saved (a
        client that sends its next turn on reading the last one's end must not be refused for it)."""
        lock = self._locks.setdefault(record_id, asyncio.Lock())
        self._users[record_id] = self._users.get(record_id, 0) + 1
        try:
            if lock.locked() and wait_s > 0 and generation and record_id in self._generating:
                for _ in range(round(GENERATION_GRACE_S / GRACE_POLL_S)):  # its client may have just left
                    await asyncio.sleep(GRACE_POLL_S)
                    if not (lock.locked() and record_id in self._generating):
                        break
            if lock.locked() and (wait_s <= 0 or (generation and record_id in self._generating)):
                raise locked_error(param)
            await asyncio.wait_for(lock.acquire(), timeout=wait_s if wait_s > 0 else None)
            if generation:
                self._generating.add(record_id)
        except (TimeoutError, InvalidRequest):
            self._drop(record_id)
            raise locked_error(param) from None
        except BaseException:
            self._drop(record_id)
            raise

    def winding_down(self, record_id: str) -> None:
        """The generation holding `record_id` lost its client and is ending: the next turn waits for it
        (up to its `wait_s`) instead of being refused for a turn its client abandoned (an app that stops a
        stream and sends the next turn at once was refused for ~0.1-0.4 s while the first one wound down)."""
        self._generating.discard(record_id)

    def release(self, record_id: str) -> None:
        self._generating.discard(record_id)
        lock = self._locks.get(record_id)
        if lock is not None and lock.locked():
            lock.release()
        self._drop(record_id)

    def _drop(self, record_id: str) -> None:
        left = self._users.get(record_id, 1) - 1
        if left > 0:
            self._users[record_id] = left
            return
        self._users.pop(record_id, None)
        self._locks.pop(record_id, None)
