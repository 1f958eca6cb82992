"""``pagedrs bench serve``: one benchmark run against an OpenAI-compatible server, written
as one JSON record that says what was measured.

The method: after start-up, one fixed short greedy request is sent and printed (check the
tokenization, the template, the precision and the output by eye); warm-up requests, whose
prompts share nothing with the workload, are excluded; then the workload, varying one
thing at a time. With ``--ignore-eos`` (the default for generated workloads) every request
produces exactly its asked-for length, so two systems compared on the same seed do the same
work; the record counts requests whose length differed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from pagedrs.bench.client import Endpoint, MetricsSampler, run_requests
from pagedrs.bench.stats import SLO, RequestResult, summarize
from pagedrs.bench.workloads import PRESETS, Lengths, Preset, RequestSpec, generate, load_jsonl

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionUserMessageParam

SCHEMA = "pagedrs-bench-serve/1"
SANITY_MESSAGES: list[ChatCompletionUserMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="no-reuse",
        help="workload preset; the flags below override its settings",
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to measure (without /v1)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDRS_API_KEY"))
    parser.add_argument(
        "--launch",
        action="store_true",
        help="start `pagedrs serve` on a free port for this run (needed by cold-start and by "
        "memory-pressure's small cache), and stop it after",
    )
    parser.add_argument("--server-model", default=None, help="with --launch: the model the server loads")
    parser.add_argument("--server-args", default="", help="with --launch: more `pagedrs serve` flags, one string")
    parser.add_argument("--num-requests", type=int, default=None, help="per phase")
    parser.add_argument("--input-len", default=None, help="prompt tokens: N, or LOW:HIGH (uniform)")
    parser.add_argument("--output-len", default=None, help="output tokens: N, or LOW:HIGH (uniform)")
    parser.add_argument("--shared-prefix-len", type=int, default=None)
    parser.add_argument(
        "--dataset", default=None, help="JSONL of prompts ({'prompt': ...} or {'messages': ...}, optional 'output_len')"
    )
    parser.add_argument(
        "--token-range", default="1000:20000", help="token ids generated prompts are drawn from, LOW:HIGH"
    )
    parser.add_argument("--request-rate", type=float, default=None, help="requests/s, Poisson (default: inf)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every request generates exactly its output length (default: on for generated prompts)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (0: greedy, the default; OpenAI's is 1.0)",
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling of every request (with --temperature > 0)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="requests sent first and left out of the results")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--slo-e2e-ms", type=float, default=None)
    parser.add_argument(
        "--hf-baseline",
        action="store_true",
        help="then run the same prompts through Hugging Face `generate` in static batches, "
        "in this process (the server should be idle or stopped)",
    )
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--label", default=None, help="a name for this run in the record")
    parser.add_argument("--output", default=None, help="JSON record path (default: results/<preset>-<time>.json)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """The preset's settings with the command line's overrides."""
    preset: Preset = PRESETS[args.preset]
    rate = args.request_rate if args.request_rate is not None else preset.request_rate
    return {
        "preset": preset.name,
        "description": preset.description,
        "num_requests": args.num_requests or preset.num_requests,
        "input_len": args.input_len or preset.input_len,
        "output_len": args.output_len or preset.output_len,
        "shared_prefix_len": preset.shared_prefix_len if args.shared_prefix_len is None else args.shared_prefix_len,
        "phases": list(preset.phases),
        "dataset": args.dataset,
        "token_range": args.token_range,
        "request_rate": "inf" if rate == float("inf") else rate,
        "max_concurrency": args.max_concurrency if args.max_concurrency is not None else preset.max_concurrency,
        "ignore_eos": args.ignore_eos if args.ignore_eos is not None else args.dataset is None,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "warmup_requests": args.warmup,
        "launched_server": args.launch,
        "server_args": (preset.server_args + args.server_args.split()) if args.launch else None,
    }


def workload(settings: dict[str, Any]) -> list[RequestSpec]:
    output_len = Lengths.parse(settings["output_len"])
    if settings["dataset"]:
        return load_jsonl(settings["dataset"], output_len, settings["seed"], settings["num_requests"])
    low, _, high = settings["token_range"].partition(":")
    return generate(
        settings["num_requests"],
        Lengths.parse(settings["input_len"]),
        output_len,
        settings["seed"],
        (int(low), int(high)),
        settings["shared_prefix_len"],
        tuple(settings["phases"]),
    )


def launch_server(model: str | None, server_args: list[str], log_path: str, timeout: float = 600):
    """Starts `pagedrs serve` on a free port: ``(process, endpoint, seconds to ready)``."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "pagedrs.server", *([model] if model else []), "--port", str(port), *server_args]
    start = time.perf_counter()
    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    endpoint = Endpoint(f"http://127.0.0.1:{port}")
    while time.perf_counter() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        try:
            if endpoint.get("/health", timeout=2)[0] == 200:
                return process, endpoint, time.perf_counter() - start, start
        except OSError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server was not ready in {timeout} s; see {log_path}")


