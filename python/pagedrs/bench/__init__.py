"""Benchmarks that say what they measured: `pagedrs bench serve` (a load generator for any
OpenAI-compatible server), `pagedrs bench sweep` (a preset over concurrency levels, with
plots), and the static-batching baseline."""
