"""The compiled CPU sampling ops (``cpu/sampling.cpp``) against torch: logprobs, ranks and top
logprobs against ``log_softmax``/``topk``; each draw against a float64 walk of the same rule for
uniforms placed inside a chosen token's interval; draws over many rows against the exact
distribution (chi-square); rejected rows; arguments a caller gets wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedrs.sample import cpu_ops as cpu_sampling
from pagedrs.sample.cpu_ops import available, logprob_stats, sample_from_rows
from tests.helpers.stats import chi_square_p_value

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels do not build here")

LOGITS_12 = torch.tensor([2.0, 1.6, 1.5, 1.1, 0.9, 0.3, 0.0, -0.4, -1.0, -1.5, -2.5, -4.0])


def random_logits(num_rows: int, vocab_size: int, seed: int, banned_fraction: float = 0.05) -> torch.Tensor:
    """Logits with a realistic spread, some banned (-inf), each row's largest finite."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 3
    banned = torch.rand(num_rows, vocab_size, generator=generator) < banned_fraction
    banned[:, logits.argmax(dim=-1)] = False
    return logits.masked_fill(banned, -math.inf)


# ---------------------------------------------------------------------------------------------
# logprob_stats

LOGPROB_CASES = [(r, v, k) for r in (1, 7, 256) for v in (12, 1000, 49152) for k in (0, 1, 5, 20) if k <= v]


@pytest.mark.parametrize("num_rows,vocab_size,num_top", LOGPROB_CASES)
def test_logprob_stats_match_log_softmax_rank_and_topk(num_rows, vocab_size, num_top):
    logits = random_logits(num_rows, vocab_size, seed=num_rows * 7 + vocab_size + num_top)
    generator = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, vocab_size, (num_rows,), generator=generator)
    token_ids[0] = logits[0].argmax()  # the most likely token: rank 1

    logprobs, ranks, top_ids, top_logprobs = logprob_stats(logits, token_ids, num_top)

    expected_all = logits.log_softmax(dim=-1)
    sampled = logits.gather(1, token_ids.unsqueeze(1))
    expected_logprobs = expected_all.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=2e-5, rtol=1e-5)
    assert torch.equal(ranks, (logits > sampled).sum(dim=-1) + 1)
    assert ranks[0] == 1
    assert top_ids.shape == top_logprobs.shape == (num_rows, num_top)
    if num_top:
        expected_values, expected_ids = expected_all.topk(num_top, dim=-1)
        torch.testing.assert_close(top_logprobs, expected_values, atol=2e-5, rtol=1e-5)
        # Ids where the value is unique in its row (ties have no order in torch.topk).
        row_values = logits.gather(1, expected_ids)
        unique = (row_values.unsqueeze(2) == logits.unsqueeze(1)).sum(dim=-1) == 1
        assert torch.equal(top_ids[unique], expected_ids[unique])
        assert torch.equal(logits.gather(1, top_ids), row_values)  # tied ids still hold the value


def test_top_logprobs_break_ties_by_lower_token_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -math.inf, -math.inf, 2.0]])
    _, ranks, top_ids, top_logprobs = logprob_stats(logits, torch.tensor([7]), 7)
    assert top_ids.tolist() == [[1, 2, 4, 3, 7, 0, 5]]
    assert top_logprobs[0, -1] == -math.inf
    assert ranks.tolist() == [4]  # three tokens strictly above the sampled 2.0


def test_logprobs_of_a_long_vocabulary_agree_where_chunks_are_ragged():
    # A vocabulary that is not a multiple of the kernel's chunks and lanes, a top token in the
    # last partial chunk.
    logits = random_logits(3, 64 * 5 + 13, seed=3, banned_fraction=0.0)
    logits[:, -1] = 20.0
    _, _, top_ids, _ = logprob_stats(logits, torch.zeros(3, dtype=torch.long), 5)
    assert top_ids[:, 0].tolist() == [64 * 5 + 12] * 3
    assert torch.equal(top_ids, logits.topk(5, dim=-1).indices)


# ---------------------------------------------------------------------------------------------
# sample_from_rows: each draw, against a float64 walk


def gap_midpoint(sorted_values: torch.Tensor, start: int, min_ratio: float) -> float:
    """A value between two neighbours of descending ``sorted_values`` (from ``start`` on) whose
    ratio exceeds ``min_ratio``: no value lies near it, so float32 and float64 agree which
    side each value is on."""
    for i in range(start, len(sorted_values) - 1):
        high, low = float(sorted_values[i]), float(sorted_values[i + 1])
        if low > 0 and high / low > min_ratio:
            return math.sqrt(high * low)
    raise AssertionError("no gap found: pick other logits")


