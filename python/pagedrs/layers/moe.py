"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V2/V3):
a router picks each token's top-k experts, each expert is a gated MLP, and the token's output
is the weighted sum of its experts' outputs (plus shared experts every token runs: Qwen2-MoE's
scaled by a sigmoid gate, DeepSeek's not).

Experts are stored stacked, ``gate_up [E, 2 * I, H]`` and ``down [E, H, I]`` (transformers'
fused layout and llama.cpp's ``ffn_*_exps``), each rank holding its share of every expert's
intermediate features (vLLM's default sharding): the router is replicated, each rank computes
partial sums over its features, and one all-reduce joins them. On the CPU the experts run as
one fused kernel (``torch.ops.pagedrs_cpu.fused_experts``, ``cpu/moe.cpp``: tokens grouped by
expert, only experts with tokens read, float32 or packed GGUF blocks); on a GPU as two grouped
matmuls in Triton (`pagedrs.layers.fused.grouped_experts`); elsewhere as a loop over the
experts that have tokens, which is also the reference both kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.checkpoint import WeightHandle
from pagedrs.kernels import cpu as cpu_kernels
from pagedrs.layers import fused
from pagedrs.layers.linear import TensorParallel, _all_reduce

ACTIVATION_IDS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1, "gelu": 2, "swiglu_oai": 3}
"""The CPU kernels' id of each gated activation (``cpu/cpu_kernels.h``'s ``Activation``);
``swiglu_oai``: gpt-oss's clamped SwiGLU (`Activation`'s ``alpha`` and ``limit``)."""
F32 = 0
"""ggml's type id of float32: dense experts, for the kernel."""
MAX_TOP_K = 64
"""The most experts a token may be routed to (no released model comes near it)."""


@dataclass(frozen=True)
class Activation:
    """An experts' gated activation: ``act(gate) * up``, or gpt-oss's clamped SwiGLU
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""

    name: str
    alpha: float = 0.0
    limit: float = 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.name == "swiglu_oai":
            gate = gate.clamp(max=self.limit)
            return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if self.name == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="none" if self.name == "gelu" else "tanh") * up


@dataclass(frozen=True)
class Routing:
    """How the router turns its logits into each token's experts and weights."""

    num_experts: int
    top_k: int
    renormalize: bool
    """The top-k probabilities divided by their sum (Mixtral always; Qwen-MoE and OLMoE by
    ``norm_topk_prob``)."""
    softmax_after_topk: bool = False
    """The top-k logits are chosen first and the weights are their softmax (gpt-oss)."""
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    """Each expert's score: the softmax over all experts, or its own sigmoid (DeepSeek-V3, which
    also adds a correction bias to the scores it chooses by, not to the weights)."""
    num_groups: int = 1
    """Experts fall into this many equal groups, and only the best ``topk_groups`` groups are
    chosen from (DeepSeek's group-limited routing); 1: no groups."""
    topk_groups: int = 1
    group_score: Literal["max", "top2_sum"] = "max"
    """How a group is ranked: by its best expert's score (DeepSeek-V2's
    ``group_limited_greedy``) or by the sum of its best two (DeepSeek-V3's ``noaux_tc``)."""
    scale: float = 1.0
    """The weights are multiplied by it at the end (DeepSeek's ``routed_scaling_factor``)."""

    def check(self) -> None:
        """``ValueError`` for a routing no expert set can follow."""
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"{self.num_experts} experts do not fall into {self.num_groups} equal groups (n_group)")
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group must be in 1..{self.num_groups}, got {self.topk_groups}")
        if self.group_score == "top2_sum" and self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError("ranking groups by their best two experts needs two experts in each group")
        if self.top_k > self.num_experts // self.num_groups * self.topk_groups:
            raise ValueError(f"top-{self.top_k} routing cannot fit in {self.topk_groups} groups of experts")


