"""The benchmark tools: statistics on synthetic timings, workloads, the JSON record of a short
real run against a launched server, and `pagedrs memory`'s prediction against that server."""

from __future__ import annotations

import json
import math
import random

import pytest

from pagedrs.bench.client import parse_metrics
from pagedrs.bench.stats import SLO, RequestResult, distribution, summarize
from pagedrs.bench.workloads import Lengths, generate, load_jsonl
from pagedrs.cli import build_parser


def _result(start, first, end, tokens, chunks=None, success=True):
    result = RequestResult(
        prompt_tokens=10,
        output_tokens=tokens,
        start=start,
        first_token=first,
        end=end,
        success=success,
        expected_output_tokens=tokens,
    )
    result.chunk_times = (
        chunks if chunks is not None else [first + i * (end - first) / max(tokens - 1, 1) for i in range(tokens)]
    )
    return result


def test_distribution_percentiles():
    d = distribution(list(range(1, 101)), scale=1000)
    assert d["count"] == 100 and d["mean"] == pytest.approx(50_500)
    assert (
        d["median"] == pytest.approx(50_500) and d["p90"] == pytest.approx(90_100) and d["p99"] == pytest.approx(99_010)
    )
    assert distribution([])["median"] is None


def test_request_timings_and_summary():
    a = _result(0.0, 0.5, 2.5, 5, chunks=[0.5, 1.0, 1.5, 2.0, 2.5])  # TTFT 0.5, TPOT 0.5
    b = _result(1.0, 1.1, 1.9, 9)  # TTFT 0.1, TPOT 0.1
    failed = RequestResult(prompt_tokens=10, start=2.0, end=2.1, error="HTTP 500")
    assert a.ttft == 0.5 and a.tpot == pytest.approx(0.5) and a.itls() == pytest.approx([0.5] * 4)
    s = summarize([a, b, failed], duration=4.0, slo=SLO(ttft_ms=200))
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 500"]
    assert s["output_tokens"] == 14 and s["output_throughput"] == pytest.approx(3.5)
    assert s["request_throughput"] == pytest.approx(0.5) and s["total_token_throughput"] == pytest.approx(8.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(300) and s["ttft_ms"]["max"] == pytest.approx(500)
    assert s["tpot_ms"]["median"] == pytest.approx(300)
    assert s["itl_ms"]["count"] == 4 + 8
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.25)  # only b meets 200 ms TTFT
    assert s["output_length_mismatches"] == 0


def test_slo_limits():
    one_token = _result(0, 0.1, 0.1, 1)
    assert one_token.tpot is None and SLO(tpot_ms=1).met_by(one_token)
    slow = _result(0, 0.1, 10.1, 11)  # TPOT 1 s
    assert not SLO(tpot_ms=500).met_by(slow) and SLO(tpot_ms=1500, e2e_ms=11_000).met_by(slow)
    assert not SLO(ttft_ms=10).met_by(RequestResult(prompt_tokens=1))


def test_workloads():
    assert (Lengths.parse("8").draw(random.Random(0)), str(Lengths.parse("8:256"))) == (8, "8:256")
    with pytest.raises(ValueError):
        Lengths.parse("9:3")
    specs = generate(
        10,
        Lengths.parse("5:9"),
        Lengths.parse("3"),
        seed=1,
        token_range=(100, 200),
        shared_prefix_len=32,
        phases=("cold", "warm"),
    )
    assert [s.phase for s in specs] == ["cold"] * 10 + ["warm"] * 10
    prefix = specs[0].prompt[:32]
    assert all(s.prompt[:32] == prefix and 37 <= len(s.prompt) <= 41 and s.output_len == 3 for s in specs)
    assert all(100 <= t < 200 for s in specs for t in s.prompt)
    again = generate(
        10,
        Lengths.parse("5:9"),
        Lengths.parse("3"),
        seed=1,
        token_range=(100, 200),
        shared_prefix_len=32,
        phases=("cold", "warm"),
    )
    assert [s.prompt for s in again] == [s.prompt for s in specs]  # a seed is a workload
    other = generate(1, Lengths.parse("5"), Lengths.parse("3"), seed=2, token_range=(100, 200), shared_prefix_len=32)
    assert other[0].prompt[:32] != prefix  # a new seed, a new (cold) prefix


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello", "output_len": 7}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    specs = load_jsonl(str(path), Lengths.parse("4"), seed=0)
    assert (specs[0].prompt, specs[0].output_len) == ("hello", 7)
    assert specs[1].messages[0]["content"] == "hi" and specs[1].output_len == 4
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="exactly one"):
        load_jsonl(str(path), Lengths.parse("4"), seed=0)


