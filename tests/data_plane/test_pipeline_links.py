"""The pipeline's wire (data_plane/shard/engines/pipeline_links.py) on real sockets: stages as threads
of this process, a real TCPStore for the rendezvous, loopback TCP between them.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_pipeline_links.py -q   # ~2 s
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from data_plane.shard.engines import pipeline_links
from data_plane.shard.engines.pipeline_links import Links, peers_of
from data_plane.shard.engines.pipeline_net import wire


def stores(world: int) -> list[Any]:
    master = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    return [master] + [dist.TCPStore("127.0.0.1", master.port, world, False, timeout=timedelta(seconds=10))
                       for _ in range(1, world)]


@contextmanager
def group(world: int, token: str | None = "s3cret") -> Iterator[list[Links]]:
    """`world` stages' links, joined concurrently the way stage processes join."""
    store = stores(world)
    out: list[Any] = [None] * world

    def join(rank: int) -> None:
        out[rank] = Links.join(store[rank], rank, world, "127.0.0.1", timeout_s=10, token=token)

    threads = [threading.Thread(target=join, args=(r,)) for r in reversed(range(world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(isinstance(x, Links) for x in out), "a stage failed to join"
    try:
        yield out
    finally:
        for links in out:
            links.close()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    return t, box


def test_peers_are_stage_zero_with_everyone_and_each_stage_with_the_next() -> None:
    assert peers_of(0, 4) == [1, 2, 3]
    assert peers_of(1, 4) == [0, 2]
    assert peers_of(2, 4) == [0, 1, 3]
    assert peers_of(3, 4) == [0, 2]
    assert peers_of(1, 2) == [0]
    with group(3) as (zero, one, two):
        assert sorted(zero.links) == [1, 2] and sorted(one.links) == [0, 2] and sorted(two.links) == [0, 1]


def test_messages_arrive_in_order_bit_exact_and_a_short_one_fills_the_front_of_a_larger_buffer() -> None:
    with group(2) as (zero, one):
        x = torch.randn(3, 576, dtype=torch.bfloat16)
        h = torch.arange(10, dtype=torch.long)
        works = [zero.isend(h, 1), zero.isend(wire(x), 1)]
        buf = torch.full((64,), -1, dtype=torch.long)
        one.recv(buf, 0)
        assert buf[:10].tolist() == list(range(10)) and buf[10:].eq(-1).all()
        got = torch.empty_like(x)
        one.recv(wire(got), 0)
        assert torch.equal(got.view(torch.int16), x.view(torch.int16))
        for w in works:
            w.wait()


def test_a_message_longer_than_the_buffer_is_an_error_not_a_silent_truncation() -> None:
    with group(2) as (zero, one):
        zero.send(torch.zeros(100, dtype=torch.long), 1)
        with pytest.raises(ConnectionError, match="800-byte message"):
            one.recv(torch.empty(10, dtype=torch.long), 0)


def test_isend_of_more_than_the_socket_buffers_hold_returns_at_once() -> None:
    """The deadlock gloo's isend avoids: stage 0 sends a long pass while its peer is busy sending
    rows back; neither side may block on its send."""
    with group(2) as (zero, one):
        big = torch.randn(64 << 20 // 4)  # 64 MiB: far past any socket buffer
        t0 = time.perf_counter()
        work = zero.isend(big, 1)
        assert time.perf_counter() - t0 < 1.0
        back = torch.arange(5, dtype=torch.long)
        one.send(back, 0)  # the peer sends before it receives
        got_back = torch.empty(5, dtype=torch.long)
        zero.recv(got_back, 1)
        assert got_back.tolist() == [0, 1, 2, 3, 4]
        recv = torch.empty_like(big)
        one.recv(recv, 0)
        work.wait()
        assert torch.equal(recv, big)


def test_irecvs_and_recvs_take_messages_in_the_order_sent() -> None:
    with group(2) as (zero, one):
        for k in range(3):
            zero.send(torch.full((4,), k, dtype=torch.long), 1)
        a, b, c = (torch.empty(4, dtype=torch.long) for _ in range(3))
        first = one.irecv(a, 0)
        second = one.irecv(b, 0)
        one.recv(c, 0)  # completes the two irecvs ahead of it first
        first.wait()
        second.wait()
        assert (a.tolist(), b.tolist(), c.tolist()) == ([0] * 4, [1] * 4, [2] * 4)


def test_a_chain_of_three_passes_a_frame_down_and_back_to_stage_zero() -> None:
    with group(3) as (zero, one, two):
        def middle() -> None:
            buf = torch.empty(8)
            one.recv(buf, 0)
            one.send(buf + 1, 2)

        def last() -> None:
            buf = torch.empty(8)
            two.recv(buf, 1)
            two.send(buf * 2, 0)

        workers = [in_thread(middle)[0], in_thread(last)[0]]
        zero.isend(torch.ones(8), 1).wait()
        out = torch.empty(8)
        zero.recv(out, 2)
        assert out.tolist() == [4.0] * 8
        for t in workers:
            t.join(5)


def test_a_peer_that_goes_away_ends_a_blocked_receive_at_once() -> None:
    with group(2) as (zero, one):
        t, box = in_thread(lambda: pytest.raises(ConnectionError, one.recv, torch.empty(4), 0))
        time.sleep(0.1)
        zero.links[1].close()  # stage 0 gone: end of stream, not a timeout
        t.join(5)
        assert not t.is_alive() and box, "the receive did not end when its peer went away"


def test_without_a_token_ranks_still_check_and_messages_flow() -> None:
    with group(2, token=None) as (zero, one):
        zero.send(torch.arange(3), 1)
        got = torch.empty(3, dtype=torch.long)
        one.recv(got, 0)
        assert got.tolist() == [0, 1, 2]


def test_a_stage_without_the_cluster_token_is_refused_and_the_real_one_still_joins() -> None:
    """An impostor (wrong SWITCHBOARD_CLUSTER_TOKEN) connecting first neither takes rank 1's place
    nor stops stage 0 from waiting for the real stage 1."""
    store = stores(2)
    zero_t, zero_box = in_thread(lambda: Links.join(store[0], 0, 2, "127.0.0.1", timeout_s=10, token="s3cret"))
    with pytest.raises(ConnectionError, match="refused stage 1"):
        Links.join(store[1], 1, 2, "127.0.0.1", timeout_s=10, token="guess")
    one = Links.join(store[1], 1, 2, "127.0.0.1", timeout_s=10, token="s3cret")
    zero_t.join(10)
    (zero,) = zero_box
    try:
        zero.send(torch.ones(2), 1)
        got = torch.empty(2)
        one.recv(got, 0)
        assert got.tolist() == [1.0, 1.0]
    finally:
        zero.close()
        one.close()


def test_stage_zero_stops_waiting_when_a_stage_is_gone() -> None:
    store = stores(2)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="stage 1 exited"):
        Links.join(store[0], 0, 2, "127.0.0.1", timeout_s=60, token=None, gone=lambda: "stage 1 exited (1)")
    assert time.monotonic() - t0 < 5


def test_an_irecv_is_read_as_soon_as_posted_so_a_large_send_to_stage_zero_completes() -> None:
    """A later stage's KV part (megabytes, past any socket buffer) sent with a blocking send while
    stage 0 has only posted its irecv: gloo reads it at once, so must a link."""
    with group(2) as (zero, one):
        part = torch.randn(16 << 20 // 4)  # 16 MiB
        got = torch.empty_like(part)
        work = zero.irecv(got, 1)
        def send() -> bool:
            one.send(part, 0)
            return True

        t, box = in_thread(send)
        t.join(10)
        assert box == [True], "the sender stayed blocked until stage 0 waited for its irecv"
        work.wait()
        assert torch.equal(got, part)


def test_a_silent_client_does_not_stall_the_join(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port scanner (or anything) that connects to stage 0's listener and never answers the nonce
    is dropped after the handshake's time limit; the real stage still joins."""
    monkeypatch.setattr(pipeline_links, "HANDSHAKE_S", 0.5)
    store = stores(2)
    zero_t, zero_box = in_thread(lambda: Links.join(store[0], 0, 2, "127.0.0.1", timeout_s=20, token="s3cret"))
    host, _, port = store[1].get("links/0").decode().rpartition(":")
    with socket.create_connection((host, int(port))):
        time.sleep(0.2)  # stage 0 is now in the silent client's handshake
        one = Links.join(store[1], 1, 2, "127.0.0.1", timeout_s=20, token="s3cret")
        zero_t.join(10)
    (zero,) = zero_box
    zero.close()
    one.close()


def test_a_listener_posing_as_a_stage_without_the_token_gets_no_connection() -> None:
    """The addresses come from the TCPStore, which takes no token: a party that rewrites
    ``links/0`` to its own listener and answers with the wrong token (it accepts, as an impostor
    would) is refused by the connecting stage, which closes and says so instead of sending it hidden
    states."""
    store = stores(2)
    impostor = socket.create_server(("127.0.0.1", 0))
    impostor.settimeout(10)
    store[0].set("links/0", f"127.0.0.1:{impostor.getsockname()[1]}")

    def pose() -> bytes:
        sock, _ = impostor.accept()
        with sock:
            sock.sendall(b"\0" * pipeline_links.NONCE_BYTES)
            answer = pipeline_links._read_exactly(sock, pipeline_links.ANSWER, time.monotonic() + 10)
            ours = answer[pipeline_links.LENGTH.size : pipeline_links.LENGTH.size + pipeline_links.NONCE_BYTES]
            sock.sendall(pipeline_links.ACCEPTED + pipeline_links.proof("guess", ours, 0, 1, pipeline_links.ACCEPTOR))
            sock.settimeout(5)
            return sock.recv(1 << 16)  # what the real stage sends after the handshake: nothing

    t, box = in_thread(pose)
    try:
        with pytest.raises(ConnectionError, match="could not prove the cluster token"):
            Links.join(store[1], 1, 2, "127.0.0.1", timeout_s=10, token="s3cret")
        t.join(10)
        assert box == [b""], "the stage sent data to a listener that failed the token check"
    finally:
        impostor.close()


def test_the_acceptors_proof_cannot_be_reflected_as_a_connectors() -> None:
    """Each side's proof is labelled with its role: the same nonce and ranks give different MACs."""
    nonce = bytes(range(pipeline_links.NONCE_BYTES))
    assert pipeline_links.proof("t", nonce, 0, 1) != pipeline_links.proof("t", nonce, 0, 1, pipeline_links.ACCEPTOR)


def test_a_polling_receive_takes_a_message_sent_during_the_poll_or_after_it_and_sees_a_peer_leave() -> None:
    """`poll_s` (pipeline_links.POLL_S: a lone pass on every core) polls the socket before sleeping in
    it: a message that comes while it polls, one that comes only after the poll gave up (the thread
    then sleeps, burning nothing), and a peer that leaves mid-poll all end the receive as a plain one."""
    with group(2) as (zero, one):
        for delay_s in (0.005, 0.4):  # inside a 0.05 s poll; after it
            buf = torch.zeros(4, dtype=torch.long)
            sender = threading.Timer(delay_s, lambda: zero.send(torch.tensor([7, 8, 9, 10]), 1))
            cpu0, t0 = time.process_time(), time.monotonic()
            sender.start()
            one.recv(buf, 0, poll_s=0.05)
            cpu, took = time.process_time() - cpu0, time.monotonic() - t0
            sender.join()
            assert buf.tolist() == [7, 8, 9, 10] and took >= delay_s
        assert cpu < 0.25, f"{cpu:.2f} s of CPU over a {took:.2f} s wait: the poll did not give up after 0.05 s"
        t, box = in_thread(lambda: pytest.raises(ConnectionError, one.recv, torch.zeros(4, dtype=torch.long), 0,
                                                 poll_s=5.0))
        time.sleep(0.05)  # polling now
        zero.links[1].close()
        t.join(2)
        assert not t.is_alive() and box, "a polling receive did not end when its peer went away"
