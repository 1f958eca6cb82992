"""Data-parallel replicas behind `pagedrs-router` (issue 33), on real processes over loopback,
side by side in one run:

1. **Routing policies** on a shared-prefix multi-turn chat workload: ``--systems`` system
   prompts, two conversations each, ``--turns`` turns, ``--concurrency`` conversations at a
   time, through ``pagedrs serve -dp 2`` (two replicas, one core each on a 2-core machine).
   For ``cache_aware`` and ``round_robin``, greedy and at temperature 1.0: the replicas'
   prefix-cache hit rate (prompt tokens found cached / looked up, from their ``/metrics``),
   the prompt tokens they computed, the wall time, output tokens per second and requests per
   second. ``--kv-cache-memory`` sets each replica's budget: where one replica cannot hold the
   whole working set, round-robin's copies of every prefix on both replicas evict each other.
2. **Router overhead**: time to first token of one streamed completion, straight to a replica
   and through the router in front of it, alternated ``--ttft-rounds`` times (paired medians).

    .venv/bin/python benches/bench_router.py [--systems 10] [--turns 4] [--kv-cache-memory 200MiB]
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedrs.kernels.cpu import native_isa
from pagedrs.server.data_parallel import router_binary
from tests.helpers.servers import Server, free_port, start_server

TOPICS = ["a bakery", "a railway timetable office", "a lighthouse", "a chess club", "a library", "a bicycle shop",
          "a weather station", "a vineyard", "a museum of clocks", "a harbour"]  # fmt: skip
QUESTIONS = ["What should a visitor know first?", "Tell me more about that.", "What is the most common mistake?",
             "Summarize your advice in one sentence.", "And what would you say to a child?"]  # fmt: skip


def system_prompt(index: int, run: int) -> str:
    """The ``index``-th system prompt of run ``run``: each run's prompts start differently,
    so no run finds another's cached."""
    topic = TOPICS[index % len(TOPICS)]
    rules = " ".join(f"Rule {rule}: answer questions about {topic} politely and precisely." for rule in range(1, 25))
    return f"Run {run}. You are the assistant of {topic}. {rules}"


def chat(port: int, messages: list[dict], temperature: float, max_tokens: int) -> tuple[str, int]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "seed": len(messages)}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    assert response.status == 200, answer
    return answer["choices"][0]["message"]["content"] or "", answer["usage"]["completion_tokens"]


def conversation(port: int, system: str, turns: int, temperature: float, max_tokens: int) -> int:
    messages = [{"role": "system", "content": system}]
    generated = 0
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        text, tokens = chat(port, messages, temperature, max_tokens)
        messages.append({"role": "assistant", "content": text})
        generated += tokens
    return generated


def cache_counts(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        metrics = Server(process=None, port=int(url.rsplit(":", 1)[1]), log_path="").metrics()  # type: ignore[arg-type]
        hits += metrics["pagedrs:prefix_cache_hits_total"]
        queries += metrics["pagedrs:prefix_cache_queries_total"]
    return hits, queries


def policy_run(args: argparse.Namespace, model: list[str], policy: str, directory: str) -> list[dict]:
    budget = ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else []
    front = start_server([*model, *budget, "-dp", "2", "--router-policy", policy], f"{directory}/{policy}.log")
    runs = []
    try:
        urls = [worker["url"] for worker in front.request("GET", "/workers")[1]["workers"]]
        chat(front.port, [{"role": "user", "content": "Hello"}], 0.0, 2)  # warm-up
        for run, temperature in enumerate((0.0, 1.0)):
            hits_before, queries_before = cache_counts(urls)
            systems = [system_prompt(index, run) for index in range(args.systems) for _ in range(2)]
            talk = functools.partial(
                conversation, front.port, turns=args.turns, temperature=temperature, max_tokens=args.max_tokens
            )
            start = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                generated = sum(pool.map(talk, systems))
            seconds = time.monotonic() - start
            hits, queries = cache_counts(urls)
            run = {
                "policy": policy,
                "temperature": temperature,
                "requests": len(systems) * args.turns,
                "seconds": round(seconds, 2),
                "output_tokens_per_s": round(generated / seconds, 1),
                "requests_per_s": round(len(systems) * args.turns / seconds, 3),
                "prefix_hit_rate": round((hits - hits_before) / (queries - queries_before), 3),
                "prompt_tokens_computed": int((queries - queries_before) - (hits - hits_before)),
            }
            print(json.dumps(run), flush=True)
            runs.append(run)
    finally:
        front.stop()
        front.process.wait(60)
    return runs


def first_token_seconds(port: int) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "stream": True}
    start = time.monotonic()
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    while not response.readline().startswith(b"data: "):
        pass
    seconds = time.monotonic() - start
    response.read()
    connection.close()
    return seconds


def router_overhead(args: argparse.Namespace, model: list[str], directory: str) -> dict:
    worker = start_server(model, f"{directory}/worker.log")
    port = free_port()
    command = [router_binary(), "--port", str(port), "--worker", worker.base_url]
    router = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert router.stdout is not None and "listening on" in router.stdout.readline()
        for _ in range(3):
            first_token_seconds(worker.port), first_token_seconds(port)
        direct, routed = [], []
        for _ in range(args.ttft_rounds):
            direct.append(first_token_seconds(worker.port))
            routed.append(first_token_seconds(port))
        differences = sorted(r - d for r, d in zip(routed, direct))
        return {
            "direct_ttft_ms": round(statistics.median(direct) * 1e3, 2),
            "routed_ttft_ms": round(statistics.median(routed) * 1e3, 2),
            "added_ms_median_of_pairs": round(statistics.median(differences) * 1e3, 2),
            "rounds": args.ttft_rounds,
        }
    finally:
        router.terminate()
        router.wait(30)
        worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ttft-rounds", type=int, default=60)
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--kv-cache-memory", default=None, help="each replica's KV budget (default: the engine's)")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model = [args.model] if args.model else []
    record: dict = {"cpu": platform.processor() or platform.machine(), "isa": native_isa(), "workload": vars(args)}
    with tempfile.TemporaryDirectory() as directory:
        record["policies"] = [
            run for policy in args.policies.split(",") for run in policy_run(args, model, policy, directory)
        ]
        record["router_overhead"] = router_overhead(args, model, directory)
        print(json.dumps(record["router_overhead"]), flush=True)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
