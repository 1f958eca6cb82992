"""Building an engine's parts from an `EngineConfig`, in the order that fails cheapest first.

- `load_engine_parts`: model config and tokenizer, the KV plan, the Rust scheduler, then the
  tensor-parallel ranks, the weights and a draft model: everything that can be refused is
  refused before a weight loads or a rank starts.
- `plan_kv_cache`: one rank's KV budget and block count, shared with ``pagedrs memory``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from pagedrs._core import Scheduler
from pagedrs.checkpoint import ModelSource
from pagedrs.config import EngineConfig, resolve_dtype, resolve_kv_cache_dtype
from pagedrs.engine.cuda_graphs import GraphSettings
from pagedrs.engine.kv_layout import KVLayout
from pagedrs.engine.model_runner import ModelRunner, load_model_runner
from pagedrs.engine.parallel import TensorParallelGroup, TensorParallelRunner
from pagedrs.engine.tp_common import check_parallel_config, launched_setup
from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.layers.linear import TensorParallel
from pagedrs.layers.rotary import model_positions
from pagedrs.memory import KVCapacity, kv_cache_capacity
from pagedrs.models import architecture_of, build_model
from pagedrs.models.loader import load_config, load_tokenizer, resolve_model
from pagedrs.models.registry import is_sequence_classifier
from pagedrs.quant.loading import predicted_weight_bytes
from pagedrs.sample import Sampler
from pagedrs.spec_decode import SpeculativeConfig
from pagedrs.spec_decode.drafter import DraftModelProposer

logger = logging.getLogger("pagedrs")


@dataclass(frozen=True)
class KVCachePlan:
    """One rank's KV cache, as planned before anything loads."""

    weight_bytes: int
    """The weights this process will hold (a draft model's included), predicted from the
    checkpoints."""
    budget_bytes: int
    """``kv_cache_memory``, or the default for those weights."""
    capacity: KVCapacity
    layout: KVLayout
    """How the target's layers share the blocks."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine is serving, for the server and its metrics (read-only)."""

    model_name: str
    architecture: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    num_blocks: int
    config: EngineConfig
    speculative: SpeculativeConfig | None
    """In effect: ``disable_by_batch_size`` resolved for the device (0: never steps aside)."""
    distributed_backend: str | None
    """The tensor-parallel ranks' ``torch.distributed`` backend, when there are ranks."""


@dataclass
class EngineParts:
    """Everything `LLMEngine` runs with."""

    info: EngineInfo
    hf_config: Any
    tokenizer: Any
    scheduler: Scheduler
    runner: ModelRunner | TensorParallelRunner
    sampler: Sampler
    drafter: DraftModelProposer | None
    parallel: TensorParallelGroup | None
    """The other tensor-parallel ranks (this engine is rank 0), when there are any."""


def wants_decode_graphs(config: EngineConfig, device: torch.device, parallel: object, hf_config: Any) -> bool:
    """CUDA graphs for decode: on a GPU, one rank, unless ``enforce_eager``; never for a
    sequence classifier, which does not decode (and has no logits to capture)."""
    return (
        device.type == "cuda"
        and parallel is None
        and not config.enforce_eager
        and not is_sequence_classifier(hf_config)
    )


@dataclass(frozen=True)
class _Draft:
    source: ModelSource
    hf_config: Any


def kv_layout_of(hf_config: Any, dtype: torch.dtype, tensor_parallel_size: int, with_draft: bool) -> KVLayout:
    """The target's `KVLayout`, from its layers as built (on the meta device: a setting the
    model does not implement fails here). A draft model's layers live in group 0's blocks,
    so a model whose only group is sliding keeps every block when it has one."""
    with torch.device("meta"):
        windows = build_model(hf_config, dtype, TensorParallel(0, tensor_parallel_size)).layer_windows
    layout = KVLayout.plan(windows)
    if with_draft and layout.group_windows[0] is not None:
        layout = KVLayout.plan(windows, release_windows=False)
    return layout


