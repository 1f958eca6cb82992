"""Prometheus metrics, with vLLM's names under a ``pagedrs:`` prefix.

Gauges and the scheduler's own counters are read at scrape time from the counters the
engine thread publishes after each step; latencies and token counts are recorded by the
engine thread as outputs leave it (prometheus_client is thread-safe).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedrs.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No `*_created` series: they double the page and vLLM does not send them either.
disable_created_metrics()

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _SchedulerCollector:
    """Reads the engine's last published scheduler counters when scraped."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

    def _family(self, kind, name: str, documentation: str, value: float):
        family = kind(name, documentation, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        stats = self.engine.stats
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        adapters = self.engine.lora_adapters
        if adapters is not None:  # as vLLM's lora_requests_info: one series, valued at its last change
            names = ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"]
            family = GaugeMetricFamily(
                "pagedrs:lora_requests_info",
                "LoRA adapters with requests running and with requests waiting for a slot.",
                labels=names,
            )
            family.add_metric([self.labels["model_name"], *adapters.labels], adapters.since)
            yield family
        yield self._family(gauge, "pagedrs:num_requests_running", "Sequences in the running batch.", stats.num_running)
        yield self._family(
            gauge, "pagedrs:num_requests_waiting", "Sequences waiting (preempted ones included).", stats.num_waiting
        )
        yield self._family(
            gauge,
            "pagedrs:kv_cache_usage_perc",
            "Fraction of KV blocks referenced by a request (cached-free blocks count as free).",
            stats.kv_cache_usage,
        )
        yield self._family(
            gauge, "pagedrs:kv_cache_used_blocks", "KV blocks referenced by a request.", stats.num_used_blocks
        )
        yield self._family(
            gauge,
            "pagedrs:kv_cache_cached_free_blocks",
            "Free KV blocks still holding a reusable cached prefix.",
            stats.num_cached_free_blocks,
        )
        yield self._family(gauge, "pagedrs:kv_cache_num_blocks", "All KV blocks.", stats.num_blocks)
        yield self._family(
            counter,
            "pagedrs:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield self._family(
            counter, "pagedrs:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        yield self._family(
            counter,
            "pagedrs:num_preemptions",
            "Preemptions (a running sequence requeued to recompute) for want of KV blocks.",
            stats.num_preemptions_total,
        )
        yield self._family(
            counter,
            "pagedrs:num_fair_share_requeues",
            "Sequences requeued to keep a request within --max-seqs-per-request while others are live.",
            stats.num_fair_share_requeues_total,
        )
        yield self._family(
            counter, "pagedrs:kv_cache_evictions", "Cached blocks evicted for reuse.", stats.num_evictions
        )
        structured = self.engine.structured_output_stats
        for name, documentation, value in (
            (
                "requests",
                "Requests with an output constraint (schema, regex, choice, grammar, tools).",
                structured.num_requests,
            ),
            ("grammars_compiled", "Constraints compiled (cache misses).", structured.num_compiled),
            ("grammar_cache_hits", "Constraints found compiled already.", structured.cache_hits),
            ("compile_seconds", "Time compiling constraints.", structured.compile_seconds),
            ("mask_seconds", "Time filling token masks (overlaps the forward pass).", structured.mask_seconds),
            ("masked_rows", "Logits rows masked by a constraint.", structured.num_masks),
        ):
            yield self._family(counter, f"pagedrs:structured_output_{name}", documentation, value)
        yield from self._speculative(stats)
        yield from self._parallel()
        yield from self._experts()

    def _experts(self):
        """Mixtures of experts: the (token, slot) pairs routed to each expert of each layer, so
        load imbalance is visible (``rate()`` over a window gives the recent share)."""
        counts = self.engine.expert_tokens()
        if not counts:
            return
        family = CounterMetricFamily(
            "pagedrs:moe_expert_tokens",
            "Tokens routed to each expert of each mixture-of-experts layer (one per token and routed slot).",
            labels=[*self.labels, "layer", "expert"],
        )
        for layer, per_expert in counts.items():
            for expert, value in enumerate(per_expert.tolist()):
                family.add_metric([*self.labels.values(), str(layer), str(expert)], value)
        yield family

    def _speculative(self, stats):
        """Speculative decoding, with vLLM's names (only when it is on)."""
        speculative = self.engine.info.speculative
        if speculative is None:
            return
        counter = CounterMetricFamily
        for name, documentation, value in (
            ("num_drafts", "Speculative steps of a sequence (one that proposed tokens).", stats.num_drafts_total),
            ("num_draft_tokens", "Proposed tokens.", stats.num_draft_tokens_total),
            ("num_accepted_tokens", "Proposed tokens accepted by verification.", stats.num_accepted_tokens_total),
        ):
            yield self._family(counter, f"pagedrs:spec_decode_{name}", documentation, value)
        per_position = CounterMetricFamily(
            "pagedrs:spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposed tokens by their position in the proposal (0 = first).",
            labels=[*self.labels, "position"],
        )
        counts = stats.num_accepted_tokens_per_pos[: speculative.num_speculative_tokens]
        for position, value in enumerate(counts):
            per_position.add_metric([*self.labels.values(), str(position)], value)
        yield per_position

    def _parallel(self):
        """The tensor-parallel layout (an info gauge, as vLLM's ``*_config_info``) and what
        sending each step to the other ranks costs rank 0."""
        info = GaugeMetricFamily(
            "pagedrs:parallel_config_info",
            "Tensor-parallel layout (value 1; the labels say).",
            labels=[*self.labels, "tensor_parallel_size", "backend"],
        )
        engine_info = self.engine.info
        backend = engine_info.distributed_backend or "none"
        info.add_metric([*self.labels.values(), str(engine_info.config.tensor_parallel_size), backend], 1)
        yield info
        sent = self.engine.broadcast_stats()
        if sent is not None:
            counter = CounterMetricFamily
            yield self._family(
                counter, "pagedrs:tp_step_broadcast_seconds", "Rank 0's time sending steps.", sent["seconds"]
            )
            yield self._family(counter, "pagedrs:tp_step_broadcast_bytes", "Bytes of steps sent.", sent["bytes"])


class ServerMetrics:
    """The `StatLogger` of an `AsyncLLMEngine`, and the ``/metrics`` page."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        # process_cpu_seconds_total and friends: what the server process itself costs.
        ProcessCollector(registry=self.registry)
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, labels, registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("pagedrs:prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("pagedrs:generation_tokens", "Generated tokens delivered.")
        self.request_success = Counter(
            "pagedrs:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.api_requests = Counter(
            "pagedrs:api_requests",
            "HTTP requests by route and status (every endpoint: generation, pooling, Anthropic, Responses).",
            ["model_name", "route", "status"],
            registry=self.registry,
        )
        self.time_to_first_token = histogram(
            "pagedrs:time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "pagedrs:inter_token_latency_seconds", "Time between successive tokens of a request.", _LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "pagedrs:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram(
            "pagedrs:iteration_tokens_total", "Tokens computed per engine step (prefill and decode).", _TOKEN_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "pagedrs:request_prompt_tokens", "Prompt length of finished requests.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "pagedrs:request_generation_tokens", "Generated tokens of finished requests (all choices).", _TOKEN_BUCKETS
        )

    def attach(self, engine) -> None:
        """Starts reporting the scheduler counters of `engine` (an `AsyncLLMEngine`)."""
        self.registry.register(_SchedulerCollector(engine, self.model_name))

    # -- StatLogger --------------------------------------------------------------------------

    def record_step(self, engine) -> None:
        out = engine.last_schedule
        if out is not None and len(out):
            self.iteration_tokens.observe(out.num_prefill_tokens + out.num_decode_tokens)

    def record_request_tokens(self, output: RequestOutput, num_new_tokens: int, first: bool, since_last: float) -> None:
        self.generation_tokens.inc(num_new_tokens)
        if first:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.time_to_first_token.observe(since_last)
        else:
            self.inter_token_latency.observe(since_last)

    def record_finished(self, output: RequestOutput, e2e_seconds: float) -> None:
        self.e2e_request_latency.observe(e2e_seconds)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(choice.token_ids) for choice in output.outputs))
        for choice in output.outputs:
            self.request_success.labels(self.model_name, choice.finish_reason or "abort").inc()
        if not output.outputs:  # a pooling request: no choices
            reason = "stop" if output.pooled is not None else "error" if output.error else "abort"
            self.request_success.labels(self.model_name, reason).inc()

    def record_api_request(self, route: str, status: int) -> None:
        """One HTTP request to ``route`` (its template: ``/v1/responses/{response_id}``)."""
        self.api_requests.labels(self.model_name, route, str(status or "disconnected")).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