def route(
    logits: torch.Tensor, routing: Routing, score_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64 [T, K], weights float32 [T, K])`` from router logits ``[T, E]``, as
    transformers computes them (in float32): the top-k experts' scores, optionally limited to
    the best groups, renormalized and scaled; or the softmax of the top-k logits (gpt-oss).
    ``score_bias`` (``[E]``, DeepSeek-V3's ``e_score_correction_bias``) shifts the scores the
    experts are chosen by; the weights are the unshifted scores."""
    if routing.softmax_after_topk:
        top, ids = torch.topk(logits, routing.top_k, dim=-1)
        return ids, torch.softmax(top.float(), dim=-1)
    scores = torch.sigmoid(logits.float()) if routing.scoring == "sigmoid" else torch.softmax(logits.float(), dim=-1)
    choice = scores if score_bias is None else scores + score_bias.float()
    if routing.num_groups > 1:
        grouped = choice.unflatten(-1, (routing.num_groups, -1))
        if routing.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, routing.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        # As transformers: V2 zeroes the other groups' scores, V3 makes them -inf.
        hidden = 0.0 if routing.group_score == "max" else float("-inf")
        choice = grouped.masked_fill(~keep.unsqueeze(-1), hidden).flatten(-2)
    ids = torch.topk(choice, routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        denominator = weights.sum(dim=-1, keepdim=True)
        weights = weights / (denominator + 1e-20 if routing.scoring == "sigmoid" else denominator)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return ids, weights


def experts_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: Any,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token through its experts, one expert at a time over the tokens routed to it
    (transformers' eager loop): ``gate_up [E, 2I, H]``, ``down [E, H, I]`` dense, optional
    biases ``[E, 2I]`` and ``[E, H]``; ``activation(gate, up)`` (`Activation`)."""
    out = torch.zeros_like(x)
    intermediate = down.shape[2]
    for expert in torch.unique(ids).tolist():
        tokens, slots = torch.where(ids == expert)
        bias = None if gate_up_bias is None else gate_up_bias[expert]
        gate, up = F.linear(x[tokens], gate_up[expert], bias).split(intermediate, dim=-1)
        y = F.linear(activation(gate, up), down[expert], None if down_bias is None else down_bias[expert])
        out.index_add_(0, tokens, y * weights[tokens, slots, None].to(y.dtype))
    return out


class FusedExperts(nn.Module):
    """``num_experts`` gated MLPs, stacked: ``gate_up [E, 2 * I / tp, H]`` (this rank's gate
    rows, then its up rows) and ``down [E, H, I / tp]``, dense in the model's dtype (the packed
    kind: `pagedrs.quant.layers.QuantFusedExperts`). Returns partial sums under tensor
    parallelism; the caller all-reduces."""

    gate_up_type = F32
    down_type = F32

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Activation,
        tp: TensorParallel,
        dtype: torch.dtype,
        bias: bool = False,
    ):
        """``bias``: each expert's gate/up and down projections have biases (gpt-oss)."""
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = tp.split(intermediate_size, "the experts' intermediate size")
        self.tp = tp
        self.activation = activation
        size = self.intermediate_size
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, size, dtype=dtype), requires_grad=False)
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * size, dtype=dtype), False) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=dtype), False) if bias else None
        self._loaded: set[tuple[int, str]] = set()

    def unloaded(self) -> list[str]:
        """The expert projections no checkpoint tensor has been loaded into, e.g. ``["3.up"]``."""
        return [
            f"{expert}.{part}"
            for expert in range(self.num_experts)
            for part in ("gate", "up", "down")
            + (("gate_bias", "up_bias", "down_bias") if self.down_bias is not None else ())
            if (expert, part) not in self._loaded
        ]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the experts compute in (packed experts: float32)."""
        return self.gate_up.dtype

    def shard_rows(self) -> slice:
        """This rank's intermediate features of an expert (rows of gate or up, columns of down)."""
        return slice(self.tp.rank * self.intermediate_size, (self.tp.rank + 1) * self.intermediate_size)

    def load_gate_up(self, expert: int, part: int, weight: WeightHandle) -> None:
        """Expert ``expert``'s gate (``part`` 0) or up (1) projection, ``[I, H]`` in full."""
        size = self.intermediate_size
        self.gate_up[expert, part * size : (part + 1) * size].copy_(self._read(weight, self.shard_rows(), slice(None)))
        self._loaded.add((expert, ("gate", "up")[part]))

    def load_down(self, expert: int, weight: WeightHandle) -> None:
        """Expert ``expert``'s down projection, ``[H, I]`` in full."""
        self.down[expert].copy_(self._read(weight, slice(None), self.shard_rows()))
        self._loaded.add((expert, "down"))

    def load_gate_up_bias(self, expert: int, part: int, bias: torch.Tensor) -> None:
        """Expert ``expert``'s gate (``part`` 0) or up (1) bias, ``[I]`` in full."""
        if self.gate_up_bias is None:
            raise ValueError("checkpoint has experts' biases for experts built without them")
        size = self.intermediate_size
        self.gate_up_bias[expert, part * size : (part + 1) * size].copy_(bias[self.shard_rows()])
        self._loaded.add((expert, ("gate_bias", "up_bias")[part]))

    def load_down_bias(self, expert: int, bias: torch.Tensor) -> None:
        """Expert ``expert``'s down bias, ``[H]`` (not sharded: rank 0 adds it)."""
        if self.down_bias is None:
            raise ValueError("checkpoint has experts' biases for experts built without them")
        self.down_bias[expert].copy_(bias)
        self._loaded.add((expert, "down_bias"))

    def _down_bias(self) -> torch.Tensor | None:
        """The down bias this rank adds: the partial sums of every rank add up to one bias."""
        return self.down_bias if self.tp.rank == 0 else None

    def _read(self, weight: WeightHandle, rows: slice, cols: slice) -> torch.Tensor:
        """``weight[rows, cols]`` as this layer stores it."""
        return weight[rows, cols]

    def uses_kernel(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels.available()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.uses_kernel(x):
            return cpu_kernels.load().fused_experts(
                x.contiguous(),
                ids.contiguous(),
                weights.float().contiguous(),
                self.gate_up,
                self.gate_up_type,
                self.down,
                self.down_type,
                self.intermediate_size,
                ACTIVATION_IDS[self.activation.name],
                self.gate_up_bias,
                self._down_bias(),
                self.activation.alpha,
                self.activation.limit,
            )
        biases = self.gate_up_bias, self._down_bias()
        if fused.enabled(x):
            return fused.grouped_experts(x, ids, weights, self.gate_up, self.down, self.activation, *biases)
        return experts_reference(x, ids, weights, self.gate_up, self.down, self.activation, *biases)


class SparseMoe(nn.Module):
    """A mixture-of-experts MLP: the router (``gate``, replicated), the routed experts, and an
    optional shared expert (an MLP every token runs), scaled by ``sigmoid(shared_expert_gate(x))``
    (Qwen2-MoE) or not (DeepSeek's, whose ``n_shared_experts`` are one MLP of their summed width)."""

    def __init__(
        self,
        routing: Routing,
        hidden_size: int,
        intermediate_size: int,
        activation: Activation,
        tp: TensorParallel,
        dtype: torch.dtype,
        shared_expert: nn.Module | None = None,
        bias: bool = False,
        shared_gate: bool = True,
        score_bias: bool = False,
    ):
        """``bias``: the router and every expert's projections have biases (gpt-oss);
        ``shared_gate``: the shared expert is scaled by a sigmoid gate (Qwen2-MoE; DeepSeek's
        shared experts have none); ``score_bias``: the router's scores have a correction bias
        (DeepSeek-V3's ``e_score_correction_bias``)."""
        super().__init__()
        if not 0 < routing.top_k <= min(routing.num_experts, MAX_TOP_K):
            raise ValueError(
                f"num_experts_per_tok must be in 1..{min(routing.num_experts, MAX_TOP_K)}, got {routing.top_k}"
            )
        routing.check()
        if activation.name not in ACTIVATION_IDS:
            raise ValueError(f"experts' activation {activation.name!r} is not supported ({', '.join(ACTIVATION_IDS)})")
        self.routing = routing
        self.tp = tp
        self.gate = nn.Parameter(torch.empty(routing.num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.gate_bias = nn.Parameter(torch.zeros(routing.num_experts, dtype=dtype), False) if bias else None
        self.experts = FusedExperts(routing.num_experts, hidden_size, intermediate_size, activation, tp, dtype, bias)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            nn.Parameter(torch.empty(1, hidden_size, dtype=dtype), requires_grad=False)
            if shared_expert is not None and shared_gate
            else None
        )
        self.score_bias = (
            nn.Parameter(torch.zeros(routing.num_experts, dtype=torch.float32), False) if score_bias else None
        )
        self.expert_tokens: torch.Tensor
        self.register_buffer("expert_tokens", torch.zeros(routing.num_experts, dtype=torch.int64), persistent=False)
        """(Token, slot) pairs routed to each expert since the model was built: what
        ``pagedrs:moe_expert_tokens`` reports (the CPU decoder stack counts into it too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(F.linear(x, self.gate, self.gate_bias), self.routing, self.score_bias)
        self.expert_tokens += torch.bincount(ids.reshape(-1), minlength=self.routing.num_experts)
        out = _all_reduce(self.experts(x, ids, weights), self.tp)
        if self.shared_expert is not None:
            # the shared expert's down projection is row-parallel: it all-reduces itself
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
            out = out + shared
        return out