def plan_kv_cache(
    config: EngineConfig,
    source: ModelSource,
    hf_config: Any,
    device: torch.device,
    dtype: torch.dtype,
    draft: _Draft | None = None,
) -> KVCachePlan:
    """One rank's KV budget and blocks: a block holds ``layout.num_slots`` layers' keys and
    values (`pagedrs.engine.kv_layout`); a draft model's KV lives in the same blocks
    (`pagedrs.spec_decode.drafter`), and its weights count against the default budget."""
    layout = kv_layout_of(hf_config, dtype, config.tensor_parallel_size, draft is not None)
    weight_bytes = predicted_weight_bytes(source, config.quantization, dtype, device)
    if draft is not None:
        weight_bytes += predicted_weight_bytes(draft.source, config.quantization, dtype, device)
    budget = config.kv_cache_bytes(device, weight_bytes)
    capacity = kv_cache_capacity(
        hf_config,
        budget,
        resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device),
        config.block_size,
        config.tensor_parallel_size,
        draft.hf_config if draft is not None else None,
        num_layer_slots=layout.num_slots,
    )
    return KVCachePlan(weight_bytes, budget, capacity, layout)


def load_engine_parts(config: EngineConfig) -> EngineParts:
    """Builds an engine's parts (see the module docstring for the order)."""
    config.validate()
    device = config.torch_device()
    dtype = resolve_dtype(config.dtype, device)
    check_parallel_config(config, device)
    source = resolve_model(config.model)
    hf_config = load_config(source, config.hf_overrides)
    architecture = architecture_of(hf_config)
    tokenizer = load_tokenizer(source)
    tp_size = config.tensor_parallel_size
    classifier_tokens = _classifier_token_ids(hf_config, tokenizer, tp_size)
    speculative = config.speculative_config
    draft = _load_draft_config(speculative, hf_config, tp_size)
    # A setting the model does not implement (a rotary type, an activation) or an indivisible
    # head count fails here (the model is built on the meta device for its KV layout), before
    # any weight is read or any rank starts.
    plan = plan_kv_cache(config, source, hf_config, device, dtype, draft)
    num_blocks = plan.capacity.num_blocks
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory is too small for one block of {plan.capacity.bytes_per_block} bytes")
    max_model_len = _max_model_len(config, hf_config, draft)
    if speculative is not None:
        speculative = dataclasses.replace(
            speculative, disable_by_batch_size=speculative.effective_disable_by_batch_size(device.type) or 0
        )
    scheduler = Scheduler(
        config,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        namespace=f"{source.name}|{dtype}",
        speculative=speculative,
        kv_group_windows=list(plan.layout.group_windows),
    )
    parallel: TensorParallelGroup | None = None
    # NOTE: an explicit backend with one rank also goes through torch.distributed (the GPU
    # check proves the NCCL path initializes on one device this way).
    if tp_size > 1 or config.distributed_backend is not None or launched_setup(config, device) is not None:
        parallel = TensorParallelGroup(config, device, num_blocks, dtype)
    try:
        runner = load_model_runner(
            config,
            dtype,
            device,
            num_blocks,
            size=tp_size,
            hf_config=hf_config,
            graphs=GraphSettings(max_model_len, config.max_num_seqs)
            if wants_decode_graphs(config, device, parallel, hf_config)
            else None,
            release_windows=draft is None or plan.layout.group_windows[0] is None,
        )
        if parallel is not None:
            parallel.wait_until_loaded()
        if classifier_tokens is not None:
            runner.model.use_token_classifier(
                classifier_tokens, difference=bool(getattr(hf_config, "is_original_qwen3_reranker", False))
            )
    except BaseException:
        if parallel is not None:
            parallel.shutdown(graceful=False)
        raise
    sampler = Sampler(hf_config.vocab_size, config.seed, device)
    drafter = None
    if draft is not None and speculative is not None:
        draft_runner = load_model_runner(
            dataclasses.replace(config, model=speculative.model),
            dtype,
            device,
            num_blocks,
            hf_config=draft.hf_config,
            release_windows=False,
        )
        drafter = DraftModelProposer(draft_runner, sampler)
    info = EngineInfo(
        model_name=source.name,
        architecture=architecture,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        config=config,
        speculative=speculative,
        distributed_backend=parallel.backend if parallel is not None else None,
    )
    _log_start(info, plan)
    return EngineParts(
        info=info,
        hf_config=hf_config,
        tokenizer=tokenizer,
        scheduler=scheduler,
        runner=runner if parallel is None else TensorParallelRunner(runner, parallel),
        sampler=sampler,
        drafter=drafter,
        parallel=parallel,
    )


