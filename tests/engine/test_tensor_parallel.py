"""Tensor parallelism on the CPU (gloo): tp=2 generates exactly what tp=1 does, the server
serves with ``-tp 2``, a dead worker ends the server, saying why, and leaves no process behind,
and two "nodes" on loopback serve one model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import openai
import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.config import EngineConfig
from pagedrs.engine.step_arrays import StepArrays
from pagedrs.engine.tp_common import check_parallel_config, pack_step, unpack_step
from pagedrs.memory import kv_bytes_per_token
from pagedrs.models.loader import load_config, resolve_model
from tests.helpers.checkpoints import TINY, save_word_tokenizer
from tests.helpers.servers import alive, child_pids, command_line, free_port, start_server, start_streams, wait_for

CPU = torch.device("cpu")

# Two prompts share a 40-token prefix (a prefix-cache hit), one is long (several chunks of 32).
PREFIX = [(7 * i + 3) % 300 + 10 for i in range(40)]
PROMPTS = [PREFIX + [11, 12, 13], PREFIX + [21, 22], [(5 * i + 1) % 300 + 10 for i in range(150)], [1, 2, 3]]
# Chunked prefill (32 tokens a step), and 12 blocks of 16 tokens: few enough that sequences
# are preempted and recomputed. (The KV budget is per rank, and a rank holds its share of the
# KV heads: `kv_bytes_per_token` says how many bytes a token takes there.)
SETTINGS = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=16)
NUM_BLOCKS = 12


def generate(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[choice.token_ids for choice in output.outputs] for output in outputs]


def budget(directory: str, size: int, num_blocks: int = NUM_BLOCKS) -> int:
    """Bytes of ``num_blocks`` blocks on one of ``size`` ranks: a block holds the layers of one
    KV layer group (`pagedrs.engine.kv_layout`)."""
    from pagedrs.engine.builder import kv_layout_of

    config = load_config(resolve_model(directory))
    layers_per_block = kv_layout_of(config, torch.float32, size, with_draft=False).num_slots
    per_layer = kv_bytes_per_token(directory, "float32", size) // config.num_hidden_layers
    return num_blocks * SETTINGS["block_size"] * per_layer * layers_per_block


def compare_tp(directory: str, size: int, num_blocks: int = NUM_BLOCKS) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=5, n=2)
    single = LLM(directory, kv_cache_memory=budget(directory, 1, num_blocks), **SETTINGS)
    assert single.engine.scheduler.num_blocks == num_blocks
    expected = generate(single, greedy), generate(single, sampled)
    assert single.engine.scheduler.stats().num_preemptions_total > 0  # the settings do preempt
    split = LLM(directory, tensor_parallel_size=size, kv_cache_memory=budget(directory, size, num_blocks), **SETTINGS)
    try:
        assert split.engine.model.num_kv_heads * size >= single.engine.model.num_kv_heads
        assert generate(split, greedy) == expected[0]
        assert generate(split, sampled) == expected[1]
        stats = split.engine.scheduler.stats()
        assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
        assert stats.num_used_blocks == 0
    finally:
        split.shutdown()
    assert all(worker.exitcode == 0 for worker in split.engine.parallel.workers)


@pytest.mark.slow  # tensor-parallel ranks
def test_tp2_generates_exactly_what_tp1_does(tiny_checkpoint):
    """Greedy and seeded sampling, through chunked prefill, prefix hits and preemption, for
    Llama, Mistral, Qwen2 and Qwen3 (4 query heads, 2 KV heads: one of each per rank)."""
    _, directory, _ = tiny_checkpoint
    compare_tp(directory, 2)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory) -> str:
    """A tiny Llama with a single KV head: every rank must hold a copy of it."""
    import transformers

    torch.manual_seed(3)
    config = transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 1})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    directory = tmp_path_factory.mktemp("one-kv-head")
    model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return str(directory)


@pytest.mark.slow  # tensor-parallel ranks
def test_kv_heads_are_replicated_when_there_are_fewer_than_ranks(one_kv_head):
    compare_tp(one_kv_head, 2)


def test_the_step_message_round_trips():
    rng = np.random.default_rng(0)
    for num_tokens, num_seqs, num_copies in ((5, 3, 0), (1, 1, 2), (0, 0, 0), (33, 7, 1)):
        arrays = StepArrays(
            rng.integers(0, 1000, num_tokens),
            rng.integers(0, 1000, num_tokens),
            rng.integers(0, 1000, (2, num_tokens)),
            rng.integers(0, 100, num_seqs + 1).astype(np.int32),
            rng.integers(0, 100, num_seqs).astype(np.int32),
            rng.integers(0, 100, num_seqs).astype(np.int32),
            rng.integers(0, 100, (2, num_seqs, 3)).astype(np.int32),
            rng.integers(0, 100, num_seqs),
            rng.integers(0, 100, (num_copies, 2)),
        )
        header, payload = pack_step(arrays)
        back = unpack_step(header, payload)
        for name, sent, received in zip(StepArrays._fields, arrays, back):
            assert received.dtype == sent.dtype and np.array_equal(received, sent), name


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(tensor_parallel_size=4, nnodes=3), "nnodes"),
        (dict(tensor_parallel_size=2, nnodes=2), "master_port"),
        (dict(tensor_parallel_size=2, node_rank=1), "node_rank"),
        (dict(tensor_parallel_size=2, distributed_backend="nccl"), "nccl"),
        (dict(tensor_parallel_size=2, distributed_backend="mpi"), "distributed_backend"),
        (dict(tensor_parallel_size=2, distributed_timeout=0), "distributed_timeout"),
    ],
)
def test_bad_parallel_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        check_parallel_config(EngineConfig(**settings), CPU)


def test_a_vocabulary_that_does_not_divide_is_padded(one_kv_head):
    """320 tokens over 3 ranks: shards of 107 rows, the last one padded with a zero row."""
    from pagedrs.layers.linear import TensorParallel, VocabEmbedding

    full = torch.randn(320, 8)
    shards = [VocabEmbedding(320, 8, TensorParallel(rank, 3), torch.float32) for rank in range(3)]
    for shard in shards:
        shard.load(full)
    assert torch.equal(torch.cat([shard.weight for shard in shards])[:320], full)
    assert shards[2].num_rows == 106 and not shards[2].weight[106:].any()


def test_heads_that_do_not_split_are_refused_before_any_rank_starts(tiny_llama, monkeypatch):
    started: list[int] = []

    def start_worker(setup, errors):
        # A started rank would be waited for: fail at once instead of stalling the suite.
        started.append(setup.rank)
        raise AssertionError(f"rank {setup.rank} was started for a model that cannot be split")

    monkeypatch.setattr("pagedrs.engine.parallel.start_worker", start_worker)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(tiny_llama, tensor_parallel_size=3, kv_cache_memory="1MiB")
    assert started == []  # no worker was started and waited for


def _server_args(model: str, *extra: str) -> list[str]:
    return [model, "--kv-cache-memory", "4MiB", "--max-model-len", "256", "--log-level", "warning", *extra]


@pytest.mark.slow  # a server process and its ranks
def test_the_server_streams_a_chat_with_tp2_and_drains_then_stops_its_workers_on_sigterm(tiny_smol, tmp_path):
    question = [{"role": "user", "content": "Name three colors."}]
    single = LLM(tiny_smol, kv_cache_memory="4MiB")
    expected = single.chat(question, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    server = start_server(_server_args(tiny_smol, "-tp", "2"), str(tmp_path / "server.log"))
    workers = child_pids(server.process.pid)
    try:
        assert server.stream_chat(tiny_smol, question, max_tokens=12) == expected.outputs[0].text
        status, info = server.request("GET", "/server_info")
        assert info["tensor_parallel_size"] == 2 and info["distributed_backend"] == "gloo"
        assert 'tensor_parallel_size="2"' in server.request("GET", "/metrics")[1]
        assert server.metrics()["pagedrs:tp_step_broadcast_bytes_total"] > 0
        # SIGTERM with four streams mid-generation: each runs to its end on both ranks.
        pool, futures = start_streams(server.port, 4, max_tokens=64)
    finally:
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=60)
    results = [future.result(timeout=10) for future in futures]
    pool.shutdown()
    assert all(r["finish"] == "length" and r["done"] and not r["errors"] for r in results), results
    assert code == 0, server.log()[-2000:]
    # The worker, and multiprocessing's resource tracker once every pipe to it has closed.
    assert workers and wait_for(lambda: not any(alive(pid) for pid in workers), timeout=10)


@pytest.mark.slow  # a server process and its ranks
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_failed_worker_ends_the_server_with_an_error_and_no_orphans(tiny_smol, tmp_path, fault):
    """A worker killed mid-generation, or one that stops answering (SIGSTOP: the collectives
    time out after --distributed-timeout): the stream fails, the server exits non-zero on its
    own, saying why (the killed worker's exit, or the collective that timed out), and no worker
    is left."""
    server = start_server(
        _server_args(tiny_smol, "-tp", "2", "--distributed-timeout", "5"), str(tmp_path / "server.log")
    )
    try:
        children = child_pids(server.process.pid)  # the worker, and multiprocessing's resource tracker
        workers = [pid for pid in children if "spawn_main" in command_line(pid)]
        assert len(workers) == 1
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model=tiny_smol,
            prompt="hello",
            max_tokens=200,
            temperature=1.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # generating
        for pid in workers:
            os.kill(pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            for _ in stream:
                pass
        # Bounded so that a server that never notices fails here instead of stalling the suite.
        code = server.process.wait(timeout=60)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert code != 0
    log = server.log()
    assert "tensor-parallel" in log, log[-2000:]
    if fault == "killed":  # the killed worker, by its pid
        assert f"exiting: tensor-parallel worker (pid {workers[0]}) exited" in log, log[-2000:]
    else:  # the collective's own timeout (--distributed-timeout), not anything slower
        assert re.search(r"exiting: a tensor-parallel rank failed \(.*timed out", log, re.IGNORECASE), log[-2000:]
    assert wait_for(lambda: not any(alive(pid) for pid in children), timeout=10)


@pytest.mark.slow  # two server processes and their ranks
def test_two_nodes_on_loopback_serve_the_same_greedy_output(tiny_llama, tmp_path):
    """tp=4 over two launcher processes, two ranks each (KV heads replicated): node 1 is
    headless, node 0 serves."""
    directory = tiny_llama
    prompt = PROMPTS[0]
    expected = LLM(directory, kv_cache_memory="1MiB").generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False
    )[0]
    port = free_port()
    parallel = ["-tp", "4", "--nnodes", "2", "--master-port", str(port)]
    node1_log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "pagedrs.server", *_server_args(directory, *parallel, "--node-rank", "1")],
        stdout=node1_log,
        stderr=subprocess.STDOUT,
    )
    try:
        server = start_server(_server_args(directory, *parallel, "--node-rank", "0"), str(tmp_path / "node0.log"))
        try:
            status, body = server.request(
                "POST", "/v1/completions", {"model": directory, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            )
            assert status == 200, body
            assert body["choices"][0]["text"] == expected.outputs[0].text
            assert server.request("GET", "/server_info")[1]["tensor_parallel_size"] == 4
        finally:
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(timeout=30) == 0
        assert node1.wait(timeout=30) == 0  # node 0's stop message ends node 1 cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
        node1_log.close()
    assert wait_for(lambda: not child_pids(node1.pid), timeout=5)


@pytest.mark.slow  # torchrun and its ranks
def test_torchrun_can_start_the_ranks(tiny_llama, tmp_path):
    """torch's own launcher: every rank runs the same `pagedrs serve` command; rank 0 serves."""
    expected = LLM(tiny_llama, kv_cache_memory="1MiB").generate(
        [PROMPTS[3]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )[0]
    port, master_port = free_port(), free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(master_port), "-m", "pagedrs.server"]
    command += _server_args(tiny_llama, "-tp", "2", "--port", str(port))
    log = open(tmp_path / "torchrun.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

        def up() -> bool:
            try:
                client.models.list()
                return True
            except openai.APIConnectionError:
                return False

        assert wait_for(up, timeout=120), (tmp_path / "torchrun.log").read_text()[-2000:]
        completion = client.completions.create(model=tiny_llama, prompt=PROMPTS[3], max_tokens=8, temperature=0)
        assert completion.choices[0].text == expected.outputs[0].text
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
        log.close()


def test_one_rank_through_torch_distributed_is_the_plain_engine(tiny_llama):
    """An explicit backend with tp=1 runs the distributed path with a world of one (what the GPU
    check does with NCCL)."""
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = LLM(tiny_llama, kv_cache_memory="1MiB").generate(PROMPTS, params, use_tqdm=False)
    with LLM(tiny_llama, kv_cache_memory="1MiB", distributed_backend="gloo") as llm:
        assert llm.engine.parallel is not None and llm.engine.parallel.workers == []
        distributed = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.parallel.broadcast_stats()["steps"] > 0
    assert [o.outputs[0].token_ids for o in distributed] == [o.outputs[0].token_ids for o in plain]


def test_a_rank_reads_only_its_slices_of_the_checkpoint(tiny_checkpoint):
    """Loading rank 1 of 2 reads half of every sharded tensor from the safetensors file (norms
    and the row-parallel biases, which every rank holds, whole): no rank materializes the model."""
    from pagedrs.checkpoint import iter_weights
    from pagedrs.layers.linear import TensorParallel
    from pagedrs.models import build_model

    _, directory, _ = tiny_checkpoint
    source = resolve_model(directory)
    reads: dict[str, int] = {}
    sizes: dict[str, int] = {}

    class Recording:
        def __init__(self, name, handle):
            self.name, self.handle, self.shape = name, handle, handle.shape
            sizes[name] = int(np.prod(handle.shape))

        def __getitem__(self, index):
            tensor = self.handle[index]
            reads[self.name] = reads.get(self.name, 0) + tensor.numel()
            return tensor

    model = build_model(load_config(source), torch.float32, TensorParallel(1, 2))
    model.load_weights((name, Recording(name, handle)) for name, handle in iter_weights(source))
    sharded = [name for name in reads if "norm" not in name]
    assert any("q_proj" in name for name in sharded) and any("down_proj" in name for name in sharded)
    for name in sharded:
        assert reads[name] * 2 == sizes[name], name


@pytest.mark.slow  # tensor-parallel ranks
@pytest.mark.parametrize(
    "family",
    [
        "gemma2",
        "gemma3",
        "phi3-partial-sliding",
        "granite",
        "qwen2-sliding",
        "mixtral",
        "qwen2-moe",
        "qwen3-moe",
        "gpt-oss",
        "deepseek-v2",
        "deepseek-v3",
    ],
)
def test_tp2_of_the_other_families_generates_what_tp1_does(family, tmp_path):
    """Per-layer windows, softcaps, Gemma's norms, Phi-3's fused checkpoint tensors (split
    across ranks), Granite's multipliers and mixtures of experts (each expert's intermediate
    features split, the router replicated; Qwen2-MoE's shared expert) under tensor parallelism;
    DeepSeek's latent attention (heads split, every rank caching every latent)."""
    from tests.helpers.families import save_family

    save_family(family, tmp_path)
    # Phi-3's and Mixtral's window is on every layer: a sequence holds at most a few blocks of 16 tokens, so
    # only a smaller cache preempts.
    compare_tp(str(tmp_path), 2, num_blocks=4 if family.startswith(("phi3", "mixtral")) else NUM_BLOCKS)