def reference_row(logits: torch.Tensor, temperature: float, min_p: float, top_p: float):
    """float64: candidate weights, their cumulative sum, and which tokens are in the nucleus."""
    x = logits.double()
    weights = ((x - x.max()) / temperature).exp()
    candidates = torch.where(weights >= min_p, weights, 0.0)
    order = weights.argsort(descending=True)
    before = torch.zeros_like(weights)
    before[order] = weights[order].cumsum(0) - weights[order]
    in_nucleus = (before < top_p * weights.sum()) if top_p < 1 else torch.ones_like(weights, dtype=torch.bool)
    return candidates, candidates.cumsum(0), in_nucleus


def uniform_inside(token: int, candidates: torch.Tensor, cumulative: torch.Tensor) -> float:
    """The u whose target falls at the middle of ``token``'s interval of the CDF."""
    below = float(cumulative[token - 1]) if token > 0 else 0.0
    return (below + 0.5 * float(candidates[token])) / float(cumulative[-1])


@pytest.mark.parametrize("vocab_size", [12, 1000, 49152])
def test_each_draw_is_the_token_whose_cdf_interval_holds_the_uniform(vocab_size):
    num_rows = 48
    logits = random_logits(num_rows, vocab_size, seed=vocab_size) if vocab_size > 12 else LOGITS_12.repeat(num_rows, 1)
    generator = torch.Generator().manual_seed(2)
    temperature, min_p, top_p, uniforms, expected = [], [], [], [], []
    for r in range(num_rows):
        t = (1.0, 0.7, 1.6)[r % 3]
        sorted_weights = ((logits[r].double() - logits[r].max()) / t).exp().sort(descending=True).values
        m = gap_midpoint(sorted_weights, 2, 1.001) if r % 4 in (1, 3) else 0.0
        p = 1.0
        if r % 4 in (2, 3):
            # A top-p halfway through a token's share of the sorted mass: the nucleus ends there.
            probs = sorted_weights / sorted_weights.sum()
            before = probs.cumsum(0) - probs
            i = next(i for i in range(2, len(probs)) if probs[i] > 2e-3)
            p = float(before[i] + probs[i] / 2)
        candidates, cumulative, in_nucleus = reference_row(logits[r], t, m, p)
        # Tokens holding at least 1e-3 of the candidates' mass: a float32 walk cannot miss them.
        wide = (candidates / cumulative[-1] >= 1e-3).nonzero().squeeze(1)
        inside = [int(i) for i in wide if in_nucleus[i]]
        outside = [int(i) for i in wide if not in_nucleus[i]]
        chosen = inside[int(torch.randint(len(inside), (1,), generator=generator))]
        row_uniforms = [uniform_inside(chosen, candidates, cumulative)]
        if outside:  # a first draw the nucleus rejects, then the chosen token
            row_uniforms.insert(0, uniform_inside(outside[0], candidates, cumulative))
        temperature.append(t)
        min_p.append(m)
        top_p.append(p)
        uniforms.append(row_uniforms + [0.0] * (2 - len(row_uniforms)))
        expected.append(chosen)

    token_ids = sample_from_rows(
        logits, torch.tensor(temperature), torch.tensor(min_p), torch.tensor(top_p), torch.tensor(uniforms)
    )
    assert token_ids.tolist() == expected


def test_a_banned_first_token_is_not_drawn_at_u_zero():
    logits = torch.tensor([[-math.inf, -math.inf, 0.5, 1.0, -math.inf]])
    ones = torch.ones(1)
    token_ids = sample_from_rows(logits, ones, torch.zeros(1), ones, torch.zeros(1, 1))
    assert token_ids.tolist() == [2]


def test_a_tiny_temperature_draws_the_most_likely_token():
    logits = random_logits(8, 1000, seed=4)
    generator = torch.Generator().manual_seed(0)
    token_ids = sample_from_rows(
        logits, torch.full((8,), 1e-4), torch.zeros(8), torch.ones(8), torch.rand(8, 1, generator=generator)
    )
    assert torch.equal(token_ids, logits.argmax(dim=-1))


# ---------------------------------------------------------------------------------------------
# sample_from_rows: the distribution of many draws


