"""Sampling a step's tokens from its logits (vLLM's ``v1/sample``): the batched `Sampler`
(`pagedrs.sample.sampler`), penalties as device state (`pagedrs.sample.penalties`), and the
compiled CPU sampling ops (`pagedrs.sample.cpu_ops`)."""

from pagedrs.sample.sampler import InverseCdf, Sampler, SamplerOutput, SamplingRow, filtered_distribution

__all__ = ["InverseCdf", "Sampler", "SamplerOutput", "SamplingRow", "filtered_distribution"]
