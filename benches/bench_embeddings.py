"""Embeddings on the default model: pagedrs against Hugging Face transformers `AutoModel` on
the same texts, side by side in one run, and what an embedding batch does to the streams
generating beside it on the same engine.

1. Throughput. Batches of 64 texts of exactly 128 tokens (fresh random texts every round, so
   pagedrs's prefix cache never helps). pagedrs: `LLM.embed` (last-token pooling, unit length),
   once with the GGUF's own packed weights (what `pagedrs serve` runs) and once dequantized to
   float32 (the weights HF runs). HF: `AutoModel` on the same GGUF (float32), one forward over
   the batch, the last position's hidden state, normalized. Rounds alternate between the
   systems; each rate is the median over rounds. The embeddings are checked against HF's
   (cosine) so both sides compute the same thing.
2. Mixed load. 16 chat streams generate (greedy, then temperature 1.0); once every stream has
   16 tokens, a batch of 64 texts x 128 tokens is queued for embedding on the same engine.
   Inter-token latency (ITL: time between a stream's consecutive tokens, taken when the
   engine step returns) is compared with the same streams generating alone, over the whole
   run and over the window while the embeddings are in flight, at several step token budgets
   (`max_num_batched_tokens`: how much prefill one step may carry beside the decodes).

    .venv/bin/python benches/bench_embeddings.py [--rounds 5] [--budgets 2048,512,256]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

import pagedrs
from pagedrs import LLM, PoolingParams, SamplingParams
from pagedrs.kernels.cpu import native_isa
from pagedrs.models.loader import resolve_model

WORDS = (
    "river stone market light paper garden window engine quiet northern train salt winter "
    "letter copper field evening harbor bread signal forest bridge music silver autumn cloud "
    "number orange theory station mountain coffee library morning story island thunder"
).split()


def random_texts(tokenizer, rng: random.Random, count: int, length: int) -> list[list[int]]:
    """``count`` token-id lists of exactly ``length`` tokens, from random word sequences."""
    texts = []
    for _ in range(count):
        ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(2 * length)))["input_ids"]
        texts.append(ids[:length])
    return texts


def load_hf_encoder():
    from transformers import AutoModel

    source = resolve_model(None)
    return AutoModel.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=torch.float32).eval()


def hf_embed(model, texts: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor(texts)).last_hidden_state[:, -1]
    return torch.nn.functional.normalize(hidden.float(), dim=-1)


def pagedrs_embed(llm: LLM, texts: list[list[int]]) -> torch.Tensor:
    outputs = llm.embed(texts, use_tqdm=False)
    return torch.tensor([output.outputs.embedding for output in outputs])


def throughput(args, tokenizer) -> dict:
    systems = {
        "pagedrs (GGUF packed weights)": LLM(max_num_batched_tokens=args.budget, kv_cache_memory="1GiB"),
        "pagedrs (float32 weights)": LLM(
            quantization="none", max_num_batched_tokens=args.budget, kv_cache_memory="1GiB"
        ),
    }
    hf = load_hf_encoder()
    rng = random.Random(args.seed)
    rates: dict[str, list[float]] = {name: [] for name in [*systems, "HF AutoModel (float32)"]}
    agreement: dict[str, float] = {}
    for round_index in range(args.rounds + 1):  # round 0 warms every system up
        texts = random_texts(tokenizer, rng, args.batch, args.tokens)
        start = time.perf_counter()
        reference = hf_embed(hf, texts)
        hf_seconds = time.perf_counter() - start
        if round_index:
            rates["HF AutoModel (float32)"].append(len(texts) / hf_seconds)
        for name, llm in systems.items():
            texts_here = random_texts(tokenizer, rng, args.batch, args.tokens) if round_index else texts
            start = time.perf_counter()
            embeddings = pagedrs_embed(llm, texts_here)
            seconds = time.perf_counter() - start
            if round_index:
                rates[name].append(len(texts_here) / seconds)
            else:  # the warm-up round embeds HF's texts: check both compute the same thing
                cosine = torch.nn.functional.cosine_similarity(embeddings, reference, dim=-1)
                agreement[name] = round(float(cosine.min()), 6)
    hf_rate = statistics.median(rates["HF AutoModel (float32)"])
    return {
        name: {
            "texts_per_s": round(statistics.median(values), 1),
            "rounds": [round(value, 1) for value in values],
            "vs_hf": round(statistics.median(values) / hf_rate, 2),
            **({"min_cosine_vs_hf": agreement[name]} if name in agreement else {}),
        }
        for name, values in rates.items()
    }


def _itl_summary(gaps: list[float]) -> dict:
    ordered = sorted(gaps)
    return {
        "median_ms": round(1e3 * statistics.median(ordered), 1),
        "mean_ms": round(1e3 * statistics.fmean(ordered), 1),
        "p90_ms": round(1e3 * ordered[int(0.9 * (len(ordered) - 1))], 1),
        "max_ms": round(1e3 * ordered[-1], 1),
        "count": len(ordered),
    }


def run_streams(llm: LLM, prompts, params: SamplingParams, embed_texts: list[list[int]] | None, tag: str) -> dict:
    """Steps the engine until the streams (and the embeddings, if any) are done; returns the
    streams' inter-token gaps over the whole run and inside the embeddings' window."""
    engine = llm.engine
    stream_ids = [f"{tag}-gen-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(stream_ids, prompts):
        engine.add_request(request_id, prompt, params)
    last_time: dict[str, float] = {}
    seen = dict.fromkeys(stream_ids, 0)
    gaps: list[tuple[float, float]] = []  # (time of the token, gap)
    window_start = window_end = None
    pending_embeddings: set[str] = set()
    while engine.has_unfinished_requests():
        results = engine.step()
        now = time.perf_counter()
        for result in results:
            if result.request_id in pending_embeddings and result.finished:
                pending_embeddings.discard(result.request_id)
                if not pending_embeddings:
                    window_end = now
            if result.request_id not in seen:
                continue
            count = len(result.outputs[0].token_ids)
            if count > seen[result.request_id]:
                if result.request_id in last_time:
                    gaps.append((now, (now - last_time[result.request_id]) / (count - seen[result.request_id])))
                last_time[result.request_id] = now
                seen[result.request_id] = count
        if embed_texts is not None and window_start is None and min(seen.values()) >= 16:
            for index, text in enumerate(embed_texts):
                request_id = f"{tag}-emb-{index}"
                engine.add_request(request_id, text, PoolingParams())
                pending_embeddings.add(request_id)
            window_start = time.perf_counter()
    everything = [gap for _, gap in gaps]
    record = {"all": _itl_summary(everything)}
    if window_start is not None:
        window_end = window_end or time.perf_counter()
        record["window"] = _itl_summary([gap for at, gap in gaps if window_start < at <= window_end])
        record["embeddings_seconds"] = round(window_end - window_start, 2)
    return record


def mixed_load(args, tokenizer) -> dict:
    results = {}
    rng = random.Random(args.seed + 1)
    for budget in args.budgets:
        # Room for the streams and the whole batch at once, as far as the budget allows.
        seats = min(args.streams + args.batch, budget)
        llm = LLM(max_num_batched_tokens=budget, kv_cache_memory="1GiB", max_num_seqs=seats)
        prompts = [
            llm.apply_chat_template([{"role": "user", "content": f"Tell a long story about {rng.choice(WORDS)}."}])
            for _ in range(args.streams)
        ]
        for name, temperature in (("greedy", 0.0), ("t1.0", 1.0)):
            params = SamplingParams(temperature=temperature, max_tokens=args.stream_tokens, ignore_eos=True, seed=1)
            run_streams(llm, prompts, params, None, f"warm-{budget}-{name}")
            alone = run_streams(llm, prompts, params, None, f"alone-{budget}-{name}")
            texts = random_texts(tokenizer, rng, args.batch, args.tokens)
            mixed = run_streams(llm, prompts, params, texts, f"mixed-{budget}-{name}")
            results[f"budget {budget}, {name}"] = entry = {
                "alone": alone["all"],
                "mixed": mixed["all"],
                "mixed_window": mixed["window"],
                "embeddings_seconds": mixed["embeddings_seconds"],
                "mean_itl_ratio": round(mixed["all"]["mean_ms"] / alone["all"]["mean_ms"], 2),
                "median_itl_ratio": round(mixed["all"]["median_ms"] / alone["all"]["median_ms"], 2),
                "window_mean_itl_ratio": round(mixed["window"]["mean_ms"] / alone["all"]["mean_ms"], 2),
            }
            print(f"budget {budget}, {name}:", json.dumps(entry), flush=True)  # as it comes
        llm.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens of the throughput part")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--budgets", default="2048,512,256", help="token budgets of the mixed-load part")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-mixed", action="store_true")
    args = parser.parse_args()
    args.budgets = [int(value) for value in args.budgets.split(",")]
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    source = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    record: dict = {
        "pagedrs": pagedrs.__version__,
        "torch": torch.__version__,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "isa": native_isa(),
        "batch": args.batch,
        "tokens_per_text": args.tokens,
    }
    if not args.skip_throughput:
        record["throughput"] = throughput(args, tokenizer)
        print("throughput:", json.dumps(record["throughput"]), flush=True)  # as it comes
    if not args.skip_mixed:
        record["mixed_load"] = mixed_load(args, tokenizer)
    print(json.dumps(record, indent=2))
    for name, entry in record.get("throughput", {}).items():
        print(f"{name:<32} {entry['texts_per_s']:8.1f} texts/s  {entry['vs_hf']:5.2f}x HF")
    for name, entry in record.get("mixed_load", {}).items():
        print(
            f"{name:<22} ITL mean {entry['alone']['mean_ms']:6.1f} -> {entry['mixed']['mean_ms']:6.1f} ms "
            f"({entry['mean_itl_ratio']}x), median {entry['median_itl_ratio']}x, "
            f"window mean {entry['window_mean_itl_ratio']}x, embeddings {entry['embeddings_seconds']} s"
        )


if __name__ == "__main__":
    main()
