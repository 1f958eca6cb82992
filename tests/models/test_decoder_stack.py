"""The compiled decoder stack (``cpu/decoder_stack.cpp``, `pagedrs.models.cpu_stack`) against
the Python layers it replaces on the CPU: the same step (decodes, short chunks the kernel
attends, long chunks SDPA attends, over cached prefixes in shuffled blocks) through both, the
logits and every cache slot compared; Llama with biases, Qwen2, Qwen3's q/k norms, Mistral's
sliding window, packed GGUF linears; then the default model's greedy output both ways, and
where the stack steps aside."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.config import EngineConfig
from pagedrs.engine.model_runner import ModelRunner, load_model_runner
from pagedrs.engine.step_arrays import StepArrays
from pagedrs.kernels.cpu import available
from tests.helpers.batches import make_step
from tests.helpers.checkpoints import TINY, save_word_tokenizer

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels do not build here")

BLOCK_SIZE = 8
# (context, rows this step) per sequence: decodes with ragged contexts, a whole prompt (SDPA,
# plain causal), a long chunk over a cached prefix (SDPA with a mask), short chunks (kernel).
MIXED = [(1, 1), (37, 1), (40, 40), (70, 33), (9, 9), (21, 3), (2, 1)]


def runner_for(directory: str, **config) -> ModelRunner:
    engine_config = EngineConfig(model=directory, block_size=BLOCK_SIZE, **config)
    return load_model_runner(engine_config, torch.float32, torch.device("cpu"), num_blocks=64)


def step_arrays(seqs, vocab_size: int, seed: int) -> StepArrays:
    """A step of ``seqs`` over blocks handed out shuffled (test_cpu_attention's layout), random
    token ids; logits of every row."""
    arrays, _, _ = make_step(
        seqs, block_size=BLOCK_SIZE, num_heads=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, seed=seed
    )
    num_tokens = int(arrays["query_start_loc"][-1])
    return StepArrays(
        input_token_ids=np.random.default_rng(seed).integers(0, vocab_size, num_tokens).astype(np.int64),
        positions=arrays["positions"],
        slot_mapping=arrays["slot_mapping"][None],  # one KV layer group
        query_start_loc=arrays["query_start_loc"],
        context_lens=arrays["context_lens"],
        prompt_lens=arrays["context_lens"],
        block_tables=arrays["block_tables"][None],
        logits_rows=np.arange(num_tokens, dtype=np.int64),
        block_copies=np.zeros((0, 2), dtype=np.int64),
    )


def forward_both(runner: ModelRunner, seqs, seed: int = 0, lora_rows: np.ndarray | None = None):
    """The step through the stack and through the Python layers, each from the same caches
    (random values stand for the cached prefixes): ((logits, caches) of the stack, of the layers).
    ``lora_rows``: each row's LoRA slot (the runner's `LoRAManager`)."""
    assert runner.cpu_stack is not None, "the stack should run this model"
    torch.manual_seed(seed)
    for key_cache, value_cache in runner.kv_caches:
        key_cache.normal_()
        value_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    arrays = step_arrays(seqs, runner.model.config.vocab_size, seed)
    if lora_rows is not None:
        arrays = arrays._replace(lora_rows=lora_rows)
    results = []
    stack = runner.cpu_stack
    for use_stack in (True, False):
        for (key_cache, value_cache), (key_before, value_before) in zip(runner.kv_caches, before):
            key_cache.copy_(key_before)
            value_cache.copy_(value_before)
        runner.cpu_stack = stack if use_stack else None
        try:
            logits = runner.forward(arrays)
        finally:
            runner.cpu_stack = stack
        results.append((logits, [(k.clone(), v.clone()) for k, v in runner.kv_caches]))
    return results


def assert_same_step(runner: ModelRunner, seqs, seed: int = 0) -> None:
    (stack_logits, stack_caches), (layer_logits, layer_caches) = forward_both(runner, seqs, seed)
    torch.testing.assert_close(stack_logits, layer_logits, atol=1e-4, rtol=1e-4)
    for (stack_key, stack_value), (layer_key, layer_value) in zip(stack_caches, layer_caches):
        torch.testing.assert_close(stack_key, layer_key, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stack_value, layer_value, atol=1e-5, rtol=1e-5)


def test_a_mixed_step_matches_the_python_layers(tiny_checkpoint):
    _, directory, _ = tiny_checkpoint
    runner = runner_for(directory)
    assert_same_step(runner, MIXED)
    assert_same_step(runner, [(context, 1) for context, _ in MIXED], seed=1)  # decodes only


@pytest.fixture(scope="module")
def biased_and_windowed(tmp_path_factory):
    """A Llama with biases on every projection, a Mistral with a sliding window of 8 tokens
    (shorter than the step's contexts), a Qwen3 whose heads are wider than its hidden size
    divides (q/k/v rows of 128 and 64 against 64 hidden features), and a Qwen3 with heads too
    wide for the stack."""
    import transformers

    directories = {}
    for name, config in (
        ("llama-bias", transformers.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True)),
        ("mistral-window", transformers.MistralConfig(**TINY, sliding_window=8)),
        ("qwen3-wide-heads", transformers.Qwen3Config(**TINY, head_dim=32)),
        ("qwen3-too-wide", transformers.Qwen3Config(**TINY, head_dim=520)),
    ):
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():  # the biases start at zero: give them values
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith(".bias"):
                    parameter.normal_()
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        save_word_tokenizer(directory, TINY["vocab_size"])
        directories[name] = str(directory)
    return directories


@pytest.mark.parametrize("name", ["llama-bias", "mistral-window", "qwen3-wide-heads"])
def test_biases_windows_and_wide_heads_match_the_python_layers(biased_and_windowed, name):
    runner = runner_for(biased_and_windowed[name])
    if name == "llama-bias":
        assert runner.model.layers[0].mlp.down_proj.bias is not None
    elif name == "mistral-window":
        assert set(runner.model.layer_windows) == {8} and runner.layout.group_windows == (8,)
    else:
        assert runner.model.num_heads * runner.model.head_dim == 2 * TINY["hidden_size"]
    assert_same_step(runner, MIXED)


@pytest.mark.parametrize("kind", ["32-weight blocks", "k-quants"])
def test_packed_gguf_linears_match_the_python_layers(tmp_path, kind):
    import transformers
    from gguf import GGMLQuantizationType as Q

    from tests.helpers.gguf_writer import K_CONFIG, K_TYPES, TYPES, write_gguf

    torch.manual_seed(5)
    config = transformers.LlamaConfig(**(TINY if kind == "32-weight blocks" else K_CONFIG))
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, transformers.LlamaForCausalLM(config).eval(), TYPES if kind == "32-weight blocks" else K_TYPES)
    runner = runner_for(path)
    packed = {module.ggml_type for module in runner.model.modules() if hasattr(module, "ggml_type")}
    assert packed == ({Q.Q4_0, Q.Q4_1, Q.Q8_0} if kind == "32-weight blocks" else {Q.Q4_K, Q.Q6_K})
    assert_same_step(runner, MIXED)


@pytest.mark.parametrize(
    "config",
    [{}, {"cpu_activation_quantization": "int8", "kv_cache_dtype": "bfloat16"}],
    ids=["exact", "int8-bf16-cache"],
)
def test_a_decode_in_one_parallel_region_equals_the_pooled_path_bit_for_bit(tmp_path, config):
    """Steps of a few rows run every layer in one parallel region (decoder_stack.cpp's
    SharedTeam): each linear's columns, the heads' rotary and cache writes, attention's items
    split between the threads at barriers. The same step with one region per part gives the
    same logits and caches, bit for bit."""
    import transformers
    from gguf import GGMLQuantizationType as Q

    from tests.helpers.gguf_writer import TYPES, write_gguf

    # Every linear packed (a float32 one runs torch's matmul: that step takes the pooled path).
    types = TYPES | {f"blk.1.{part}": Q.Q8_0 for part in ("attn_q", "attn_k", "attn_v", "ffn_down")}
    torch.manual_seed(6)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval(), types)
    runner = runner_for(path, **config)
    stack = runner.cpu_stack
    assert stack is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # one region needs two threads or more
    try:
        for seqs in ([(37, 1)], [(1, 1), (37, 1), (21, 3), (70, 1), (2, 1)]):
            steps = stack.one_region_steps
            (one_logits, one_caches), _ = forward_both(runner, seqs)
            assert stack.one_region_steps == steps + 1  # the stack's step, not the layers' one
            stack.set_one_region(False)
            try:
                (pooled_logits, pooled_caches), _ = forward_both(runner, seqs)
            finally:
                stack.set_one_region(True)
            assert stack.one_region_steps == steps + 1
            assert torch.equal(one_logits, pooled_logits)
            for one, pooled in zip(one_caches, pooled_caches):
                assert torch.equal(one[0], pooled[0]) and torch.equal(one[1], pooled[1])
    finally:
        torch.set_num_threads(threads)


def test_the_stack_steps_aside_where_it_cannot_run(tiny_llama):
    assert runner_for(tiny_llama).cpu_stack is not None
    assert runner_for(tiny_llama, attention_backend="torch").cpu_stack is None
    bf16 = load_model_runner(
        EngineConfig(model=tiny_llama, block_size=BLOCK_SIZE), torch.bfloat16, torch.device("cpu"), num_blocks=8
    )
    assert bf16.cpu_stack is None
    fp8 = runner_for(tiny_llama, quantization="fp8")
    assert fp8.cpu_stack is None


def test_heads_too_wide_for_the_stack_run_the_python_layers(biased_and_windowed):
    runner = runner_for(biased_and_windowed["qwen3-too-wide"])
    assert runner.model.head_dim == 520 and runner.cpu_stack is None


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written(tiny_llama):
    runner = runner_for(tiny_llama)
    arrays = step_arrays([(5, 5)], TINY["vocab_size"], seed=0)
    arrays.slot_mapping[0, -1] = 64 * BLOCK_SIZE  # one past the last slot
    before = [k.clone() for k, _ in runner.kv_caches]
    with pytest.raises(RuntimeError, match="outside the cache"):
        runner.forward(arrays)
    assert all(torch.equal(k, b) for (k, _), b in zip(runner.kv_caches, before))


def test_a_final_row_outside_the_step_is_refused_before_anything_is_written(tiny_llama):
    runner = runner_for(tiny_llama)
    arrays = step_arrays([(5, 5), (3, 1)], TINY["vocab_size"], seed=0)
    arrays.logits_rows[-1] = len(arrays.input_token_ids)  # one past the step's last row
    before = [k.clone() for k, _ in runner.kv_caches]
    with pytest.raises(RuntimeError, match="outside the step"):
        runner.forward(arrays)
    assert all(torch.equal(k, b) for (k, _), b in zip(runner.kv_caches, before))


@pytest.mark.parametrize("packed", [False, True], ids=["float32", "gguf"])
def test_the_stack_looks_token_ids_up_as_the_embedding_module_does(tiny_llama, tmp_path, packed):
    """Given the step's token ids, the stack takes their rows of the embedding table itself
    (float32, or packed GGUF rows): the same logits and caches, bit for bit, as from the model's
    embedding module's rows; an id outside the table is refused before anything is written."""
    path = tiny_llama
    if packed:
        import transformers

        from tests.helpers.gguf_writer import TYPES, write_gguf

        torch.manual_seed(7)
        path = str(tmp_path / "tiny.gguf")
        write_gguf(path, transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval(), TYPES)
    runner = runner_for(path)
    stack = runner.cpu_stack
    assert stack is not None and stack.embeds
    seqs = [(37, 1), (9, 9), (2, 1)]
    (ids_logits, ids_caches), _ = forward_both(runner, seqs)
    stack.embeds = False  # the model's module looks them up, the stack takes the rows
    try:
        (rows_logits, rows_caches), _ = forward_both(runner, seqs)
    finally:
        stack.embeds = True
    assert torch.equal(ids_logits, rows_logits)
    for by_ids, by_rows in zip(ids_caches, rows_caches):
        assert torch.equal(by_ids[0], by_rows[0]) and torch.equal(by_ids[1], by_rows[1])

    arrays = step_arrays([(5, 5)], TINY["vocab_size"], seed=0)
    arrays.input_token_ids[-1] = runner.model.embed_tokens.weight.shape[0]  # one past the table
    before = [k.clone() for k, _ in runner.kv_caches]
    with pytest.raises((RuntimeError, IndexError)):
        runner.forward(arrays)
    assert all(torch.equal(k, b) for (k, _), b in zip(runner.kv_caches, before))


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "linear", "factor": 2.0},
    ],
    ids=["default", "llama3", "yarn", "linear"],
)
def test_the_rotary_tables_hold_what_cos_sin_computes_for_each_position(rope_scaling):
    """The stack reads each token's cos and sin from tables of every position (built once,
    doubled as positions pass their end): a table's row is, bit for bit, what the rotary
    embedding computes for that position in a step."""
    import transformers

    from pagedrs.models import build_model
    from pagedrs.models.cpu_stack import MIN_ROPE_TABLE_ROWS, CpuDecoderStack

    config = transformers.LlamaConfig(**TINY, rope_scaling=rope_scaling)
    stack = CpuDecoderStack(build_model(config, torch.float32))
    rope = next(iter(stack._ropes))
    for positions in (torch.tensor([0, 5, 511]), torch.tensor([3, 2 * MIN_ROPE_TABLE_ROWS + 7, 17])):
        tables = stack.rope_tables(positions)
        assert tables is not None and len(tables) == 1
        cos_table, sin_table = tables[0]
        assert len(cos_table) > int(positions.max())
        cos, sin = rope.cos_sin(positions, torch.float32)
        assert torch.equal(cos_table[positions], cos) and torch.equal(sin_table[positions], sin)
    assert len(cos_table) == 4 * MIN_ROPE_TABLE_ROWS  # doubled twice to cover 2055