def reference_probs(logits: torch.Tensor, temperature: float, min_p: float, top_p: float) -> torch.Tensor:
    """As tests/sample/test_sampler.py's (without top-k), in float64: temperature, top-p, then min-p
    against the most likely token."""
    x = logits.double() / temperature
    order = x.argsort(descending=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    probs = x.softmax(-1)
    before = probs[order].cumsum(0) - probs[order]
    keep[order[(before >= top_p) & (torch.arange(len(x)) > 0)]] = False
    keep &= probs >= min_p * probs.max()
    return torch.where(keep, x, -math.inf).softmax(-1)


DISTRIBUTION_CASES = [  # (temperature, min_p, top_p)
    (1.0, 0.0, 1.0),
    (0.5, 0.0, 1.0),
    (1.7, 0.0, 1.0),
    (1.0, 0.2, 1.0),
    (1.0, 0.0, 0.7),
    (1.3, 0.0, 0.9),
    (2.0, 0.15, 0.85),
    (0.8, 0.05, 0.95),
]


@pytest.mark.parametrize("vocab_size", [12, 2600])
@pytest.mark.parametrize("case", DISTRIBUTION_CASES, ids=lambda c: f"t{c[0]}-m{c[1]}-p{c[2]}")
def test_draws_follow_the_exact_distribution(case, vocab_size):
    temperature, min_p, top_p = case
    row = LOGITS_12 if vocab_size == 12 else random_logits(1, vocab_size, seed=9)[0] / 2
    num_draws, batch = 20_000, 2_000
    logits = row.repeat(batch, 1)
    generator = torch.Generator().manual_seed(hash(case) % 1000 + vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for _ in range(num_draws // batch):
        uniforms = torch.rand(batch, 16, generator=generator)
        token_ids = sample_from_rows(
            logits,
            torch.full((batch,), temperature),
            torch.full((batch,), min_p),
            torch.full((batch,), top_p),
            uniforms,
        )
        assert (token_ids >= 0).all(), "16 draws at top_p >= 0.7 were all rejected"
        counts += torch.bincount(token_ids, minlength=vocab_size)
    assert chi_square_p_value(counts, reference_probs(row, temperature, min_p, top_p)) > 1e-4


# ---------------------------------------------------------------------------------------------
# Rejected rows and bad arguments


def test_a_row_whose_every_draw_falls_outside_the_nucleus_is_minus_one():
    logits = LOGITS_12.repeat(3, 1)
    ones = torch.ones(3)
    # top_p 0.01: only the most likely token (index 0) is in the nucleus; u = 0.99 lands on the
    # least likely tokens every time, u = 0.05 on token 0.
    uniforms = torch.tensor([[0.99] * 4, [0.99, 0.99, 0.05, 0.99], [0.05, 0.99, 0.99, 0.99]])
    token_ids = sample_from_rows(logits, ones, torch.zeros(3), torch.full((3,), 0.01), uniforms)
    assert token_ids.tolist() == [-1, 0, 0]


def valid_sampling_args(num_rows: int = 2, vocab_size: int = 12):
    ones = torch.ones(num_rows)
    return dict(
        logits=LOGITS_12[:vocab_size].repeat(num_rows, 1),
        temperature=ones,
        min_p=torch.zeros(num_rows),
        top_p=ones,
        uniforms=torch.full((num_rows, 1), 0.5),
    )


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(logits=LOGITS_12.repeat(2, 1).double()), "logits must be torch.float32"),
        (dict(logits=LOGITS_12), "logits must have 2 dimensions"),
        (dict(logits=torch.zeros(2, 0)), "at least one column"),
        (dict(temperature=torch.ones(3)), r"temperature must have shape \(2,\)"),
        (dict(temperature=torch.tensor([1.0, 0.0])), "temperature must be positive"),
        (dict(min_p=torch.tensor([0.0, 1.5])), r"min_p must be in \[0, 1\]"),
        (dict(top_p=torch.tensor([0.0, 1.0])), r"top_p must be in \(0, 1\]"),
        (dict(uniforms=torch.zeros(2, 0)), "num_uniforms >= 1"),
        (dict(uniforms=torch.zeros(2, 1, dtype=torch.float64)), "uniforms must be torch.float32"),
    ],
)
def test_sample_from_rows_refuses_bad_arguments(change, message):
    with pytest.raises(ValueError, match=message):
        sample_from_rows(**{**valid_sampling_args(), **change})


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(logits=torch.zeros(2, 12, dtype=torch.float16)), "logits must be torch.float32"),
        (dict(token_ids=torch.tensor([0, 12])), r"token_ids must lie in \[0, 12\)"),
        (dict(token_ids=torch.tensor([0, 1], dtype=torch.int32)), "token_ids must be torch.int64"),
        (dict(num_top=21), r"num_top must be an integer in \[0, 12\]"),
        (dict(num_top=-1), "num_top must be an integer"),
    ],
)
def test_logprob_stats_refuses_bad_arguments(change, message):
    args = dict(logits=LOGITS_12.repeat(2, 1), token_ids=torch.tensor([0, 1]), num_top=2)
    with pytest.raises(ValueError, match=message):
        logprob_stats(**{**args, **change})


