"""Speculative decoding: proposals scheduled by the core (n-gram and suffix proposers live in
Rust; a draft model runs here), verified in one forward pass of the target model.

- `SpeculativeConfig` (`spec_decode.config`): ``--speculative-config`` as vLLM spells it.
- `spec_decode.verify`: greedy and rejection-sampling verification that keeps the target
  distribution.
- `spec_decode.drafter.DraftModelProposer`: a small model sharing the target's tokenizer and
  block tables.

Only the config is imported here, so that `pagedrs.config` can name it without loading the
model side.
"""

from pagedrs.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
