"""LoRA adapters through the engine, against peft over transformers (the oracle): greedy
tokens and logprobs per adapter; one batch mixing base, adapter A and adapter B rows equals
each alone; the same prompt under A, then B, then the base never shares prefix-cache blocks;
``max_loras=1`` with two adapters in flight makes one wait (it does not fail); under
preemption and slot swapping, and with tensor parallelism (tp=2), every request generates what
it does alone; bad adapters are refused and leave the engine idle."""

from __future__ import annotations

import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.lora import LoRARequest
from tests.helpers.checkpoints import save_tiny_checkpoint
from tests.helpers.oracle import PROMPTS, assert_same_or_near_tie, hf_greedy

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama, two random adapters over it (A: every linear, rank 8; B: attention only,
    rank 4, rsLoRA) and peft models of each (the oracles)."""
    import peft

    directory = tmp_path_factory.mktemp("lora-base")
    save_tiny_checkpoint("llama", directory)
    oracles = {}
    settings = {
        "a": dict(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        "b": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj"]),
    }
    from transformers import AutoModelForCausalLM

    for seed, (name, lora) in enumerate(settings.items()):
        base = AutoModelForCausalLM.from_pretrained(directory).eval()
        torch.manual_seed(100 + seed)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora)).eval()
        with torch.no_grad():  # large enough updates that each adapter changes the greedy tokens
            for module in model.modules():
                if isinstance(module, peft.tuners.lora.Linear):
                    module.lora_B["default"].weight.mul_(4)
        adapter_dir = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(adapter_dir)
        oracles[name] = (str(adapter_dir), model)
    base = AutoModelForCausalLM.from_pretrained(directory).eval()
    return str(directory), oracles, base


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory="16MiB")


def _request(checkpoint, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, checkpoint[1][name][0])


def _tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def _idle(llm) -> bool:
    engine = llm.engine
    return engine.scheduler.stats().num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("name", ["a", "b"])
def test_each_adapter_generates_what_peft_does(llm, checkpoint, name):
    oracle = checkpoint[1][name][1]
    outputs = llm.generate(
        PROMPTS, GREEDY, lora_request=_request(checkpoint, name, 1 if name == "a" else 2), use_tqdm=False
    )
    base_tokens = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for prompt, output in zip(PROMPTS, outputs):
        ours = output.outputs[0].token_ids
        theirs = hf_greedy(oracle, prompt, NEW_TOKENS)
        assert_same_or_near_tie(oracle, prompt, ours, theirs)
        if ours == theirs:  # logprobs of the chosen tokens, against peft's
            with torch.no_grad():
                logits = oracle(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ours)[:, None])[:, 0]
            got = torch.tensor([entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, ours)])
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert base_tokens != _tokens(outputs)  # the adapter changes what is generated
    assert _idle(llm)


def test_a_batch_mixing_base_and_adapters_equals_each_alone(llm, checkpoint):
    a, b = _request(checkpoint, "a", 1), _request(checkpoint, "b", 2)
    alone = {
        "base": _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)),
        "a": _tokens(llm.generate(PROMPTS, GREEDY, lora_request=a, use_tqdm=False)),
        "b": _tokens(llm.generate(PROMPTS, GREEDY, lora_request=b, use_tqdm=False)),
    }
    prompts = PROMPTS * 3
    adapters = [None] * len(PROMPTS) + [a] * len(PROMPTS) + [b] * len(PROMPTS)
    mixed = _tokens(llm.generate(prompts, GREEDY, lora_request=adapters, use_tqdm=False))
    assert mixed == alone["base"] + alone["a"] + alone["b"]
    assert _idle(llm)


def test_the_same_prompt_under_two_adapters_never_shares_cached_blocks(llm, checkpoint):
    prompt = list(range(20, 60))  # two full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prompt], params, lora_request=_request(checkpoint, "a", 1), use_tqdm=False)[0]
    under_b = llm.generate([prompt], params, lora_request=_request(checkpoint, "b", 2), use_tqdm=False)[0]
    base = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, lora_request=_request(checkpoint, "a", 1), use_tqdm=False)[0]
    assert under_b.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_one_slot_and_two_adapters_in_flight_makes_one_wait(checkpoint):
    llm = LLM(checkpoint[0], device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8, kv_cache_memory="16MiB")
    a, b = _request(checkpoint, "a", 1), _request(checkpoint, "b", 2)
    alone_a = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=a, use_tqdm=False))
    alone_b = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=b, use_tqdm=False))
    engine = llm.engine
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"a{index}", prompt, GREEDY, lora_request=a)
        engine.add_request(f"b{index}", prompt, GREEDY, lora_request=b)
    assert engine.processor.num_waiting_for_slots == len(PROMPTS)  # b's wait for a's slot
    engine.abort_request("b0")  # a waiting request can be aborted
    assert engine.processor.num_waiting_for_slots == len(PROMPTS) - 1
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert [finished[f"a{i}"] for i in range(len(PROMPTS))] == alone_a
    assert [finished[f"b{i}"] for i in range(1, len(PROMPTS))] == alone_b[1:]
    assert "b0" not in finished and _idle(llm)


def test_bad_adapters_are_refused_and_leave_the_engine_idle(llm, checkpoint, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter"):
        llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("other", 1, checkpoint[1]["b"][0]), use_tqdm=False)
    plain = LLM(checkpoint[0], device="cpu", kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(PROMPTS, GREEDY, lora_request=_request(checkpoint, "a", 1), use_tqdm=False)
    assert _idle(llm) and _idle(plain)


def test_an_adapter_over_the_packed_default_model_generates_what_peft_does(tmp_path):
    """The GGUF's packed weights (bytes, not floats) under a float adapter: the update is added
    to the packed linears' outputs; peft runs the same weights dequantized."""
    import peft

    from pagedrs.bench.hf_baseline import load_hf_model

    hf, _ = load_hf_model()
    torch.manual_seed(5)
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    oracle = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, lora_alpha=32, target_modules=targets, init_lora_weights=False)
    )
    oracle.eval().save_pretrained(tmp_path)
    llm = LLM(enable_lora=True, max_lora_rank=4, kv_cache_memory="64MiB")
    prompt = llm.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = llm.generate([prompt], params, lora_request=LoRARequest("p", 1, str(tmp_path)), use_tqdm=False)
    base = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    theirs = hf_greedy(oracle, prompt, 8)
    assert_same_or_near_tie(oracle, prompt, ours[0].outputs[0].token_ids, theirs)
    assert theirs != base  # the adapter matters here


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
        (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank"),
        (dict(enable_lora=True, max_lora_rank=1024), "at most 512"),
    ],
)
def test_lora_settings_that_cannot_work_are_refused_before_loading(settings, message):
    from pagedrs import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_the_python_layers_add_the_same_updates_as_the_stack(llm, checkpoint):
    """Adapter steps run in the compiled CPU stack where it runs, else in the Python layers'
    hooks (GPU, tensor parallelism...): both give peft's tokens and the same logprobs."""
    runner = llm.engine.runner
    assert runner.cpu_stack is not None and runner.cpu_stack.has_lora
    a, b = _request(checkpoint, "a", 1), _request(checkpoint, "b", 2)
    adapters = [a, None, b]
    in_stack = llm.generate(PROMPTS, GREEDY, lora_request=adapters, use_tqdm=False)
    stack, runner.cpu_stack = runner.cpu_stack, None
    try:
        in_python = llm.generate(PROMPTS, GREEDY, lora_request=adapters, use_tqdm=False)
    finally:
        runner.cpu_stack = stack
    assert _tokens(in_stack) == _tokens(in_python)
    for one, other in zip(in_stack, in_python):
        for first, second in zip(one.outputs[0].logprobs, other.outputs[0].logprobs):
            assert {t: round(v.logprob, 4) for t, v in first.items()} == pytest.approx(
                {t: round(v.logprob, 4) for t, v in second.items()}, abs=2e-4
            )


