"""The engine's own cost per decode step, with a model that costs almost nothing.

Model: a 1-layer, 64-wide random Llama with SmolLM2's 49,152-token vocabulary (so the
sampler works on real-sized logits while the forward pass is nearly free). For each batch
size and each sampling setting, B requests decode together; after their prefill, `--steps`
decode steps are timed and split into where the time goes:

- schedule: the Rust scheduler's ``schedule()`` (batch arrays out);
- forward: ``ModelRunner.execute`` (attention metadata, inputs, the model, logits), as the executor calls it;
- sampler: the sampler (penalties, filtering, draws, logprobs, one device-to-host copy);
- update: the Rust core's ``update_from_output`` (columns out);
- apply: the output processor's detokenizing, stop strings, logprobs entries, finish reasons;
- own: the step minus the forward pass (what the engine adds around the model, sampler included);
- host: the step minus the forward pass and the sampler (scheduling, bookkeeping, apply: the
  Python and Rust work that a GPU would not take off the CPU);
- x greedy: (forward + own) over the same for greedy, with one forward time for all settings
  of a batch size (the median of theirs: the same work, whose time the VM moves by +-20%).

The first setting of ``--settings`` is the one the ratios are to (greedy by default).

Medians over the timed steps. Run on an idle machine (torch's threads collapse otherwise):

    .venv/bin/python benches/bench_host_overhead.py [--batch-sizes 1,64,256] [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import tempfile
import time

import torch

from pagedrs import SamplingParams
from pagedrs.engine.llm_engine import LLMEngine

VOCAB = 49_152
SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature 1.0": SamplingParams(temperature=1.0),
    "t0.8 top_p0.95 top_k50": SamplingParams(temperature=0.8, top_p=0.95, top_k=50),
    "t1.0 top_p0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "t0.8 + presence/frequency 0.5 + repetition 1.1": SamplingParams(
        temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
    "t1.0 logprobs=5": SamplingParams(temperature=1.0, logprobs=5),
}
PHASES = ("schedule", "forward", "sampler", "update", "apply")


def build_model(directory: str) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", eos_token="w1").save_pretrained(directory)


class _Clock:
    """Adds up the seconds spent in named calls during one step."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


class _Timed:
    """Forwards to an object, timing the named methods (and calls of the object itself)."""

    def __init__(self, target, clock: _Clock, methods: dict[str, str], call: str | None = None):
        self._target = target
        self._call = clock.wrap(call, target) if call else None
        for method, phase in methods.items():
            setattr(self, method, clock.wrap(phase, getattr(target, method)))

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)


def instrument(engine: LLMEngine) -> _Clock:
    clock = _Clock()
    engine.scheduler = _Timed(engine.scheduler, clock, {"schedule": "schedule", "update_from_output": "update"})
    engine.executor.runner = _Timed(engine.executor.runner, clock, {"execute": "forward"})
    engine.sampler = _Timed(engine.sampler, clock, {}, call="sampler")
    processor = engine.processor
    processor._apply = clock.wrap("apply", processor._apply)  # type: ignore[method-assign]
    return clock


def measure(
    engine: LLMEngine, clock: _Clock, batch_size: int, params: SamplingParams, steps: int, prompt_len: int
) -> dict:
    generator = torch.Generator().manual_seed(batch_size)
    params = dataclasses.replace(params, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch_size):
        prompt = torch.randint(2, VOCAB, (prompt_len,), generator=generator).tolist()
        engine.add_request(f"b{batch_size}-{i}", prompt, params)
    # Prefill (and the first token) until every request decodes.
    while engine.scheduler.num_waiting or not _all_decoding(engine):
        engine.step()
    totals, phases = [], {name: [] for name in PHASES}
    for _ in range(steps):
        clock.seconds = dict.fromkeys(PHASES, 0.0)
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
        for name in PHASES:
            phases[name].append(clock.seconds[name])
        assert engine.last_schedule.num_decode_tokens == batch_size, "not a pure decode step"
    for i in range(batch_size):
        engine.abort_request(f"b{batch_size}-{i}")
    step_ms = statistics.median(totals) * 1e3
    own = [total - forward for total, forward in zip(totals, phases["forward"])]
    host = [value - sampler for value, sampler in zip(own, phases["sampler"])]
    return {
        "step_ms": step_ms,
        **{f"{name}_ms": statistics.median(values) * 1e3 for name, values in phases.items()},
        "engine_own_ms": statistics.median(own) * 1e3,
        "host_ms": statistics.median(host) * 1e3,
    }


def _all_decoding(engine: LLMEngine) -> bool:
    out = engine.last_schedule
    return out is not None and out.num_prefill_tokens == 0 and len(out) > 0


def run(
    batch_sizes: list[int],
    settings: list[str],
    steps: int,
    prompt_len: int = 32,
    device: str = "cpu",
    dtype: str = "auto",
    log=print,
) -> list[dict]:
    """Every setting at every batch size on one engine; returns one result a combination.

    On a GPU the phases are wall time on the host: the forward is its launches, and the
    sampler's one device-to-host copy waits for the device, so device time lands there."""
    results = []
    with tempfile.TemporaryDirectory() as directory:
        build_model(directory)
        engine = LLMEngine(
            model=directory,
            device=device,
            dtype=dtype,
            kv_cache_memory="256MiB",
            max_num_seqs=max(batch_sizes),
            max_num_batched_tokens=max(2048, max(batch_sizes) * prompt_len),
            seed=0,
        )
        clock = instrument(engine)
        log(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{platform.processor() or platform.machine()}, {engine.device} {engine.dtype}"
        )
        log(
            f"{'batch':>5}  {'setting':<48} {'step ms':>8} {'x greedy':>8} "
            + " ".join(f"{name:>9}" for name in PHASES)
            + f" {'own ms':>8} {'host ms':>8}"
        )
        for batch_size in batch_sizes:
            batch_results = []
            for name in settings:
                result = measure(engine, clock, batch_size, SETTINGS[name], steps, prompt_len)
                result.update(batch_size=batch_size, setting=name)
                batch_results.append(result)
            # NOTE: every setting runs the same forward pass, but its time moves by +-20% between
            # settings on a shared VM; so the ratio puts each setting's own work on one forward
            # time (the median over the settings), and the raw step times are kept beside it.
            forward_ms = statistics.median(result["forward_ms"] for result in batch_results)
            greedy = batch_results[0]
            for result in batch_results:
                result["ratio_to_greedy"] = (forward_ms + result["engine_own_ms"]) / (
                    forward_ms + greedy["engine_own_ms"]
                )
                log(
                    f"{batch_size:>5}  {result['setting']:<48} {result['step_ms']:>8.2f} "
                    f"{result['ratio_to_greedy']:>8.2f} "
                    + " ".join(f"{result[f'{phase}_ms']:>9.2f}" for phase in PHASES)
                    + f" {result['engine_own_ms']:>8.2f} {result['host_ms']:>8.2f}"
                )
            results += batch_results
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names from SETTINGS")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on a GPU")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = run(
        [int(b) for b in args.batch_sizes.split(",")],
        args.settings.split(","),
        args.steps,
        args.prompt_len,
        args.device,
        args.dtype,
        log=lambda line: print(line, flush=True),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "device": args.device,
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