def test_a_length_dependent_rotary_has_no_tables(tmp_path):
    """Dynamic NTK scaling rotates by each sequence's length too: its steps compute cos and sin."""
    import transformers

    from pagedrs.models import build_model
    from pagedrs.models.cpu_stack import CpuDecoderStack

    config = transformers.LlamaConfig(**TINY, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert CpuDecoderStack(build_model(config, torch.float32)).rope_tables(torch.tensor([4])) is None


def test_a_step_through_the_rotary_tables_equals_one_with_its_own_cos_and_sin(tiny_llama, monkeypatch):
    runner = runner_for(tiny_llama)
    stack = runner.cpu_stack
    assert stack is not None
    (table_logits, table_caches), _ = forward_both(runner, MIXED)
    assert stack._rope_tables  # the step read the tables
    monkeypatch.setattr(stack, "rope_tables", lambda positions: None)
    (own_logits, own_caches), _ = forward_both(runner, MIXED)
    assert torch.equal(table_logits, own_logits)
    for tables, own in zip(table_caches, own_caches):
        assert torch.equal(tables[0], own[0]) and torch.equal(tables[1], own[1])


@pytest.mark.parametrize(
    "kind", ["float32", "packed", "packed-int8"], ids=["float32 head", "Q4_1 head", "Q4_1 head, int8 activations"]
)
def test_the_head_in_the_stacks_call_gives_the_models_logits_bit_for_bit(tiny_llama, tmp_path, kind, monkeypatch):
    """The stack's call ends with the head's matmul where it takes the head (the same kernel the
    model's head runs): the logits equal those of the model's own head after the stack's call."""
    import transformers

    from tests.helpers.gguf_writer import TYPES, write_gguf

    directory = tiny_llama
    if kind != "float32":
        torch.manual_seed(7)
        directory = str(tmp_path / "tiny.gguf")
        write_gguf(directory, transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval(), TYPES)
    runner = runner_for(directory, **({"cpu_activation_quantization": "int8"} if kind == "packed-int8" else {}))
    stack = runner.cpu_stack
    assert stack is not None and stack.has_head
    for seqs in (MIXED, [(37, 1)]):
        (in_stack, in_stack_caches), _ = forward_both(runner, seqs)
        monkeypatch.setattr(stack, "has_head", False)
        (own_head, own_head_caches), _ = forward_both(runner, seqs)
        monkeypatch.undo()
        assert torch.equal(in_stack, own_head)
        for one, other in zip(in_stack_caches, own_head_caches):
            assert torch.equal(one[0], other[0]) and torch.equal(one[1], other[1])


def test_a_rotary_row_outside_the_tables_is_refused_before_anything_is_written(tiny_llama, monkeypatch):
    runner = runner_for(tiny_llama)
    stack = runner.cpu_stack
    assert stack is not None
    arrays = step_arrays([(5, 5), (40, 1)], TINY["vocab_size"], seed=0)
    tables = stack.rope_tables(torch.from_numpy(arrays.positions))
    assert tables is not None
    short = [(cos[:20], sin[:20]) for cos, sin in tables]  # position 39 is past their end
    monkeypatch.setattr(stack, "rope_tables", lambda positions: short)
    before = [k.clone() for k, _ in runner.kv_caches]
    with pytest.raises(RuntimeError, match="outside the rotary tables"):
        runner.forward(arrays)
    assert all(torch.equal(k, b) for (k, _), b in zip(runner.kv_caches, before))


@pytest.mark.slow  # the default model both ways: over 10 s
def test_default_model_greedy_output_is_the_same_both_ways():
    llm = LLM(kv_cache_memory="128MiB", enable_prefix_caching=False)
    prompts = ["Write a haiku about the sea.", "def fibonacci(n):", "The capital of France is " * 8]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runner = llm.engine.runner
    assert runner.cpu_stack is not None
    with_stack = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    runner.cpu_stack = None
    without = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert with_stack == without
