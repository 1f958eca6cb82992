"""One scheduler iteration through the Python binding, as the engine will run it.

Each timed round is one decode step with N running requests of 512-token prompts (prefix
caching on, no shared prefix): ``schedule()``, every output array turned into a torch tensor
(``torch.from_numpy``, no copy), and ``update_from_output()`` with the sampled tokens as a
torch tensor's numpy view (it returns the step's updates as numpy columns, ``StepUpdates``).
Requests are prefilled before timing and replaced (untimed) every 128 steps, so contexts stay
within 512..640 tokens, as in the criterion bench.

    make bench-python
"""

import numpy as np
import pytest

import pagedrs
from pagedrs.config import EngineConfig

torch = pytest.importorskip("torch", reason="the benchmark converts outputs to torch tensors")

PROMPT_LEN = 512
STEPS_PER_BATCH = 128
ARRAYS = [
    "input_token_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "context_lens",
    "block_tables",
    "logits_indices",
    "logits_request_indices",
    "logits_choice_indices",
    "num_scheduled_tokens",
    "block_copies",
]


class DecodeLoop:
    def __init__(self, num_running: int):
        self.num_running = num_running
        blocks_per_request = (PROMPT_LEN + STEPS_PER_BATCH) // 16 + 2
        config = EngineConfig(block_size=16, max_num_batched_tokens=65536, max_num_seqs=num_running)
        self.scheduler = pagedrs.Scheduler(config, num_blocks=num_running * blocks_per_request * 2, max_model_len=4096)
        self.batch = 0
        self.steps = STEPS_PER_BATCH
        self.request_ids: list[str] = []
        self.sampled = torch.ones(num_running, dtype=torch.int64)

    def refill_if_due(self):
        if self.steps < STEPS_PER_BATCH:
            return
        for request_id in self.request_ids:
            self.scheduler.abort_request(request_id)
        self.batch += 1
        self.request_ids = [f"b{self.batch}-{i}" for i in range(self.num_running)]
        for i, request_id in enumerate(self.request_ids):
            first = (self.batch * self.num_running + i) * 7919
            self.scheduler.add_request(
                request_id, list(range(first, first + PROMPT_LEN)), max_tokens=100_000, ignore_eos=True
            )
        while True:
            out = self.scheduler.schedule()
            self.scheduler.update_from_output(np.ones(len(out.logits_indices), dtype=np.int64))
            if out.num_prefill_tokens == 0:
                break
        self.steps = 0

    def step(self):
        out = self.scheduler.schedule()
        tensors = {name: torch.from_numpy(getattr(out, name)) for name in ARRAYS}
        updates = self.scheduler.update_from_output(self.sampled.numpy())
        self.steps += 1
        return out, tensors, updates


@pytest.mark.parametrize("num_running", [64, 256, 1024])
def test_decode_step_through_python(benchmark, num_running):
    loop = DecodeLoop(num_running)
    out, tensors, updates = benchmark.pedantic(
        loop.step, setup=loop.refill_if_due, rounds=600, iterations=1, warmup_rounds=5
    )
    assert out.num_decode_tokens == num_running
    assert len(updates) == num_running
    assert tensors["block_tables"].shape[:2] == (1, num_running)  # one KV layer group
