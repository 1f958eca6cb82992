"""Typed wrappers of the compiled CPU sampling ops (``cpu/sampling.cpp``): a whole step's rows
in one call each, every row read in place a few times, no ``[rows, vocab]`` temporary.

- `sample_from_rows`: the sampler's "full" rows (temperature, min-p, top-p by rejection), by
  the same rule as ``Sampler._sample_full`` with the uniforms drawn by the caller (so a seeded
  row draws from its own generator);
- `logprob_stats`: the sampled tokens' logprobs and ranks and the top logprobs, as
  ``Sampler._to_host`` computes them;
- `argmax_rows`: greedy rows, as ``argmax``, in one read of each row.

Arguments are checked here (`ValueError`); the ops check them again (``RuntimeError``), since
they read memory by those shapes. ``check=False`` skips the checks here for a caller whose
arguments are right by construction (the sampler's: the model's logits, vectors built from
validated `SamplingParams`).

NOTE: in a single-stream decode step these checks ran cold (after the step's weights streamed
through the caches): 18 us of `argmax_rows`' 57, with its op 26 (2-core Sapphire Rapids VM)."""

from __future__ import annotations

import numpy as np
import torch

from pagedrs.kernels import cpu as cpu_kernels

MAX_TOP_LOGPROBS = 20
"""Most top logprobs a row may ask for (the ops' limit, and `SamplingParams`')."""


def available() -> bool:
    """Whether the CPU kernels build and load here (one warning, from `pagedrs.kernels.cpu`,
    when not)."""
    return cpu_kernels.available()


def _ops():
    return cpu_kernels.load()


def _check(
    tensor: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None = None, dims: int | None = None
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got a tensor on {tensor.device}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if dims is not None and tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(tensor.shape)}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.contiguous()``, without the op where it already is (a decode step's sampler
    runs cold: each op costs microseconds)."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _check_logits(logits: torch.Tensor) -> tuple[int, int]:
    _check(logits, "logits", torch.float32, dims=2)
    num_rows, vocab_size = logits.shape
    if vocab_size == 0:
        raise ValueError("logits must have at least one column (the vocabulary is empty)")
    return num_rows, vocab_size


