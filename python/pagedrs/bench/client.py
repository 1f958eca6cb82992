"""Sending a workload to an OpenAI-compatible endpoint and timing every request, plus the
server's Prometheus metrics (pagedrs's ``pagedrs:`` names, or vLLM's ``vllm:`` ones)."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from pagedrs.bench.stats import RequestResult
from pagedrs.bench.workloads import RequestSpec

# What the benchmark reads from /metrics, by pagedrs name (vLLM's are the same after "vllm:").
METRICS = {
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "kv_usage": "kv_cache_usage_perc",
    "kv_used_blocks": "kv_cache_used_blocks",
    "kv_cached_free_blocks": "kv_cache_cached_free_blocks",
    "kv_blocks": "kv_cache_num_blocks",
    "prefix_queries": "prefix_cache_queries_total",
    "prefix_hits": "prefix_cache_hits_total",
    "preemptions": "num_preemptions_total",
    "prompt_tokens": "prompt_tokens_total",
    "generation_tokens": "generation_tokens_total",
}
# Unprefixed names read as they are.
PLAIN_METRICS = {"process_cpu_seconds_total": "server_cpu_seconds"}


def parse_metrics(text: str) -> dict[str, float]:
    """The `METRICS` found in a Prometheus page, each summed over its labels."""
    wanted = {f"{prefix}:{name}": key for key, name in METRICS.items() for prefix in ("pagedrs", "vllm")}
    wanted.update(PLAIN_METRICS)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        key = wanted.get(name_labels.split("{", 1)[0])
        if key is not None:
            values[key] = values.get(key, 0.0) + float(value)
    return values


class Endpoint:
    """An OpenAI-compatible server at ``base_url`` (no ``/v1``)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, timeout: float = 3600):
        import openai

        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.client = openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key or "none", max_retries=0, timeout=timeout
        )
        self.model = model

    def get(self, path: str, timeout: float = 10) -> tuple[int, str]:
        request = urllib.request.Request(f"{self.base_url}{path}")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def post(self, path: str, body: dict[str, Any], timeout: float = 30) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"{self.base_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        return parse_metrics(text) if status == 200 else {}

    def server_info(self) -> dict[str, Any] | None:
        status, text = self.get("/server_info")
        return json.loads(text) if status == 200 else None

    async def resolve_model(self) -> str:
        if self.model is None:
            models = await self.client.models.list()
            self.model = models.data[0].id
        return self.model

    async def send(
        self,
        spec: RequestSpec,
        t0: float,
        *,
        ignore_eos: bool,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> RequestResult:
        """Streams one request; times its first token and every text chunk after ``t0``."""
        result = RequestResult(
            prompt_tokens=spec.prompt_len or 0, expected_output_tokens=spec.output_len if ignore_eos else None
        )
        extra = {"ignore_eos": True} if ignore_eos else {}
        common: dict[str, Any] = dict(
            model=self.model,
            max_tokens=spec.output_len,
            temperature=temperature,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        if top_p != 1.0:
            common["top_p"] = top_p
        if seed is not None:
            common["seed"] = seed
        result.start = time.perf_counter() - t0
        chunks = 0
        try:
            # Chat or completion chunks: the loop tells them apart by the same test.
            stream: AsyncIterator[Any]
            if spec.messages is not None:
                stream = await self.client.chat.completions.create(messages=spec.messages, stream=True, **common)
            else:
                stream = await self.client.completions.create(prompt=spec.prompt, stream=True, **common)
            async for chunk in stream:
                now = time.perf_counter() - t0
                if chunk.usage is not None:
                    result.output_tokens = chunk.usage.completion_tokens
                    result.prompt_tokens = chunk.usage.prompt_tokens
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                text = choice.delta.content if spec.messages is not None else choice.text
                if text:
                    chunks += 1
                    result.text += text
                    result.chunk_times.append(now)
                    if result.first_token is None:
                        result.first_token = now
            result.end = time.perf_counter() - t0
            if result.output_tokens == 0:
                result.output_tokens = chunks  # a server that sends no usage: one token a chunk
            result.success = result.first_token is not None
            if not result.success:
                result.error = "no text came back"
        except Exception as error:  # noqa: BLE001 - a failed request is a result, not a crash
            result.end = time.perf_counter() - t0
            result.error = f"{type(error).__name__}: {error}"[:300]
        return result


class MetricsSampler:
    """Polls ``/metrics`` in the background: the run's timeline of KV usage, queue lengths
    and preemptions."""

    def __init__(self, endpoint: Endpoint, interval: float = 0.5):
        self.endpoint = endpoint
        self.interval = interval
        self.timeline: list[dict[str, float]] = []
        self._task: asyncio.Task | None = None

    async def _poll(self, t0: float) -> None:
        while True:
            values = await asyncio.to_thread(self.endpoint.metrics)
            if values:
                self.timeline.append({"t": round(time.perf_counter() - t0, 3), **values})
            await asyncio.sleep(self.interval)

    def start(self, t0: float) -> None:
        self._task = asyncio.create_task(self._poll(t0))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


async def run_requests(
    endpoint: Endpoint,
    specs: list[RequestSpec],
    *,
    t0: float,
    request_rate: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    temperature: float,
    seed: int,
    top_p: float = 1.0,
    progress=None,
) -> list[RequestResult]:
    """Sends ``specs`` open-loop: arrivals at ``request_rate`` per second (Poisson; ``inf``
    sends all at once), at most ``max_concurrency`` in flight."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(spec: RequestSpec, delay: float) -> RequestResult:
        await asyncio.sleep(delay)
        if limit is None:
            result = await endpoint.send(spec, t0, ignore_eos=ignore_eos, temperature=temperature, top_p=top_p)
        else:
            async with limit:
                result = await endpoint.send(spec, t0, ignore_eos=ignore_eos, temperature=temperature, top_p=top_p)
        if progress is not None:
            progress.update(1)
        return result

    delays, at = [], 0.0
    for _ in specs:
        delays.append(at)
        if request_rate != float("inf"):
            at += rng.expovariate(request_rate)
    return list(await asyncio.gather(*(one(spec, delay) for spec, delay in zip(specs, delays))))