async def sanity_check(endpoint: Endpoint) -> dict[str, Any]:
    """One fixed short greedy chat request (streamed, so its first token is timed), printed
    so a person can check tokenization, template, precision and output."""
    started = time.perf_counter()
    stream = await endpoint.client.chat.completions.create(
        model=await endpoint.resolve_model(),
        messages=SANITY_MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, first, finish, counts = "", None, None, None
    async for chunk in stream:
        if chunk.usage is not None:
            counts = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                text += choice.delta.content
            finish = choice.finish_reason or finish
    status, tokenized = await asyncio.to_thread(endpoint.post, "/tokenize", {"messages": SANITY_MESSAGES})
    sanity = {
        "messages": SANITY_MESSAGES,
        "output": text,
        "finish_reason": finish,
        "prompt_tokens": counts.prompt_tokens if counts else None,
        "completion_tokens": counts.completion_tokens if counts else None,
        "templated_prompt_tokens": tokenized.get("tokens") if status == 200 and isinstance(tokenized, dict) else None,
        "started_at": started,
        "ttft_s": None if first is None else first - started,
    }
    print(
        f"sanity request: {SANITY_MESSAGES[0]['content']!r} -> {text!r} "
        f"({sanity['prompt_tokens']} prompt tokens, finish {finish})",
        flush=True,
    )
    return sanity


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    def delta(key: str) -> float | None:
        return after[key] - before[key] if key in after and key in before else None

    queries, hits = delta("prefix_queries"), delta("prefix_hits")
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": (hits / queries) if queries and hits is not None else None,
        "preemptions": delta("preemptions"),
        "server_cpu_seconds": delta("server_cpu_seconds"),
        "prompt_tokens": delta("prompt_tokens"),
        "generation_tokens": delta("generation_tokens"),
    }


