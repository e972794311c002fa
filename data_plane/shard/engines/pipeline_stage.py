"""A later stage of a pipeline-parallel torch shard (stage 1..N-1); stage 0 spawns it.

    python -m data_plane.shard.engines.pipeline_stage --rank 1 --world 2 --port 29500 \\
        --model /models/smollm2 --dtype float32 --max-num-seqs 16 --max-len 2048 --layers 15:30
    switchboard stage --join 10.0.0.1:29500 --rank 1 --bind 10.0.0.2     # from another host

A stage started by stage 0 is its child; one on another host joins with `--join` (stage 0 runs
`switchboard shard --pipeline-parallel-size 2 --pipeline-host 10.0.0.1 --pipeline-port 29500
--pipeline-remote-stages 1`) and takes every other argument from what stage 0 published in its
TCPStore; `--bind` is its own address, where it listens for its links (pipeline_links.py). Its
environment needs the cluster's SWITCHBOARD_CLUSTER_TOKEN: the store's values are sealed with it
(pipeline_store.py), so a stage without it, or with another, exits at its first read with one line,
before loading anything; and stage 0's links refuse it too.

It loads only its layers' weights (plus the rotary tables) and the KV cache of those layers,
connects its links to stage 0 and its neighbours (addresses from stage 0's TCPStore on
127.0.0.1:port), beats its heartbeat counter there, and
serves the chain (data_plane/shard/engines/pipeline.py): a FORWARD header and hidden states from
the previous stage -> its layers -> the next stage, or, on the last stage, the wanted rows back
to stage 0; a MOVE header moves a slot's KV and goes on down the chain; LOAD / STORE repeat stage 0's
prefix-cache copies on this stage's layers; INSERT (blocks fetched from the cache nodes) and GATHER
(a turn's blocks for them) move this stage's layers of whole blocks straight from / to stage 0. It dies with stage 0
(stage 0 starts it with data_plane/common/lifeline.py; a failed receive or heartbeat exits too).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

log = logging.getLogger("switchboard.pipeline_stage")


def joined(join: str, rank: int, bind: str, threads: int | None) -> list[str]:
    """The arguments of a stage joining from another host: what stage 0 published for `rank` in its
    TCPStore at `join` (HOST:PORT), with this host's own address (and threads) for its links. Read
    before anything is loaded or written: a missing or wrong cluster token is a one-line exit at once
    (pipeline_store.py), and the group is not touched."""
    from data_plane.common.hop_auth import CLUSTER_TOKEN_ENV, cluster_token_from_env
    from data_plane.shard.engines.pipeline_net import STORE_WAIT_S
    from data_plane.shard.engines.pipeline_store import GroupStore, StoreRefused

    token = cluster_token_from_env()
    if not token:
        raise SystemExit(f"switchboard stage: {CLUSTER_TOKEN_ENV} is not set: a stage joining a pipeline group must "
                         "prove the cluster's token (the cluster_token of stage 0's credentials)")
    host, _, port = join.rpartition(":")
    _await_group(host, int(port), rank, STORE_WAIT_S)
    try:
        store = GroupStore.connect(host, int(port), token, STORE_WAIT_S)
        args: list[str] = json.loads(store.get(f"spec/{rank}"))
    except StoreRefused as exc:
        raise SystemExit(f"switchboard stage: refused by the group at {join}: {exc}") from None
    args += ["--host", host, "--bind", bind]
    return args + (["--threads", str(threads)] if threads else [])


def _await_group(host: str, port: int, rank: int, wait_s: float, every_s: float = 30.0) -> None:
    """Until stage 0's group store at host:port takes a connection: a stage started first says what it
    waits for (at once, then every `every_s` seconds) instead of sitting silent, and gives up after
    `wait_s` with one line saying which command starts stage 0."""
    import socket

    t0 = last = time.monotonic()
    said = False
    while True:
        try:
            socket.create_connection((host, port), timeout=2.0).close()
            if said:
                print(f"switchboard stage: the group at {host}:{port} answered after {time.monotonic() - t0:.0f} s",
                      file=sys.stderr, flush=True)
            return
        except OSError:
            pass
        now = time.monotonic()
        if now - t0 >= wait_s:
            raise SystemExit(f"switchboard stage: no pipeline group at {host}:{port} after {wait_s:.0f} s: start "
                             f"stage 0 first (`switchboard shard --pipeline-parallel-size N --pipeline-host {host} "
                             f"--pipeline-port {port} --pipeline-remote-stages {rank}`)")
        if not said or now - last >= every_s:
            print(f"switchboard stage: waiting for stage 0's pipeline group at {host}:{port} to join as stage {rank} "
                  f"({now - t0:.0f} s; giving up after {wait_s:.0f} s)", file=sys.stderr, flush=True)
            said, last = True, now
        time.sleep(0.5)


def join_parser() -> argparse.ArgumentParser:
    """The flags of a stage joining from another host (`switchboard stage --join ... --rank R --bind ADDR`)."""
    pre = argparse.ArgumentParser(prog="switchboard stage", add_help=False)
    pre.add_argument("--join", default="", help="HOST:PORT of stage 0's group: take the rest from there")
    pre.add_argument("--rank", type=int)
    pre.add_argument("--bind", default="127.0.0.1")
    pre.add_argument("--threads", type=int)
    return pre


def main(argv: list[str] | None = None) -> None:
    known, rest = join_parser().parse_known_args(argv)
    if known.join:  # a stage on another host: `switchboard stage --join 10.0.0.1:29500 --rank 1 --bind 10.0.0.2`
        if known.rank is None:
            raise SystemExit("--join needs --rank")
        argv = joined(known.join, known.rank, known.bind, known.threads) + rest
    ap = argparse.ArgumentParser(prog="switchboard stage", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--join", default="", help="HOST:PORT of stage 0's group (its TCPStore): the rest comes "
                    "from there (with --rank and --bind)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="stage 0's address (its TCPStore)")
    ap.add_argument("--bind", default="127.0.0.1", help="this stage's own address for the group (where its links listen)")
    ap.add_argument("--model", default="", help="the shard's --model ('' = the default model)")
    ap.add_argument("--quantization", default="none", help="the weight format stage 0 resolved")
    ap.add_argument("--quantization-kernel", default="torch", choices=["blockq", "blockq_x2", "blockq_exact", "torch"],
                    help="what computes stage 0's quantized projections")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--layers", required=True, help="first:end")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--follow-threads", action="store_true",
                    help="run each pass at the thread count its header gives (a stage on stage 0's host)")
    ap.add_argument("--prefix-blocks", type=int, default=0, help="stage 0's prefix-cache blocks (0: off)")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s stage{args.rank} %(levelname)s %(message)s")

    import torch

    from data_plane.common.hop_auth import cluster_token_from_env
    from data_plane.model_store import model_source
    from data_plane.shard.engines.kv_cache import (
        PrefixCache,
        copy_out_blocks,
        insert_blocks,
        load_blocks,
        store_blocks,
    )
    from data_plane.shard.engines.llama_runner import LlamaRunner, select_rows
    from data_plane.shard.engines.pipeline_links import POLL_S, Links
    from data_plane.shard.engines.pipeline_net import (
        H_THREADS,
        HEADER_FIXED,
        OP_FORWARD,
        OP_GATHER,
        OP_INSERT,
        OP_LOAD,
        OP_MOVE,
        OP_STOP,
        OP_STORE,
        Frames,
        heartbeat,
        wire,
    )
    from data_plane.shard.engines.pipeline_store import GroupStore, StoreRefused
    from data_plane.shard.engines.torch_config import DTYPES
    from data_plane.shard.engines.weight_source import CpuCaps, resolve_plan

    torch.set_num_threads(args.threads)
    first, end = (int(v) for v in args.layers.split(":"))
    t0 = time.monotonic()
    dtype = DTYPES[args.dtype]
    source = model_source(args.model or None)
    # Explicit dtype and format: the same plan stage 0 resolved, so the stages' numerics agree.
    plan = resolve_plan(args.dtype, args.quantization, source=source.kind, caps=CpuCaps.detect(),
                        kernel=args.quantization_kernel)
    if plan.kernel_choice != args.quantization_kernel:
        # blockq did not build here (no C compiler): torch's kernels would give other numerics than stage 0's
        raise SystemExit(f"switchboard stage: stage 0 serves {args.quantization_kernel}, which this host cannot "
                         f"build (it would serve {plan.kernel}): install a C compiler (cc) here")
    runner = LlamaRunner.from_pretrained(source.path, dtype=dtype, max_num_seqs=args.max_num_seqs,
                                         max_len=args.max_len, plan=plan, gguf=source.gguf, layer_range=(first, end))
    hidden = runner.hidden_size  # no embedding, norm or head here: stage 0 embeds and applies the head
    # This stage's part of each prefix-cache block: stage 0 picks the blocks, this keeps its layers of them.
    pool = PrefixCache(num_layers=runner.num_layers, kv_heads=runner.num_kv_heads, head_dim=runner.head_dim,
                       block_size=args.block_size, dtype=dtype, budget_bytes=0, num_blocks=args.prefix_blocks)
    import gc

    gc.collect()
    try:  # the group's store, sealed with the cluster token (pipeline_store.py)
        store = GroupStore.connect(args.host, args.port, cluster_token_from_env(), 600)
        store.get(f"spec/{args.rank}")  # a token not the group's: one line now, nothing written
    except StoreRefused as exc:
        raise SystemExit(f"switchboard stage {args.rank}: {exc}") from None
    # What this stage holds, for stage 0's report and the benchmark's memory per stage.
    store.set(f"info/{args.rank}", json.dumps({
        "weight_bytes": runner.resident_weight_bytes, "kv_bytes": runner.kv_cache_bytes,
        "kv_token_bytes": runner.kv_cache_bytes // (args.max_num_seqs * args.max_len),
        "host": "" if args.bind.startswith("127.") else args.bind, "load_s": round(time.monotonic() - t0, 2)}))
    links = Links.join(store, args.rank, args.world, args.bind, timeout_s=600)
    stop = threading.Event()
    beat_store = store.another(5.0)
    threading.Thread(target=heartbeat, args=(beat_store, args.rank, stop), name="heartbeat", daemon=True).start()
    log.info("layers %d..%d ready in %.1f s (KV %.0f MiB)", first, end - 1, time.monotonic() - t0,
             runner.kv_cache_bytes / 2**20)
    last = args.rank == args.world - 1
    prev, nxt = args.rank - 1, (0 if last else args.rank + 1)
    m = args.max_num_seqs
    frames = Frames(m, args.world, hidden, dtype)
    buf = frames.receiver()  # every op's first message: a bare header, or a FORWARD frame
    h = frames.header(buf)
    try:
        with torch.inference_mode():
            while True:
                # a pass alone at every core of the host: poll for the next (pipeline_links.POLL_S)
                links.recv(buf, prev, POLL_S if torch.get_num_threads() > args.threads else 0.0)
                arrive = time.time()  # a pass's hop ends here; unpacking it is the stage's own work
                op = int(h[0])
                if op == OP_STOP:
                    if not last:
                        links.send(h, nxt)
                    break
                if op == OP_MOVE:
                    src, dst, length = (int(v) for v in h[1:4])
                    runner.move_slot(src, dst, length)
                    if not last:
                        links.send(h, nxt)
                    continue
                if op == OP_INSERT:  # fetched blocks: this stage's layers of them, straight from stage 0
                    if not last:
                        links.send(h, nxt)
                    count = int(h[1])
                    index = torch.empty(count, dtype=torch.long)
                    part = torch.empty((count, 2, runner.num_layers, runner.num_kv_heads, args.block_size,
                                        runner.head_dim), dtype=dtype)
                    links.recv(index, 0)
                    links.recv(wire(part), 0)
                    insert_blocks(pool.k_pool, pool.v_pool, index.tolist(), part)
                    continue
                if op == OP_GATHER:  # a finished turn's blocks for the cache nodes: this stage's layers
                    if not last:
                        links.send(h, nxt)
                    slot, first_block, end_block = (int(v) for v in h[1:4])
                    out = copy_out_blocks(runner.k_cache, runner.v_cache, slot, first_block, end_block,
                                          args.block_size)
                    links.send(wire(out), 0)
                    continue
                if op in (OP_LOAD, OP_STORE):
                    slot, count = int(h[1]), int(h[2])
                    values = torch.empty(count * (1 if op == OP_LOAD else 2), dtype=torch.long)
                    links.recv(values, prev)
                    if op == OP_LOAD:
                        load_blocks(pool.k_pool, pool.v_pool, values.tolist(), runner.k_cache, runner.v_cache, slot,
                                    args.block_size)
                    else:
                        pairs = [tuple(p) for p in values.view(-1, 2).tolist()]
                        store_blocks(pool.k_pool, pool.v_pool, pairs, runner.k_cache, runner.v_cache, slot,
                                     args.block_size)
                    if not last:
                        links.send(h, nxt)
                        links.send(values, nxt)
                    continue
                if op != OP_FORWARD:
                    raise RuntimeError(f"unknown pipeline op {op}")
                n, batched, rows = int(h[1]), bool(h[2]), int(h[3])
                cols = [h[HEADER_FIXED + k * m: HEADER_FIXED + k * m + n].tolist() for k in range(4)]
                slots, lens, starts, wanted = cols
                threads = int(h[H_THREADS])
                if args.follow_threads and threads and threads != torch.get_num_threads():
                    torch.set_num_threads(threads)  # one pass alone: every core; passes overlapping: a share
                timing, x = frames.unpack(buf, rows, lambda t: links.recv(t, prev))  # arrive, busy, leave, threads
                x = runner.run_layers(x, slots, lens, starts, batched)
                out = select_rows(x, lens, wanted).contiguous() if last else x.contiguous()
                leave = time.time()
                timing[args.rank] = torch.tensor([arrive, leave - arrive, leave, torch.get_num_threads()],
                                                 dtype=torch.float64)
                if last:
                    links.send(frames.pack_back(timing, out), nxt)
                else:
                    frame, spill = frames.pack(h, timing, out)
                    links.send(frame, nxt)
                    if spill is not None:
                        links.send(wire(spill), nxt)
    except Exception as exc:  # noqa: BLE001 - stage 0 went away (or the chain broke): the group is over
        log.warning("stage %d leaving: %s", args.rank, exc)
        stop.set()
        sys.stdout.flush()
        os._exit(1)
    stop.set()


if __name__ == "__main__":
    main()