def test_parse_metrics_reads_pagedrs_and_vllm_names():
    page = (
        "# HELP pagedrs:num_requests_running x\n"
        'pagedrs:num_requests_running{model_name="m"} 3.0\n'
        'pagedrs:prefix_cache_hits_total{model_name="m"} 16.0\n'
        'vllm:num_preemptions_total{model_name="m",engine="0"} 2.0\n'
        'vllm:num_preemptions_total{model_name="m",engine="1"} 1.0\n'
        "process_cpu_seconds_total 4.0\n"
        "process_open_fds 9.0\n"
    )
    assert parse_metrics(page) == {"running": 3.0, "prefix_hits": 16.0, "preemptions": 3.0, "server_cpu_seconds": 4.0}


@pytest.mark.slow  # launches a server process
def test_a_short_real_run_writes_a_complete_record(tiny_llama, tmp_path, capsys):
    from pagedrs.bench.serve import run

    output = tmp_path / "record.json"
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--preset",
            "shared-prefix",
            "--launch",
            "--server-model",
            tiny_llama,
            "--server-args",
            "--device cpu --kv-cache-memory 4MiB",
            "--num-requests",
            "6",
            "--input-len",
            "4:8",
            "--output-len",
            "5",
            "--shared-prefix-len",
            "48",
            "--token-range",
            "4:300",
            "--max-concurrency",
            "3",
            "--slo-ttft-ms",
            "60000",
            "--output",
            str(output),
            "--no-progress",
            "--label",
            "test",
        ]
    )
    run(args)
    record = json.loads(output.read_text())
    printed = capsys.readouterr().out
    assert "sanity request" in printed and "[cold]" in printed and "[warm]" in printed
    assert record["schema"] == "pagedrs-bench-serve/1" and record["label"] == "test"
    assert record["settings"]["shared_prefix_len"] == 48 and record["settings"]["ignore_eos"] is True
    assert record["settings"]["server_args"] == ["--device", "cpu", "--kv-cache-memory", "4MiB"]
    env = record["client_environment"]
    assert env["pagedrs_version"] and env["torch"] and env["cpu"]
    info = record["server_info"]
    assert info["engine"] == "pagedrs" and info["dtype"] == "float32" and info["block_size"] == 16
    assert info["model_fingerprint"].startswith("sha256:") and info["tensor_parallel_size"] == 1
    assert record["sanity"]["output"] is not None and record["sanity"]["prompt_tokens"] > 0
    cold_start = record["cold_start"]
    assert 0 < cold_start["process_start_to_ready_s"] < cold_start["process_start_to_first_token_s"]
    for phase in ("cold", "warm"):
        summary = record["phases"][phase]["summary"]
        assert summary["completed"] == 6 and summary["failed"] == 0
        assert summary["output_tokens"] == 30 and summary["output_length_mismatches"] == 0
        assert summary["ttft_ms"]["count"] == 6 and summary["good_requests"] == 6
    cold, warm = (record["phases"][p]["server"] for p in ("cold", "warm"))
    # The warm phase finds the 48-token prefix (3 blocks) cached for every request.
    assert warm["prefix_cache_hits"] == 6 * 48 and warm["prefix_cache_hit_rate"] > cold["prefix_cache_hit_rate"]
    assert len(record["requests"]) == 12 and record["timeline"]
    assert record["headline"]["failed"] == 0
    assert cold["server_cpu_seconds"] > 0 and cold["client_cpu_seconds"] > 0


