"""The sampler on synthetic logits: each rule does what it says."""

import pytest
import torch

from pagedrs import SamplingParams
from pagedrs.sampler import Sampler, SamplingRow


def row(params: SamplingParams, output=(), prompt=(), banned=(), seed=None) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, generator, list(prompt), list(output), list(banned))


def test_greedy_is_argmax_and_bans_are_respected():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 4.0]])
    greedy = SamplingParams(temperature=0)
    out = Sampler()(logits, [row(greedy), row(greedy, banned=[0])])
    assert out.token_ids.tolist() == [1, 2]


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
    out = Sampler(seed=0)(logits, [row(params)] * 50)
    assert set(out.token_ids.tolist()) == {1}


def test_top_k_keeps_only_k_candidates():
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0]]).repeat(400, 1)
    out = Sampler(seed=0)(logits, [row(SamplingParams(top_k=2))] * 400)
    assert set(out.token_ids.tolist()) == {0, 1}


def test_seeded_rows_reproduce_whatever_the_batch():
    logits = torch.randn(1, 100)
    params = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler()(logits, [row(params, seed=7)]).token_ids.tolist()
    batch = torch.cat([torch.randn(5, 100), logits, torch.randn(5, 100)])
    rows = [row(SamplingParams())] * 5 + [row(params, seed=7)] + [row(SamplingParams(seed=3), seed=3)] * 5
    assert Sampler()(batch, rows).token_ids[5].item() == alone[0]


def test_penalties_follow_the_hugging_face_and_openai_rules():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    sampler = Sampler()
    repetition = row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0], output=[1])
    adjusted = logits.clone()
    sampler._apply_penalties(adjusted, [repetition])
    assert adjusted.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    openai = row(SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25), output=[2, 2, 3])
    adjusted = logits.clone()
    sampler._apply_penalties(adjusted, [openai])
    assert adjusted.tolist() == [[2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]]


def test_logprobs_are_of_the_raw_distribution_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=2))])
    expected = logits.log_softmax(-1)
    assert out.token_ids.tolist() == [1]
    assert out.logprobs[0].item() == pytest.approx(expected[0, 1].item())
    assert out.ranks.tolist() == [1]
    assert out.top_token_ids.tolist() == [[1, 2]]


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
