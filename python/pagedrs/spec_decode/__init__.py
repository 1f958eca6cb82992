"""Speculative decoding: proposals scheduled by the core (n-gram and suffix proposers live in
Rust; a draft model runs here), verified in one forward pass of the target model.

- `SpeculativeConfig`: ``--speculative-config`` as vLLM spells it.
- `verify`: greedy and rejection-sampling verification that keeps the target distribution.
- `DraftModelProposer`: a small model sharing the target's tokenizer and block tables.
"""

from pagedrs.spec_decode.config import SpeculativeConfig
from pagedrs.spec_decode.drafter import DraftModelProposer
from pagedrs.spec_decode.verify import speculates, verify_and_sample

__all__ = ["DraftModelProposer", "SpeculativeConfig", "speculates", "verify_and_sample"]