# Chunked prefill (32 tokens a step) and 12 blocks of 16 tokens: sequences are preempted and
# recomputed. One slot for two adapters: they take turns, swapped in and out.
TIGHT = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=16, max_loras=1, max_lora_rank=8)
LONG_PROMPTS = [list(range(20, 100)), [(7 * i + 3) % 300 + 10 for i in range(60)], *PROMPTS]


def _mixed(llm, checkpoint):
    """Every prompt under the base model, adapter A and adapter B, in one call."""
    a, b = _request(checkpoint, "a", 1), _request(checkpoint, "b", 2)
    prompts = LONG_PROMPTS * 3
    adapters = [None] * len(LONG_PROMPTS) + [a] * len(LONG_PROMPTS) + [b] * len(LONG_PROMPTS)
    outputs = llm.generate(prompts, GREEDY, lora_request=adapters, use_tqdm=False)
    logprobs = [
        [entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, output.outputs[0].token_ids)]
        for output in outputs
    ]
    return _tokens(outputs), logprobs


@pytest.fixture(scope="module")
def roomy(llm, checkpoint):
    """What each prompt generates under each adapter with room to spare (one slot per adapter)."""
    return _mixed(llm, checkpoint)


def _tight(checkpoint, size: int) -> LLM:
    from tests.engine.test_tensor_parallel import budget

    memory = budget(checkpoint[0], size)
    return LLM(
        checkpoint[0], device="cpu", enable_lora=True, tensor_parallel_size=size, kv_cache_memory=memory, **TIGHT
    )


def test_adapters_under_preemption_and_swapping_generate_what_they_do_alone(checkpoint, roomy):
    llm = _tight(checkpoint, 1)
    tokens, logprobs = _mixed(llm, checkpoint)
    assert tokens == roomy[0]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(roomy[1]), rtol=0, atol=1e-4)
    assert llm.engine.scheduler.stats().num_preemptions_total > 0
    assert _idle(llm)


@pytest.mark.slow  # tensor-parallel ranks
def test_tp2_with_adapters_generates_what_tp1_does(checkpoint, roomy):
    llm = _tight(checkpoint, 2)
    try:
        tokens, logprobs = _mixed(llm, checkpoint)
        assert tokens == roomy[0]
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(roomy[1]), rtol=0, atol=1e-4)
        stats = llm.engine.scheduler.stats()
        assert stats.num_preemptions_total > 0 and stats.num_used_blocks == 0
    finally:
        llm.shutdown()
    assert all(worker.exitcode == 0 for worker in llm.engine.parallel.workers)
