"""Shared pieces of the tests: tiny checkpoints, oracles, servers, batches; imported, never collected."""
