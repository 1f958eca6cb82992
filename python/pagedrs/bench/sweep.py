"""``pagedrs bench sweep``: one preset over several concurrency levels, then plots; and
``pagedrs bench plot``, which draws the same plots from existing records."""

from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Any

from pagedrs.bench.serve import add_bench_serve_arguments, run


def add_sweep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_bench_serve_arguments(parser)
    parser.add_argument(
        "--concurrency", default="1,4,16", help="comma-separated max-concurrency levels (inf: no limit)"
    )
    parser.add_argument("--out-dir", default="results/sweep", help="records and plots go here")
    parser.add_argument(
        "--min-requests-per-slot", type=int, default=2, help="send at least this many requests per concurrency slot"
    )
    return parser


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    os.makedirs(args.out_dir, exist_ok=True)
    records = []
    for index, level in enumerate(args.concurrency.split(",")):
        run_args = copy.copy(args)
        # A new seed per level: fresh prompts (and a fresh shared prefix, so "cold" is cold).
        run_args.seed = args.seed + index
        run_args.max_concurrency = None if level.strip() == "inf" else int(level)
        if run_args.max_concurrency:
            from pagedrs.bench.workloads import PRESETS

            base = args.num_requests or PRESETS[args.preset].num_requests
            run_args.num_requests = max(base, args.min_requests_per_slot * run_args.max_concurrency)
        run_args.label = f"{args.label or args.preset} concurrency={level.strip()}"
        run_args.output = os.path.join(args.out_dir, f"{args.preset}-c{level.strip()}.json")
        records.append(run(run_args))
        # The baseline does not depend on concurrency: run it once.
        args.hf_baseline = False
    for path in plot(records, args.out_dir):
        print(f"plot: {path}")
    return records


def _concurrency(record: dict[str, Any]) -> float:
    value = record["settings"]["max_concurrency"]
    return float("inf") if value is None else float(value)


def plot(records: list[dict[str, Any]], out_dir: str) -> list[str]:
    """Throughput and latency vs concurrency, KV usage and preemptions over time, and the
    prefix-cache hit rate per phase (cold vs warm). Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = sorted((r for r in records if r.get("phases")), key=_concurrency)
    if not measured:
        return []
    preset = measured[0]["settings"]["preset"]
    levels = [_concurrency(r) for r in measured]
    labels = ["inf" if level == float("inf") else str(int(level)) for level in levels]
    positions = list(range(len(measured)))
    first_phase = [next(iter(r["phases"].values()))["summary"] for r in measured]
    paths = []

    def save(figure, name: str) -> None:
        path = os.path.join(out_dir, f"{preset}-{name}.png")
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)

    figure, left = plt.subplots(figsize=(6, 4))
    left.plot(positions, [s["output_throughput"] for s in first_phase], "o-", label="output tokens/s")
    left.plot(
        positions,
        [s["total_token_throughput"] for s in first_phase],
        "o:",
        color="tab:green",
        label="prompt + output tokens/s",
    )
    left.set_xlabel("max concurrency")
    left.set_ylabel("tokens/s")
    right = left.twinx()
    right.plot(positions, [s["request_throughput"] for s in first_phase], "s--", color="tab:orange", label="requests/s")
    right.set_ylabel("requests/s")
    left.set_xticks(positions, labels)
    left.set_title(f"{preset}: throughput vs concurrency")
    figure.legend(loc="upper left", bbox_to_anchor=(0.14, 0.86), fontsize="small")
    save(figure, "throughput")

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, key, title in [
        (axes[0], "ttft_ms", "time to first token"),
        (axes[1], "tpot_ms", "time per output token"),
    ]:
        for stat, style in [("median", "o-"), ("p90", "s--"), ("p99", "^:")]:
            axis.plot(positions, [s[key][stat] for s in first_phase], style, label=stat)
        axis.set_xticks(positions, labels)
        axis.set_xlabel("max concurrency")
        axis.set_ylabel("ms")
        axis.set_title(title)
        axis.legend()
    figure.suptitle(f"{preset}: latency vs concurrency")
    save(figure, "latency")

    figure, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for record, label in zip(measured, labels):
        timeline = record.get("timeline") or []
        if not timeline:
            continue
        times = [point["t"] for point in timeline]
        axes[0].plot(times, [100 * point.get("kv_usage", 0.0) for point in timeline], label=f"c={label}")
        base = timeline[0].get("preemptions", 0.0)
        axes[1].plot(times, [point.get("preemptions", 0.0) - base for point in timeline], label=f"c={label}")
    axes[0].set_ylabel("KV blocks in use (%)")
    axes[1].set_ylabel("preemptions (cumulative)")
    axes[1].set_xlabel("seconds into the run")
    axes[0].set_title(f"{preset}: KV cache usage and preemptions over time")
    axes[0].legend()
    save(figure, "kv-timeline")

    phases = list(measured[0]["phases"])
    if len(phases) > 1:
        figure, axis = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(phases)
        for i, phase in enumerate(phases):
            rates = [
                100 * ((r["phases"].get(phase) or {}).get("server", {}).get("prefix_cache_hit_rate") or 0.0)
                for r in measured
            ]
            axis.bar([p + i * width for p in positions], rates, width, label=phase)
        axis.set_xticks([p + width * (len(phases) - 1) / 2 for p in positions], labels)
        axis.set_xlabel("max concurrency")
        axis.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
        axis.set_title(f"{preset}: prefix hits by phase")
        axis.legend()
        save(figure, "prefix-hits")
    return paths


def plot_files(paths: list[str], out_dir: str) -> list[str]:
    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    os.makedirs(out_dir, exist_ok=True)
    return plot(records, out_dir)
