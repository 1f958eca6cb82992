"""Speculative decoding on the default model, side by side in one run: no speculation, n-gram
(prompt lookup) and suffix decoding, each its own engine in this process, run interleaved
request by request.

(a) copy: prompts whose answer repeats or edits text from the prompt (quote, fix, repeat);
(b) chat: open-ended prompts;
    both single stream, each request timed end to end (prefill included), greedy and sampled
    (temperature 1.0, the OpenAI default), every prompt distinct within a run;
(b') chat repeated: the chat prompts asked again (the suffix method's cache of earlier
    outputs proposes the earlier answers: the agentic case of outputs that repeat);
(c) mixed lengths at batch 32 (output lengths 8..256, chat prompts): with speculation stepping
    aside at `disable_by_batch_size` (the default) and with it forced on;
(d) the batch size at which speculation stops paying: copy prompts at batch 1..16, forced on.

Reported: tokens/s (output tokens over wall time, prefill included), decode tokens/s (tokens
after each request's first over the time after it), speedups against no speculation, and
acceptance (accepted / proposed tokens, mean tokens per speculative step).

    .venv/bin/python benches/bench_spec_decode.py [--max-tokens 256] [--batch 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

import pagedrs
from pagedrs import LLM, SamplingParams

PASSAGES = [
    "The committee met on Tuesday to review the budget. After a long discussion, members agreed to "
    "fund the library renovation, postpone the new parking lot, and hire two additional teachers for "
    "the fall semester. The treasurer reported that donations had risen by twelve percent since last "
    "year, mostly thanks to the spring fair and the online campaign. Several parents asked whether the "
    "gym roof would be repaired before winter; the chair promised a written answer by the end of the "
    "month. The next meeting will be held in the main hall on the first Monday of October.",
    "def average(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef median(values):\n    ordered = sorted(values)\n"
    "    middle = len(ordered) // 2\n    if len(ordered) % 2 == 0:\n"
    "        return (ordered[middle - 1] + ordered[middle]) / 2\n    return ordered[middle]\n\n\n"
    "def spread(values):\n    return max(values) - min(values)\n",
    "Photosynthesis converts light energy into chemical energy. Plants absorb sunlight with chlorophyll, "
    "take in carbon dioxide through their leaves, and release oxygen as a by-product. The sugars they "
    "make feed the plant and, through food chains, almost every other living thing. In the light "
    "reactions, water is split and energy is stored in small carrier molecules; in the Calvin cycle, "
    "that energy is used to build sugars from carbon dioxide. Without photosynthesis, the oxygen in our "
    "atmosphere would slowly disappear.",
]
COPY_TASKS = [
    "Repeat the following text exactly, word for word:\n{passage}",
    "Fix any spelling mistakes in the following text and return the whole text:\n{passage}",
    "Quote the following text in full, then say nothing else:\n{passage}",
]
CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "What are three good habits for learning a new language?",
    "Describe your ideal weekend.",
    "Explain why the sky is blue to a child.",
    "Give me a recipe for a simple tomato soup.",
    "What should I pack for a week of hiking?",
    "Write a poem about autumn leaves.",
    "How do I politely decline a meeting invitation?",
]
# Asked in the sampled run, so that no chat prompt there was answered before in the run.
SAMPLED_CHAT_PROMPTS = [
    "Tell me about the history of bicycles.",
    "What makes a good cup of coffee?",
    "Write a letter to a friend who moved away.",
    "Suggest a name for a small bakery and explain it.",
    "Why do cats purr?",
    "Describe a busy train station in the morning.",
    "What are the benefits of walking every day?",
    "Invent a board game and explain its rules.",
]
TOPICS = ["the sea", "a city at night", "music", "old trees", "space travel", "a market", "rain", "bread"]

METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def run_batch(llm: LLM, prompts, params_list) -> tuple[float, int, dict]:
    """Runs the prompts as one batch to the end; ``(seconds, output tokens, stats delta)``, the
    delta with ``first_token_seconds`` (until the first request got its first token)."""
    engine = llm.engine
    before = engine.scheduler.stats()
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, params)
    num_tokens = 0
    first_token = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first_token is None and outputs:
            first_token = time.perf_counter() - start
        for output in outputs:
            if output.finished:
                num_tokens += sum(len(choice.token_ids) for choice in output.outputs)
    seconds = time.perf_counter() - start
    after = engine.scheduler.stats()
    delta = {
        name: getattr(after, name) - getattr(before, name)
        for name in ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total")
    }
    delta["first_token_seconds"] = first_token or 0.0
    return seconds, num_tokens, delta


def acceptance(delta: dict) -> dict:
    drafts, proposed, accepted = (
        delta["num_drafts_total"],
        delta["num_draft_tokens_total"],
        delta["num_accepted_tokens_total"],
    )
    return {
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "tokens_per_spec_step": round(1 + accepted / drafts, 2) if drafts else None,
        "proposed": proposed,
        "accepted": accepted,
    }


def single_stream(engines: dict[str, LLM], prompts: list[list[int]], params: SamplingParams, repeats: int = 1) -> dict:
    """Each prompt alone, methods interleaved; tokens/s = all output tokens over all time."""
    zero = {"num_drafts_total": 0, "num_draft_tokens_total": 0, "num_accepted_tokens_total": 0}
    totals = {name: [0.0, 0, {**zero, "first_token_seconds": 0.0, "requests": 0}] for name in engines}
    for _ in range(repeats):
        for prompt in prompts:
            for name, llm in engines.items():
                seconds, tokens, delta = run_batch(llm, [prompt], [params])
                totals[name][0] += seconds
                totals[name][1] += tokens
                for key, value in delta.items():
                    totals[name][2][key] += value
                totals[name][2]["requests"] += 1

    def decode_rate(seconds: float, tokens: int, delta: dict) -> float:
        # Tokens after each request's first, over the time after it.
        return (tokens - delta["requests"]) / (seconds - delta["first_token_seconds"])

    base = totals["none"][1] / totals["none"][0]
    base_decode = decode_rate(*totals["none"])
    return {
        name: {
            "tok_s": round(tokens / seconds, 1),
            "speedup": round(tokens / seconds / base, 2),
            "decode_tok_s": round(decode_rate(seconds, tokens, delta), 1),
            "decode_speedup": round(decode_rate(seconds, tokens, delta) / base_decode, 2),
            "output_tokens": tokens,
            **acceptance(delta),
        }
        for name, (seconds, tokens, delta) in totals.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument("--json", help="also write the record here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engines = {
        name: LLM(kv_cache_memory="1GiB", max_num_seqs=64, speculative_config=spec) for name, spec in METHODS.items()
    }
    # Speculation forced on whatever the batch (the step-aside rule off), for (c) and (d).
    forced = {
        name: LLM(kv_cache_memory="1GiB", max_num_seqs=64, speculative_config={**spec, "disable_by_batch_size": 0})
        for name, spec in METHODS.items()
        if spec is not None
    }
    any_llm = engines["none"]
    copy_prompts = [chat(any_llm, task.format(passage=p)) for task in COPY_TASKS for p in PASSAGES]
    chat_prompts = [chat(any_llm, text) for text in CHAT_PROMPTS]
    for llm in [*engines.values(), *forced.values()]:  # warm up every engine
        run_batch(llm, [copy_prompts[0]], [SamplingParams(temperature=0, max_tokens=8)])

    record: dict = {
        "pagedrs": pagedrs.__version__,
        "torch": torch.__version__,
        "threads": args.threads,
        "methods": METHODS,
        "max_tokens": args.max_tokens,
    }
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    # Unseeded: seeded sampled requests do not speculate (their text must not depend on the batch).
    sampled = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    # NOTE: greedy first, then sampled, then greedy chat again: only the last asks a prompt the
    # suffix cache has seen (as the same request) before.
    sampled_chat_prompts = [chat(any_llm, text) for text in SAMPLED_CHAT_PROMPTS]
    for label, params, chats in (("greedy", greedy, chat_prompts), ("t1.0", sampled, sampled_chat_prompts)):
        for workload, prompts in (("copy", copy_prompts), ("chat", chats)):
            result = single_stream(engines, prompts, params)
            record[f"{workload} {label}"] = result
            print(f"{workload:5s} {label:6s}", json.dumps(result), flush=True)
    result = single_stream(engines, chat_prompts, greedy)
    record["chat greedy, repeated"] = result
    print("chat greedy repeated", json.dumps(result), flush=True)

    # (d) batch sizes, copy prompts, greedy, speculation forced on.
    sweep = {}
    for size in (1, 2, 4, 8, 16):
        prompts = [copy_prompts[i % len(copy_prompts)] for i in range(size)]
        params = [greedy] * size
        row = {}
        for name, llm in {"none": engines["none"], **forced}.items():
            seconds, tokens, _ = run_batch(llm, prompts, params)
            row[name] = round(tokens / seconds, 1)
        sweep[size] = row
        print(f"batch {size:2d} copy greedy (forced)", json.dumps(row), flush=True)
    record["copy greedy by batch size (forced)"] = sweep

    if not args.skip_mixed:
        rng = random.Random(0)
        prompts = [chat(any_llm, f"Write about {rng.choice(TOPICS)} (#{i}).") for i in range(args.batch)]
        lengths = [rng.randint(8, 256) for _ in prompts]
        for label, temperature in (("greedy", 0.0), ("t1.0", 1.0)):
            params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in lengths]
            row = {}
            for name, llm in [*engines.items(), *((f"{n} forced", llm) for n, llm in forced.items())]:
                seconds, tokens, delta = run_batch(llm, prompts, params)
                row[name] = {"tok_s": round(tokens / seconds, 1), **acceptance(delta)}
            record[f"mixed batch {args.batch} {label}"] = row
            print(f"mixed {label}", json.dumps(row), flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
