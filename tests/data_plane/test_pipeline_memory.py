"""A pipeline stage holds its share of the weights (data_plane/shard/engines/model_files.py
stage_tensors): a later stage reads only its layers' tensors from the checkpoint (dense safetensors
or the prepared int4 file), no embedding, norm or head, and keeps no second copy of what it built."""

from __future__ import annotations

import asyncio

import torch

from data_plane.model_store import model_source
from data_plane.shard.engines.llama_runner import LlamaRunner
from data_plane.shard.engines.model_files import read_dense, stage_tensors
from data_plane.shard.engines.prepared_weights import PreparedWeights, prepared_path
from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_stage_tensors_names_a_stages_layers_and_the_head_only_on_stage_0() -> None:
    later, first = stage_tensors(15, 30, head=False), stage_tensors(0, 15, head=True)
    assert later("model.layers.15.mlp.down_proj.weight") and later("model.layers.29.input_layernorm.weight")
    assert not later("model.layers.14.mlp.down_proj.weight") and not later("model.layers.3.self_attn.q_proj.weight")
    assert not any(later(n) for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"))
    assert all(first(n) for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                                  "model.layers.0.self_attn.q_proj.weight"))
    assert not first("model.layers.15.self_attn.q_proj.weight")


def test_a_later_stage_reads_and_holds_only_its_layers_dense_and_int4() -> None:
    src = model_source(None)
    keep = stage_tensors(15, 30, head=False)
    state = read_dense(src.path, torch.float32, keep)
    assert state is not None
    layers = {int(n.split(".")[2]) for n in state}
    assert layers == set(range(15, 30)) and all(n.startswith("model.layers.") for n in state)

    full = LlamaRunner.from_pretrained(src.path, dtype=torch.float32, max_num_seqs=1, max_len=64)
    stage = LlamaRunner.from_pretrained(src.path, dtype=torch.float32, max_num_seqs=1, max_len=64,
                                        layer_range=(15, 30))
    assert not stage.holds_head and stage.lm_head is None
    assert stage.num_layers == 15 and stage.hidden_size == full.hidden_size
    assert isinstance(full.embed, torch.Tensor) and isinstance(stage.embed, torch.Tensor)
    assert stage.embed.numel() == 0
    embed = full.embed.numel() * 4  # tied: one table, the head
    per_layer = (full.weight_bytes - embed - full.norm.numel() * 4) / 30
    assert abs(stage.weight_bytes - 15 * per_layer) < 1024  # its 15 layers, nothing of the vocabulary
    assert stage.weights._state is None  # the checkpoint's tensors were let go once the layers were built

    path = prepared_path(src.path)
    if path.exists():  # the int4 path: the prepared file read for the stage's weights only
        prepared = PreparedWeights.open(path, keep)
        assert "model.layers.20.mlp.down_proj.weight" in prepared
        assert "model.layers.3.mlp.down_proj.weight" not in prepared
        assert "model.embed_tokens.weight" not in prepared


def test_each_stage_process_holds_its_share_not_the_checkpoint() -> None:
    """A real 2-stage fp32 engine: stage 1's process holds its 19 layers (it reports their bytes) and
    its memory beyond them (interpreter, torch, KV touched) is less than the whole checkpoint, which
    it used to load and hold (an 820 MiB stage for 203 MiB of layers)."""

    async def run() -> tuple[int, int, int]:
        engine = TorchEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=256, threads=1,
                                          prefix_caching=False, pipeline_parallel_size=2))
        await engine.start()
        try:
            group = engine.pipeline
            assert group is not None
            weights = int(group.stage_info[1]["weight_bytes"])
            return weights, _rss_bytes(group.procs[1].pid), engine._runner.weight_bytes
        finally:
            await engine.aclose()

    weights, rss, stage0_weights = asyncio.run(run())
    checkpoint = 513 << 20  # SmolLM2-135M in fp32
    assert 245 << 20 < weights < 270 << 20  # 19 of 30 layers, no embedding (stage 0 holds the 108 MiB table)
    # The split counts the head as the 8 layers it costs: stage 0's 11 layers and table weigh about as much.
    assert abs(stage0_weights - weights) < 0.1 * weights
    assert rss - weights < checkpoint, f"stage 1: {rss >> 20} MiB resident for {weights >> 20} MiB of weights"