def test_the_ops_check_their_arguments_themselves():
    ops = cpu_sampling._ops()
    args = valid_sampling_args()
    token_ids = torch.empty(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="logits must be contiguous"):
        ops.sample_from_rows(
            args["logits"].t().contiguous().t(),
            args["temperature"],
            args["min_p"],
            args["top_p"],
            args["uniforms"],
            token_ids,
        )
    with pytest.raises(RuntimeError, match="token_ids must have shape"):
        ops.sample_from_rows(
            args["logits"],
            args["temperature"],
            args["min_p"],
            args["top_p"],
            args["uniforms"],
            torch.empty(3, dtype=torch.long),
        )
    with pytest.raises(RuntimeError, match=r"token_ids\[1\] = 12 is outside the vocabulary"):
        ops.logprob_stats(
            args["logits"],
            torch.tensor([0, 12]),
            0,
            torch.empty(2),
            torch.empty(2, dtype=torch.long),
            torch.empty(2, 0, dtype=torch.long),
            torch.empty(2, 0),
        )


def test_a_row_with_nothing_to_sample_raises():
    logits = torch.full((2, 12), -math.inf)
    logits[0, 3] = 0.0
    with pytest.raises(RuntimeError, match="row 1 has no finite largest logit"):
        sample_from_rows(**{**valid_sampling_args(), "logits": logits})


@pytest.mark.parametrize("fused", [True, False], ids=["fused kernel", "torch ops"])
def test_token_bitmask_blocks_exactly_the_clear_bits(fused):
    """Both of the sampler's mask paths against the bit rule: bit j of word w is token
    32 w + j; a clear bit sets that logit to -inf, rows not listed are untouched, and the
    padding bits past the vocabulary are ignored."""
    from pagedrs.sample import Sampler

    vocab, num_words = 1000, 32  # 1024 bits for 1000 tokens
    rng = np.random.default_rng(3)
    bitmask = rng.integers(-(2**31), 2**31 - 1, size=(3, num_words), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # a row that allows everything
    bitmask[2, 5:] = 0  # and one that allows only its first 160 tokens
    logits = torch.randn(5, vocab)
    expected = logits.clone()
    rows = [4, 0, 2]
    bits = ((bitmask[:, :, None].astype(np.int64) >> np.arange(32)) & 1).reshape(3, -1)[:, :vocab].astype(bool)
    for i, row in enumerate(rows):
        expected[row, torch.from_numpy(~bits[i])] = float("-inf")
    Sampler(vocab, 0, "cpu", fused=fused)._mask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("vocab", [49_152, 1_000, 7, 1])
def test_argmax_rows_is_torchs_argmax(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(9, vocab)
    logits[1] = 0.5  # all tied: index 0
    logits[2, [vocab // 3, vocab // 2, vocab - 1]] = 9.0  # tied maxima: the first
    logits[3, -1] = float("inf")
    logits[4] = float("-inf")
    logits[5, [vocab // 2, vocab - 1]] = float("nan")  # torch's argmax: the first NaN
    logits[6] = -0.0
    logits[6, vocab - 1] = 0.0  # -0.0 == 0.0: the first
    assert cpu_sampling.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
    ties = torch.randint(0, 3, (64, vocab)).float()  # many tied maxima in every row: the first wins
    assert cpu_sampling.argmax_rows(ties).tolist() == ties.argmax(dim=-1).tolist()


def test_argmax_rows_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="float32"):
        cpu_sampling.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_sampling.argmax_rows(torch.zeros(8, 2).T)
    with pytest.raises(ValueError, match="at least one column"):
        cpu_sampling.argmax_rows(torch.zeros(2, 0))
