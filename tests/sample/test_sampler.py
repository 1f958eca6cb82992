"""The sampler on synthetic logits: each rule does what it says, draws follow the exact
distribution (chi-square against a float64 reference), seeds reproduce in any batch."""

import math

import pytest
import torch

from pagedrs import SamplingParams
from pagedrs.sample import Sampler, SamplingRow, cpu_ops
from pagedrs.sample import ops as sample_ops
from pagedrs.sample import sampler as sampler_module
from tests.helpers.stats import chi_square_p_value

VOCAB = 12
PATHS = [pytest.param(False, id="torch")] + ([pytest.param(True, id="fused")] if cpu_ops.available() else [])
"""Full-vocabulary draws and logprobs: torch ops (the GPU path) and the fused CPU kernels."""
LOGITS = torch.tensor([2.0, 1.6, 1.5, 1.1, 0.9, 0.3, 0.0, -0.4, -1.0, -1.5, -2.5, -4.0])


def row(params: SamplingParams, seed=None, slot=None) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, generator, slot)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler must draw from, in float64, one rule at a time:
    temperature, top-k, top-p over the top-k survivors, min-p against the most likely token."""
    x = logits.double() / params.temperature
    order = x.argsort(descending=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < params.top_k < len(x):
        keep[order[params.top_k :]] = False
    probs = torch.where(keep, x, -math.inf).softmax(-1)
    before = probs[order].cumsum(0) - probs[order]
    drop = (before >= params.top_p) & (torch.arange(len(x)) > 0)
    keep[order[drop]] = False
    probs = x.softmax(-1)
    keep &= probs >= params.min_p * probs.max()
    return torch.where(keep, x, -math.inf).softmax(-1)


DISTRIBUTION_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, top_p=0.95, top_k=6),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=2.0, top_p=0.85, min_p=0.15),
]


@pytest.mark.parametrize(
    "params", DISTRIBUTION_CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
@pytest.mark.parametrize("path", ["as chosen", "fallbacks"])
@pytest.mark.parametrize("fused", PATHS)
def test_draws_follow_the_exact_distribution(params, path, fused, monkeypatch):
    # "fallbacks": top-k rows are sorted instead of windowed, and top-p rows that a first
    # draw did not settle are sorted instead of drawn again.
    if path == "fallbacks":
        monkeypatch.setattr(sampler_module, "MAX_TOP_K_WINDOW", 1)
        monkeypatch.setattr(sampler_module, "MAX_REJECTION_ROUNDS", 0)
    num_draws = 20_000
    logits = LOGITS.repeat(num_draws, 1)
    tokens = torch.from_numpy(Sampler(VOCAB, seed=11, fused=fused)(logits, [row(params)] * num_draws).token_ids)
    counts = torch.bincount(tokens, minlength=VOCAB)
    assert chi_square_p_value(counts, reference_probs(LOGITS, params)) > 1e-4


@pytest.mark.parametrize("fused", PATHS)
def test_mixed_batch_each_row_follows_its_own_distribution(fused):
    # Interleaved rows of different kinds in one batch (greedy, windowed, full, penalties).
    kinds = [DISTRIBUTION_CASES[0], DISTRIBUTION_CASES[4], DISTRIBUTION_CASES[6], SamplingParams(temperature=0)]
    num_draws = 8_000
    rows = [row(kinds[i % len(kinds)]) for i in range(num_draws * len(kinds))]
    logits = LOGITS.repeat(len(rows), 1)
    tokens = torch.from_numpy(Sampler(VOCAB, seed=5, fused=fused)(logits, rows).token_ids)
    for kind_index, params in enumerate(kinds[:-1]):
        counts = torch.bincount(tokens[kind_index :: len(kinds)], minlength=VOCAB)
        assert chi_square_p_value(counts, reference_probs(LOGITS, params)) > 1e-4
    assert set(tokens[3 :: len(kinds)].tolist()) == {0}


def test_greedy_is_argmax_and_bans_are_respected():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 4.0]])
    greedy = SamplingParams(temperature=0)
    out = Sampler(3)(logits, [row(greedy), row(greedy)], banned=[(1, [0])])
    assert out.token_ids.tolist() == [1, 2]


@pytest.mark.parametrize("fused", PATHS)
def test_bans_hold_for_sampled_rows(fused):
    logits = torch.tensor([[9.0, 0.0, 0.0, 0.0]]).repeat(300, 1)
    rows = [row(SamplingParams(temperature=1.0))] * 150 + [row(SamplingParams(temperature=1.0, top_k=2))] * 150
    out = Sampler(4, seed=0, fused=fused)(logits, rows, banned=[(i, [0]) for i in range(300)])
    assert 0 not in out.token_ids.tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.01),
        SamplingParams(temperature=1.0, min_p=0.99),
    ],
)
def test_top_k_top_p_min_p_can_narrow_to_the_best_token(params):
    logits = torch.tensor([[0.0, 2.0, 1.9, 1.8]]).repeat(50, 1)
    out = Sampler(4, seed=0)(logits, [row(params)] * 50)
    assert set(out.token_ids.tolist()) == {1}


def test_a_large_top_k_sorts_and_stays_exact(monkeypatch):
    monkeypatch.setattr(sampler_module, "MAX_TOP_K_WINDOW", 2)
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)
    out = Sampler(VOCAB, seed=3)(LOGITS.repeat(20_000, 1), [row(params)] * 20_000)
    counts = torch.bincount(torch.from_numpy(out.token_ids), minlength=VOCAB)
    assert chi_square_p_value(counts, reference_probs(LOGITS, params)) > 1e-4


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.7, top_k=20, seed=7),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7),
        SamplingParams(temperature=1.0, top_p=0.999, seed=7),
    ],
)
@pytest.mark.parametrize("batch_size", [16, 256])
@pytest.mark.parametrize("fused", PATHS)
def test_seeded_rows_reproduce_whatever_the_batch(params, batch_size, fused):
    torch.manual_seed(0)
    logits = torch.randn(3, 1000) * 2

    def draws(batch_logits, rows, position):
        sampler = Sampler(1000, seed=batch_size, fused=fused)
        return [int(sampler(batch_logits[i], rows).token_ids[position]) for i in range(3)]

    alone = draws(logits.unsqueeze(1), [row(params, seed=7)], 0)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
        SamplingParams(temperature=0),
        SamplingParams(top_k=900, seed=3),
    ]
    rows = [row(others[i % len(others)], seed=i) for i in range(batch_size - 1)]
    position = batch_size // 2
    rows.insert(position, row(params, seed=7))
    batch = torch.randn(3, batch_size, 1000) * 2
    batch[:, position] = logits
    assert draws(batch, rows, position) == alone


def test_penalties_match_a_per_row_reference():
    torch.manual_seed(1)
    vocab = 50
    sampler = Sampler(vocab)
    cases = [
        (SamplingParams(temperature=0, repetition_penalty=1.7), [3, 4, 5]),
        (SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25), [7]),
        (SamplingParams(temperature=0, presence_penalty=-0.3, frequency_penalty=1.0, repetition_penalty=0.8), [1, 2]),
        (SamplingParams(temperature=0), [9]),
    ]
    rows = [
        row(params, slot=sampler.penalties.acquire(prompt, params) if params.uses_penalties else None)
        for params, prompt in cases
    ]
    outputs: list[list[int]] = [[] for _ in cases]
    for _ in range(12):
        logits = torch.randn(len(cases), vocab) * 3
        expected = logits.clone()
        for i, (params, prompt) in enumerate(cases):
            counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.long), minlength=vocab).float()
            if params.repetition_penalty != 1:
                for token in set(prompt + outputs[i]):
                    value = expected[i, token]
                    expected[i, token] = (
                        value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
                    )
            expected[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
        tokens = sampler(logits, rows).token_ids.tolist()
        assert tokens == expected.argmax(-1).tolist()
        for i, token in enumerate(tokens):
            outputs[i].append(token)
    # Slots are reused once released, and start clean.
    for sampling_row in rows:
        if sampling_row.penalty_slot is not None:
            sampler.penalties.release(sampling_row.penalty_slot)
    assert sampler.penalties.num_slots_in_use == 0
    slot = sampler.penalties.acquire([0], SamplingParams(presence_penalty=1.0))
    assert sampler.penalties.bias[slot].sum() == 0 and sampler.penalties.seen[slot].sum() == 1


@pytest.mark.parametrize("fused", PATHS)
def test_logprobs_ranks_and_top_logprobs_match_log_softmax(fused):
    torch.manual_seed(2)
    logits = torch.randn(6, 40) * 2
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=0.7, top_k=5, logprobs=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, repetition_penalty=1.5, logprobs=1),
    ]
    sampler = Sampler(40, seed=0, fused=fused)
    rows = [row(p, slot=sampler.penalties.acquire([0, 1], p) if p.uses_penalties else None) for p in params]
    out = sampler(logits, rows)
    expected = logits.log_softmax(-1)  # the raw distribution, before penalties and temperature
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        token = int(out.token_ids[i])
        assert out.logprobs[i] == pytest.approx(expected[i, token].item(), abs=1e-5)
        assert out.ranks[i] == int((expected[i] > expected[i, token]).sum()) + 1
        top_values, top_ids = expected[i].topk(p.logprobs)
        assert out.top_token_ids[i, : p.logprobs].tolist() == top_ids.tolist()
        assert out.top_logprobs[i, : p.logprobs] == pytest.approx(top_values.tolist(), abs=1e-5)
    assert out.top_token_ids.shape == (6, 5)
    assert out.token_ids[0] == logits[0].argmax()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2},
        {"max_tokens": 0},
        {"max_tokens": -5},
        {"min_tokens": 5, "max_tokens": 2},
        {"presence_penalty": 3},
        {"repetition_penalty": 0},
        {"logprobs": -1},
        {"prompt_logprobs": 21},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
    ],
)
def test_invalid_sampling_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.2, min_p=0.05),
    ],
)
@pytest.mark.parametrize("fused", PATHS)
def test_draws_over_a_vocabulary_of_many_blocks_stay_exact(params, fused):
    # 2,600 tokens: two full 1,024-token blocks of the two-level inverse CDF and a partial one.
    torch.manual_seed(4)
    vocab = 2_600
    logits = torch.randn(vocab) * 1.5
    sampler = Sampler(vocab, seed=9, fused=fused)
    tokens = torch.cat(
        [torch.from_numpy(sampler(logits.repeat(4_000, 1), [row(params)] * 4_000).token_ids) for _ in range(10)]
    )
    expected = reference_probs(logits, params)
    bins = torch.arange(vocab) // 100  # 26 bins, so every bin expects plenty of draws
    counts = torch.zeros(26).index_add_(0, bins[tokens], torch.ones(len(tokens)))
    assert counts[expected.reshape(26, 100).sum(-1) == 0].sum() == 0
    assert bool((expected[tokens] > 0).all()), "a filtered-out token was sampled"
    assert chi_square_p_value(counts, torch.zeros(26, dtype=torch.float64).index_add_(0, bins, expected)) > 1e-4


@pytest.mark.parametrize("vocab,k", [(49_152, 50), (49_152, 1), (1_000, 3), (1_030, 4), (5_000, 200)])
def test_chunked_top_k_equals_topk(vocab, k):
    torch.manual_seed(vocab + k)
    logits = torch.randn(9, vocab) * 3
    logits[0, :] = 1.0  # every value tied: any k of them will do
    values, ids = sample_ops.chunked_top_k(logits, k)
    expected_values, expected_ids = logits.topk(k, dim=-1)
    assert torch.equal(values, expected_values)
    assert torch.equal(logits.gather(1, ids), values)
    assert torch.equal(ids[1:], expected_ids[1:])  # no ties in the random rows


@pytest.mark.parametrize("vocab", [49_152, 1_024, 1_000, 320])
def test_chunked_argmax_is_the_first_largest_index(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(7, vocab)
    logits[1] = 0.5  # all tied: index 0
    logits[2, [vocab // 3, vocab // 2, vocab - 1]] = 9.0  # three tied maxima: the first
    logits[3, -1] = float("inf")
    logits[4] = float("-inf")
    assert sample_ops.chunked_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