@pytest.mark.slow  # a server process
def test_memory_prediction_and_check(tiny_llama, tmp_path):
    from pagedrs.memory_cli import check, predict
    from tests.helpers.servers import start_server

    args = build_parser().parse_args(
        ["memory", "--model", tiny_llama, "--device", "cpu", "--budget", "1MiB", "--lengths", "100,37,250"]
    )
    p = predict(args)
    # 2 layers x 2 KV heads x head dim 16 x K and V x 4 bytes.
    assert p["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4 == 512 and p["bytes_per_block"] == 512 * 16
    assert p["num_blocks"] == 2**20 // (512 * 16) == 128 and p["blocks_per_sequence"] == [7, 3, 16]
    assert p["slack_slots"] == (112 - 100) + (48 - 37) + (256 - 250) and p["load_fits"]
    assert p["max_concurrent_if_all_this_length"][250] == 128 // 16
    server = start_server([tiny_llama, "--device", "cpu", "--kv-cache-memory", "1MiB"], str(tmp_path / "log"))
    try:
        # NOTE: up to 200 generated tokens (out of each sequence's length, so the prediction
        # holds: `check` keeps at least one prompt token) keep the requests running long enough
        # for the 10 ms /metrics samples to see them: with 8, and once with 32 (a clean run of
        # 2026-12-07), a fast step finished everything between two samples.
        c = check(p, server.base_url, output_tokens=200)
    finally:
        server.stop()
    assert c["num_blocks_match"] and c["server_block_size"] == 16 and c["requests_ok"] == 3
    assert c["predicted_peak_used_blocks"] == math.ceil(99 / 16) + math.ceil(36 / 16) + math.ceil(249 / 16)
    assert 0 < c["observed_peak_used_blocks"] <= c["predicted_peak_used_blocks"]
    assert c["preemptions"] == 0


def test_memory_prediction_counts_sliding_groups_and_the_live_server_agrees(tmp_path):
    """A Gemma-3-shaped model (two sliding layers of window 8 per global one): blocks per
    sequence count the window, and the live server's decode-phase block count stays within
    the prediction (and is what the sliding groups hold: far below full attention's)."""
    from pagedrs.cli import build_parser
    from pagedrs.memory_cli import check, predict
    from tests.helpers.families import save_family
    from tests.helpers.servers import start_server

    directory = str(tmp_path / "gemma3")
    save_family("gemma3", directory)  # layers: sliding, sliding, full; window 8
    args = build_parser().parse_args(
        ["memory", "--model", directory, "--device", "cpu", "--dtype", "float32", "--budget", "1MiB"]
        + ["--lengths", "100,37", "--block-size", "4"]
    )
    p = predict(args)
    assert p["kv_group_windows"] == [None, 8, 8] and p["layers_per_block"] == 1
    # Full group: every block; each sliding group: from the block of position L - 8 on.
    assert p["blocks_per_sequence"] == [25 + 2 * (25 - 92 // 4), 10 + 2 * (10 - 29 // 4)]
    assert p["kv_bytes_per_sequence"][0] < 0.5 * p["full_attention_kv_bytes_per_sequence"][0]
    server = start_server(
        [directory, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "1MiB", "--block-size", "4"],
        str(tmp_path / "log"),
    )
    try:
        c = check(p, server.base_url, output_tokens=32)
    finally:
        server.stop()
    assert c["num_blocks_match"] and c["requests_ok"] == 2 and c["preemptions"] == 0
    assert 0 < c["observed_peak_used_blocks"] <= c["predicted_peak_used_blocks"]
    assert c["observed_decode_used_blocks"] is not None
    assert 0 < c["observed_decode_used_blocks"] <= c["predicted_decode_used_blocks"]
