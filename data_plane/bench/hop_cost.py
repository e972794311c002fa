"""`switchboard bench hops`: what moving one step's hidden state between two local processes costs.

    switchboard bench hops                                    # 576 floats x rows 1,16, fp32
    switchboard bench hops --hidden 576 --rows 1,16,256 --repeats 200 --json /tmp/hops.json
    switchboard bench hops --host 10.201.0.1 --peer "ip netns exec sbz-h1" --bind 10.201.1.2   # over a link

Two processes on this host join a torch.distributed gloo group (a TCPStore on 127.0.0.1, the way
a pipeline group does: data_plane/shard/engines/pipeline.py) and time, for each row count,
the median of:
- `gloo send/recv` (ping-pong / 2): one hop of a ``[rows, hidden]`` tensor over torch.distributed;
- `link send/recv`: the same over the pipeline's own wire (a TCP connection a pair of stages,
  data_plane/shard/engines/pipeline_links.py), what pipeline parallelism pays per stage boundary
  per step;
- `all-reduce`: one gloo all-reduce of the same tensor, what tensor parallelism pays twice per
  layer per step (after attention and after the MLP).
It also prints what tensor parallelism would add to one decode step for a model of `--layers`
layers (2 all-reduces a layer), the figure docs/SHARDING.md weighs against a decode step.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

from data_plane.bench.common import fmt, format_table, machine_info, parse_int_list, write_json


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, hidden: int, rows: list[int], repeats: int, out: Any,
            host: str = "127.0.0.1", bind: str = "127.0.0.1") -> None:
    import torch
    import torch.distributed as dist

    from data_plane.shard.engines.pipeline_links import Links
    from data_plane.shard.engines.pipeline_net import use_interface_of

    torch.set_num_threads(1)
    use_interface_of(bind)  # gloo on this address's interface, as a pipeline stage does
    store = dist.TCPStore(host, port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    links = Links.join(store, rank, 2, bind, timeout_s=30)  # the pipeline's own wire (pipeline_links.py)
    results = []
    for n in rows:
        x = torch.randn(n, hidden)
        y = torch.empty(n, hidden)
        hop, red, link = [], [], []
        for i in range(repeats + 5):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(y, 1)
            else:
                dist.recv(y, 0)
                dist.send(y, 0)
            t1 = time.perf_counter()
            dist.all_reduce(x)
            t2 = time.perf_counter()
            if rank == 0:
                links.isend(x, 1).wait()
                links.recv(y, 1)
            else:
                links.recv(y, 0)
                links.send(y, 0)
            t3 = time.perf_counter()
            if i >= 5:  # warm-up: connection setup, buffers
                hop.append((t1 - t0) / 2)
                red.append(t2 - t1)
                link.append((t3 - t2) / 2)
        results.append({"rows": n, "bytes": n * hidden * 4, "hop_ms": 1000 * statistics.median(hop),
                        "link_ms": 1000 * statistics.median(link), "allreduce_ms": 1000 * statistics.median(red)})
    if rank == 0 and out is not None:
        out.put(results)
    links.close()
    dist.destroy_process_group()


def measure(hidden: int, rows: list[int], repeats: int, host: str = "127.0.0.1",
            peer: list[str] | None = None, peer_addr: str = "127.0.0.1") -> list[dict[str, Any]]:
    """Rank 0 here on `host`; rank 1 beside it, or run under `peer` (a command prefix such as
    ``ip netns exec h1``: another host) bound to `peer_addr`."""
    import multiprocessing as mp
    import subprocess
    import sys

    ctx = mp.get_context("spawn")
    port = _free_port()
    q = ctx.Queue()
    zero = ctx.Process(target=_worker, args=(0, port, hidden, rows, repeats, q, host, host))
    zero.start()
    if peer:
        one: Any = subprocess.Popen([*peer, sys.executable, "-m", "data_plane.bench.hop_cost", "--peer-rank-1",
                                     f"{host}:{port}", "--bind", peer_addr, "--hidden", str(hidden),
                                     "--rows", ",".join(map(str, rows)), "--repeats", str(repeats)])
    else:
        one = ctx.Process(target=_worker, args=(1, port, hidden, rows, repeats, q))
        one.start()
    got: list[dict[str, Any]] = q.get(timeout=600)
    zero.join(30)
    if peer:
        one.wait(30)
    else:
        one.join(30)
    return got


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="switchboard bench hops", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576, help="floats a row (SmolLM2-135M: 576)")
    ap.add_argument("--rows", type=parse_int_list, default=[1, 16], help="rows a step (tokens in the batch)")
    ap.add_argument("--layers", type=int, default=30, help="layers, for the tensor-parallel cost a step")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--host", default="127.0.0.1", help="rank 0's address (the TCPStore, its gloo device)")
    ap.add_argument("--peer", default="", help="command prefix rank 1 runs under, e.g. 'ip netns exec h1' "
                    "(another host: tests/reliability/netns.py makes such hosts)")
    ap.add_argument("--bind", default="127.0.0.1", help="rank 1's own address (with --peer)")
    ap.add_argument("--peer-rank-1", default="", help=argparse.SUPPRESS)  # HOST:PORT: run as rank 1 (internal)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.peer_rank_1:
        host, _, port = args.peer_rank_1.rpartition(":")
        _worker(1, int(port), args.hidden, args.rows, args.repeats, None, host, args.bind)
        return
    rows = measure(args.hidden, args.rows, args.repeats, args.host, args.peer.split() or None, args.bind)
    table = [[str(r["rows"]), str(r["bytes"]), fmt(r["hop_ms"], 3), fmt(r["link_ms"], 3), fmt(r["allreduce_ms"], 3),
              fmt(r["allreduce_ms"] * 2 * args.layers, 1)] for r in rows]
    print(format_table(["rows", "bytes", "gloo send/recv ms", "link send/recv ms", "all-reduce ms",
                        f"TP all-reduces a step ms ({args.layers} layers x 2)"], table))
    if args.json:
        write_json(args.json, {"machine": machine_info(), "hidden": args.hidden, "layers": args.layers, "rows": rows,
                               "host": args.host, "peer": args.peer, "bind": args.bind})


if __name__ == "__main__":
    main()