async def measure(
    endpoint: Endpoint, settings: dict[str, Any], specs: list[RequestSpec], slo: SLO, progress: bool
) -> dict[str, Any]:
    """Runs each phase in turn (warm-up first, excluded); returns the record's measured part."""
    from tqdm.auto import tqdm

    rate = float(settings["request_rate"])
    common = dict(
        request_rate=rate,
        max_concurrency=settings["max_concurrency"],
        ignore_eos=settings["ignore_eos"],
        temperature=settings["temperature"],
        top_p=settings.get("top_p", 1.0),
        seed=settings["seed"],
    )
    if settings["warmup_requests"]:
        low, _, high = settings["token_range"].partition(":")
        warmup = generate(
            settings["warmup_requests"], Lengths(16), Lengths(8), settings["seed"] + 10**6, (int(low), int(high))
        )
        await run_requests(endpoint, warmup, t0=time.perf_counter(), **{**common, "request_rate": float("inf")})
    sampler = MetricsSampler(endpoint)
    t0 = time.perf_counter()
    sampler.start(t0)
    phases: dict[str, Any] = {}
    results: list[tuple[str, RequestResult]] = []
    bar = tqdm(total=len(specs), desc=settings["preset"], disable=not progress)
    try:
        for phase in settings["phases"]:
            phase_specs = [spec for spec in specs if spec.phase == phase] or specs
            before = await asyncio.to_thread(endpoint.metrics)
            start, client_cpu = time.perf_counter(), time.process_time()
            phase_results = await run_requests(endpoint, phase_specs, t0=t0, progress=bar, **common)
            duration, client_cpu = time.perf_counter() - start, time.process_time() - client_cpu
            after = await asyncio.to_thread(endpoint.metrics)
            server = metric_deltas(before, after)
            # The load generator's own CPU time: on a small machine it competes with the server.
            server["client_cpu_seconds"] = client_cpu
            phases[phase] = {"summary": summarize(phase_results, duration, slo), "server": server}
            results += [(phase, result) for result in phase_results]
            if phase_specs is specs:
                break
    finally:
        bar.close()
        await sampler.stop()
    timeline = sampler.timeline
    peak = max((point.get("kv_usage", 0.0) for point in timeline), default=None)
    return {
        "phases": phases,
        "peak_kv_usage": peak,
        "timeline": timeline,
        "requests": [
            {
                "phase": phase,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "start": round(r.start, 4),
                "ttft": r.ttft,
                "e2e": r.e2e,
                "tpot": r.tpot,
                "success": r.success,
                "error": r.error,
            }
            for phase, r in results
        ],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagedrs.envinfo import environment

    settings = settings_from(args)
    if args.preset == "cold-start" and not args.launch:
        raise SystemExit("cold-start measures a server's start-up: add --launch")
    specs = workload(settings)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    output = args.output or os.path.join(
        "results", f"{settings['preset']}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    )
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "label": args.label,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "settings": settings,
        "client_environment": environment(),
    }
    process = None
    try:
        if args.launch:
            process, endpoint, ready, launched_at = launch_server(
                args.server_model, settings["server_args"], output.removesuffix(".json") + ".server.log"
            )
            record["cold_start"] = {"process_start_to_ready_s": ready}
        else:
            endpoint = Endpoint(args.base_url, args.api_key, args.model)
        endpoint.model = args.model or endpoint.model

        async def session() -> None:
            await endpoint.resolve_model()
            record["model"] = endpoint.model
            record["server_info"] = await asyncio.to_thread(endpoint.server_info)
            record["sanity"] = sanity = await sanity_check(endpoint)
            if args.launch:
                record["cold_start"]["first_request_ttft_s"] = sanity["ttft_s"]
                record["cold_start"]["process_start_to_first_token_s"] = (
                    sanity["started_at"] - launched_at + sanity["ttft_s"]
                )
            del sanity["started_at"]
            if settings["preset"] != "cold-start":
                record.update(await measure(endpoint, settings, specs, slo, not args.no_progress))
            await endpoint.client.close()

        asyncio.run(session())
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    if args.hf_baseline:
        record["hf_baseline"] = hf_baseline(args, specs)
    _fill_headline(record)
    with open(output, "w") as f:
        json.dump(record, f, indent=1)
    print(report(record))
    print(f"record: {output}")
    return record


def hf_baseline(args: argparse.Namespace, specs: list[RequestSpec]) -> dict[str, Any]:
    from pagedrs.bench.hf_baseline import load_hf_model, run_static_batches

    prompts = [spec.prompt for spec in specs if isinstance(spec.prompt, list)]
    if len(prompts) != len(specs):
        raise SystemExit("--hf-baseline needs generated (token-id) prompts")
    model, tokenizer = load_hf_model(args.server_model)
    print(f"HF transformers generate, static batches of {args.hf_batch} ...", flush=True)
    return run_static_batches(
        model,
        tokenizer,
        prompts,
        [spec.output_len for spec in specs],
        args.hf_batch,
        temperature=args.temperature,
        top_p=args.top_p,
    )


def _fill_headline(record: dict[str, Any]) -> None:
    """The run's main numbers at the top of the record."""
    phases = record.get("phases") or {}
    if phases:
        first = next(iter(phases.values()))["summary"]
        record["headline"] = {
            "output_throughput": first["output_throughput"],
            "request_throughput": first["request_throughput"],
            "ttft_ms_median": first["ttft_ms"]["median"],
            "tpot_ms_median": first["tpot_ms"]["median"],
            "failed": sum(p["summary"]["failed"] for p in phases.values()),
        }
        if "hf_baseline" in record:
            record["headline"]["hf_useful_tok_s"] = record["hf_baseline"]["useful_tok_s"]
            record["headline"]["ratio_vs_hf"] = first["output_throughput"] / record["hf_baseline"]["useful_tok_s"]


def report(record: dict[str, Any]) -> str:
    """A short human-readable summary of a record."""
    lines = [f"== {record['settings']['preset']} on {record.get('model')} =="]
    if "cold_start" in record:
        lines.append("cold start: " + ", ".join(f"{k} {v:.2f}" for k, v in record["cold_start"].items()))
    for phase, data in (record.get("phases") or {}).items():
        s, server = data["summary"], data["server"]
        lines.append(
            f"[{phase}] {s['completed']} ok / {s['failed']} failed in {s['duration_s']:.1f} s: "
            f"{s['output_throughput']:.1f} out tok/s, {s['request_throughput']:.2f} req/s"
        )
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = s[key]
            if d["count"]:
                lines.append(
                    f"  {key:8s} mean {d['mean']:9.1f}  median {d['median']:9.1f}  p90 {d['p90']:9.1f}  "
                    f"p99 {d['p99']:9.1f}"
                )
        if "goodput" in s:
            lines.append(f"  goodput {s['goodput']:.2f} req/s ({s['good_requests']} met the SLO)")
        rate = server.get("prefix_cache_hit_rate")
        lines.append(
            f"  prefix-cache hit rate {'-' if rate is None else f'{rate:.1%}'}, preemptions {server.get('preemptions')}"
        )
        cpu = server.get("server_cpu_seconds")
        lines.append(
            f"  CPU seconds: server {'-' if cpu is None else f'{cpu:.1f}'}, "
            f"this load generator {server['client_cpu_seconds']:.1f} (wall {s['duration_s']:.1f})"
        )
    if record.get("peak_kv_usage") is not None:
        lines.append(f"peak KV usage {record['peak_kv_usage']:.1%}")
    if "hf_baseline" in record:
        hf = record["hf_baseline"]
        lines.append(
            f"HF static batches of {hf['batch_size']}: {hf['useful_tok_s']:.1f} useful tok/s "
            f"(useful share {hf['useful_share']:.0%}); ratio {record['headline']['ratio_vs_hf']:.2f}x"
        )
    return "\n".join(lines)