def _classifier_token_ids(hf_config: Any, tokenizer: Any, tp_size: int) -> list[int] | None:
    """The token ids of ``classifier_from_token`` (`EngineConfig.hf_overrides`), checked."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        return None
    if tp_size > 1:
        raise ValueError("classifier_from_token needs tensor_parallel_size 1 (it reads whole rows of the head)")
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id or not 0 <= token_id < hf_config.vocab_size:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of this tokenizer")
        ids.append(int(token_id))
    return ids


def _load_draft_config(speculative: SpeculativeConfig | None, hf_config: Any, tp_size: int) -> _Draft | None:
    """The draft model's checkpoint and Hugging Face config, checked against the target's;
    ``None`` without a draft model."""
    if speculative is None or speculative.model is None:
        return None
    if tp_size > 1:
        raise ValueError("a draft model runs with tensor_parallel_size 1 (ngram and suffix speculation run with any)")
    source = resolve_model(speculative.model)
    draft_config = load_config(source)
    architecture_of(draft_config)  # an unsupported draft architecture fails here
    if draft_config.vocab_size != hf_config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft_config.vocab_size} tokens) differs from the target's "
            f"({hf_config.vocab_size}): it must share the target's tokenizer"
        )
    return _Draft(source, draft_config)


def _max_model_len(config: EngineConfig, hf_config: Any, draft: _Draft | None) -> int:
    """``max_model_len`` within the model's positions (a draft model trained on fewer only
    warns: its proposals may be poor, the output stays exact)."""
    model_max_len = int(model_positions(hf_config) or 2**31)
    max_model_len = min(config.max_model_len or model_max_len, model_max_len)
    draft_max_len = getattr(draft.hf_config, "max_position_embeddings", None) if draft is not None else None
    if draft_max_len is not None and draft_max_len < max_model_len:
        logger.warning(
            "the draft model was trained on %d positions, fewer than max_model_len %d: past them its "
            "proposals may be poor (the output stays exact)",
            draft_max_len,
            max_model_len,
        )
    return max_model_len


def _log_start(info: EngineInfo, plan: KVCachePlan) -> None:
    config = info.config
    if info.speculative is not None:
        logger.info("speculative decoding: %s", info.speculative)
    if info.device.type == "cpu" and cpu_kernels.available():
        logger.info("%s", cpu_kernels.describe())
    if config.kv_cache_dtype != "auto" or config.cpu_activation_quantization != "none":
        logger.info(
            "approximate arithmetic asked for: KV cache %s, activations %s",
            config.kv_cache_dtype,
            config.cpu_activation_quantization,
        )
    logger.info(
        "pagedrs engine: %s (%s) %s on %s, tensor parallel %d%s, %d KV blocks of %d tokens x %d layers%s",
        info.model_name,
        info.architecture,
        info.dtype,
        info.device,
        config.tensor_parallel_size,
        f" ({info.distributed_backend})" if info.distributed_backend is not None else "",
        plan.capacity.num_blocks,
        config.block_size,
        plan.layout.num_slots,
        f" in {plan.layout.num_groups} layer groups, windows {list(plan.layout.group_windows)}"
        if plan.layout.num_groups > 1 or plan.layout.group_windows[0] is not None
        else "",
    )