def argmax_rows(logits: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Each row's first index of its largest value, or of its first NaN where it has one (what
    ``logits.argmax(-1)`` returns): ``int64 [R]`` of ``logits`` ``float32 [R, V]``, contiguous.
    ``check=False``: the caller vouches for the argument (the module's note)."""
    if check:
        _check_logits(logits)
        if not logits.is_contiguous():
            raise ValueError("logits must be contiguous")
    token_ids = torch.empty(len(logits), dtype=torch.int64)
    _ops().argmax_rows(logits, token_ids)
    return token_ids


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``logits[rows[i], t] = -inf`` for every token ``t`` whose bit is clear in
    ``bitmask[i]`` (bit ``j`` of word ``w`` is token ``32 w + j``, as the core's
    `GrammarMatchers.fill_bitmask` writes it). ``logits``: ``float32 [R, V]``; ``rows``:
    ``int64 [M]``; ``bitmask``: ``int32 [M, W]`` with ``32 W >= V``."""
    num_rows, vocab_size = _check_logits(logits)
    _check(rows, "rows", torch.int64, dims=1)
    _check(bitmask, "bitmask", torch.int32, dims=2)
    if not logits.is_contiguous() or not rows.is_contiguous() or not bitmask.is_contiguous():
        raise ValueError("logits, rows and bitmask must be contiguous")
    if bitmask.shape[0] != rows.shape[0] or bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"bitmask must be [{rows.shape[0]}, >= {vocab_size} / 32], got {tuple(bitmask.shape)}")
    if len(rows) and not bool(((rows >= 0) & (rows < num_rows)).all()):
        raise ValueError(f"rows must be rows of logits, in [0, {num_rows})")
    _ops().apply_token_bitmask(logits, rows, bitmask)


def logprob_stats(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits``: ``float32 [R, V]``; ``token_ids``: ``int64 [R]``, the sampled tokens.

    Returns ``(logprobs, ranks, top_ids, top_logprobs)``: each sampled token's log-probability
    under ``log_softmax(logits)`` (``float32 [R]``); its rank, 1 + the number of strictly
    larger logits (``int64 [R]``); the row's ``num_top`` most likely tokens (``int64 [R,
    num_top]``) and their log-probabilities (``float32 [R, num_top]``), most likely first,
    equal logits by lower token id (torch.topk promises no order among ties). A NaN logit
    counts as -inf in the normalizer and ranks below all others in the top (torch makes the
    whole row NaN)."""
    num_rows, vocab_size = _check_logits(logits)
    _check(token_ids, "token_ids", torch.int64, shape=(num_rows,))
    most = min(MAX_TOP_LOGPROBS, vocab_size)
    if isinstance(num_top, bool) or not isinstance(num_top, int) or not 0 <= num_top <= most:
        raise ValueError(
            f"num_top must be an integer in [0, {most}] (at most {MAX_TOP_LOGPROBS} and the "
            f"vocabulary size), got {num_top!r}"
        )
    if num_rows and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(
            f"token_ids must lie in [0, {vocab_size}), got values from {int(token_ids.min())} to {int(token_ids.max())}"
        )
    logprobs = torch.empty(num_rows, dtype=torch.float32)
    ranks = torch.empty(num_rows, dtype=torch.int64)
    top_ids = torch.empty(num_rows, num_top, dtype=torch.int64)
    top_logprobs = torch.empty(num_rows, num_top, dtype=torch.float32)
    _ops().logprob_stats(logits.contiguous(), token_ids.contiguous(), num_top, logprobs, ranks, top_ids, top_logprobs)
    return logprobs, ranks, top_ids, top_logprobs


def sample_from_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    check: bool = True,
) -> torch.Tensor:
    """One token per row of ``logits`` (``float32 [R, V]``), with ``temperature``, ``min_p``
    and ``top_p`` as ``float32 [R]`` (temperature > 0, min_p in [0, 1], top_p in (0, 1]) and
    ``uniforms`` ``float32 [R, U]`` in [0, 1), U >= 1: draw k of row r uses ``uniforms[r, k]``.

    A row's weights are ``e = exp((x - max(x)) / temperature)`` (probabilities relative to the
    most likely token); its candidates are the tokens with ``e >= min_p``. A draw is the first
    token whose cumulative candidate weight exceeds ``u`` times the candidates' total (float
    rounding past the end takes the most likely token). With ``top_p < 1`` the draw is kept iff
    the tokens strictly more likely than it hold less than ``top_p`` of the mass of ``e`` (top-p
    over the distribution before min-p), else the next uniform draws again: the kept token
    follows the distribution restricted to candidates in the nucleus, exactly. A NaN logit has
    weight 0.

    Returns ``int64 [R]``; -1 where all U draws were rejected (the caller then decides, e.g. by
    a sort). A row with no finite largest logit (all -inf or NaN, or +inf) raises
    ``RuntimeError``. ``check=False``: the caller vouches for the arguments (the module's note)."""
    num_rows = len(logits)
    if check:
        _check_sample_arguments(logits, temperature, min_p, top_p, uniforms)
    token_ids = torch.empty(num_rows, dtype=torch.int64)
    _ops().sample_from_rows(
        _contiguous(logits),
        _contiguous(temperature),
        _contiguous(min_p),
        _contiguous(top_p),
        _contiguous(uniforms),
        token_ids,
    )
    return token_ids


def _check_sample_arguments(
    logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> None:
    num_rows, _ = _check_logits(logits)
    for name, values in (("temperature", temperature), ("min_p", min_p), ("top_p", top_p)):
        _check(values, name, torch.float32, shape=(num_rows,))
    _check(uniforms, "uniforms", torch.float32, dims=2)
    if uniforms.shape[0] != num_rows or uniforms.shape[1] < 1:
        raise ValueError(
            f"uniforms must be [{num_rows}, num_uniforms] with num_uniforms >= 1, got {tuple(uniforms.shape)}"
        )
    if num_rows:
        # NOTE: through numpy's views: the dozen torch ops these checks were cost ~25 us more
        # in a one-token decode step (each small op runs cold after the step's weights have
        # streamed through the caches).
        t, low, high = temperature.numpy(), min_p.numpy(), top_p.numpy()
        if not (np.all(t > 0) and np.all(np.isfinite(t))):
            raise ValueError("temperature must be positive and finite in every row (greedy rows take the argmax)")
        if not (np.all(low >= 0) and np.all(low <= 1)):
            raise ValueError("min_p must be in [0, 1] in every row")
        if not (np.all(high > 0) and np.all(high <= 1)):
            raise ValueError("top_p must be in (0, 1] in every row")
