"""The pipeline group's store bound to the cluster token (data_plane/shard/engines/pipeline_store.py),
in-process against a real TCPStore; tests/data_plane/test_pipeline_join.py runs real stage processes.

    .venv/bin/python -m pytest tests/data_plane/test_pipeline_store.py -q
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from data_plane.common.http_server import free_port
from data_plane.shard.engines.pipeline_store import GroupStore, StoreRefused

SPEC = '["--layers", "15:30", "--model", "/models/secret-finetune"]'


@pytest.fixture()
def group() -> GroupStore:
    return GroupStore.serve("127.0.0.1", free_port(), 2, "s3cret", 10)


def _port(store: GroupStore) -> int:
    return int(store.where.rpartition(":")[2])


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} spell them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_the_store_listens_on_its_host_alone(group: GroupStore) -> None:
    """torch's TCPStore server listens on every interface (`*`) whatever host it is given: a pipeline
    shard's store on 127.0.0.1 was reachable from the network (keys deleted or overwritten, a stage's
    heartbeat among them, by anyone). It listens on 127.0.0.1 only, and still serves there."""
    assert _listening_addresses(_port(group)) == {"0100007F"}  # 127.0.0.1, nothing on 0.0.0.0 or ::
    group.set("spec/1", SPEC)
    assert GroupStore.connect("127.0.0.1", _port(group), "s3cret", 10).get("spec/1").decode() == SPEC


def test_a_stage_with_the_token_reads_what_stage_zero_wrote(group: GroupStore) -> None:
    group.set("spec/1", SPEC)
    stage = GroupStore.connect("127.0.0.1", _port(group), "s3cret", 10)
    assert stage.get("spec/1").decode() == SPEC
    stage.set("links/1", "127.0.0.1:4242")
    assert group.get("links/1") == b"127.0.0.1:4242"


@pytest.mark.parametrize("token", ["guess", None])
def test_a_wrong_or_missing_token_reads_nothing_and_is_refused_at_once(group: GroupStore, token: str | None) -> None:
    group.set("spec/1", SPEC)
    stage = GroupStore.connect("127.0.0.1", _port(group), token, 10)
    with pytest.raises(StoreRefused, match="SWITCHBOARD_CLUSTER_TOKEN differs from stage 0's"):
        stage.get("spec/1")
    # a plain TCPStore client lists the keys (so no key name could stay secret), but no value reads
    raw = dist.TCPStore("127.0.0.1", _port(group), None, False, timeout=timedelta(seconds=5))
    assert "spec/1" in raw.list_keys()
    assert b"secret-finetune" not in raw.get("spec/1") and b"15:30" not in raw.get("spec/1")


def _landed(writer: dist.TCPStore) -> None:
    """A TCPStore client's set does not wait for the server: one round trip on the same connection
    (answered in order) makes it visible to another client. Without it, on a loaded host, the reader
    could look first (beat_count -1 after two beats, under the AVX2 emulation with a core held)."""
    writer.check(["hb/1"])


def test_a_forged_moved_or_replayed_value_does_not_count(group: GroupStore) -> None:
    raw = dist.TCPStore("127.0.0.1", _port(group), None, False, timeout=timedelta(seconds=5))
    stage = GroupStore.connect("127.0.0.1", _port(group), "s3cret", 10)
    assert group.beat_count(1) == -1
    stage.beat(1, 1)
    stage.beat(1, 2)
    _landed(stage.store)
    assert group.beat_count(1) == 2
    recorded = raw.get("hb/1")
    raw.set("hb/1", b"\x00" * 40)  # forged by a process without the token: no beat
    _landed(raw)
    assert group.beat_count(1) == 2
    stage.beat(1, 3)
    _landed(stage.store)
    assert group.beat_count(1) == 3
    raw.set("hb/1", recorded)  # an old beat replayed: the counter does not move back or forward
    _landed(raw)
    assert group.beat_count(1) == 3
    stage.set("links/2", "10.0.0.9:1")
    raw.set("links/1", raw.get("links/2"))  # a sealed value moved under another name does not open
    with pytest.raises(StoreRefused):
        group.get("links/1")
