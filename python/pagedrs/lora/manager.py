"""Which adapters the engine knows, which are on the host, which hold a slot.

- **Host.** An adapter is read from disk (and checked) the first time a request names it; at
  most ``max_cpu_loras`` stay on the host, least recently used dropped first (read again when
  named again).
- **Slots.** A request runs only while its adapter holds one of the ``max_loras`` device slots
  (`LoRASlots`). A slot is pinned while requests in the scheduler use its adapter; an unpinned
  one keeps its adapter (so it is found there again) until another adapter needs the slot.
  A request whose adapter finds no slot waits, outside the scheduler, until one frees
  (`OutputProcessor` keeps that queue).
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedrs.lora.adapter import LoRAAdapter, LoRARequest, load_adapter
from pagedrs.lora.slots import LoRABatch, LoRASlots, LoRAState

if TYPE_CHECKING:
    from pagedrs.config import EngineConfig
    from pagedrs.models.decoder import DecoderForCausalLM


class LoRAManager:
    def __init__(
        self,
        model: DecoderForCausalLM,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None,
        device: torch.device,
        dtype: torch.dtype,
    ):
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras if max_cpu_loras is not None else max_loras
        self.slots = LoRASlots(model, max_loras, max_lora_rank, device, dtype)
        self.state = LoRAState(self.slots)
        self.state.attach(model)
        self._requests: dict[int, LoRARequest] = {}
        """Every adapter named so far, by ``lora_int_id``: a request must name it the same way."""
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        """Adapters in slots, least recently used first."""
        self._users: Counter[int] = Counter()
        """Requests in the scheduler per adapter: their slots are pinned."""
        self.on_slot_load: Callable[[int, LoRARequest], None] | None = None
        """Called when an adapter goes into a slot: with tensor parallelism, rank 0's engine
        tells the other ranks to put their shards of it in the same slot (`place`)."""

    @classmethod
    def of(
        cls, model: DecoderForCausalLM, config: EngineConfig, device: torch.device, dtype: torch.dtype
    ) -> LoRAManager:
        """The manager ``config`` (``enable_lora``) asks for; ``dtype``: the activations'."""
        return cls(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, device, dtype)

    def register(self, request: LoRARequest) -> None:
        """Checks ``request`` (reading its adapter if it is new); a `ValueError` says why not."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self._requests.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, os.fspath(known.lora_path)) != (request.lora_name, os.fspath(request.lora_path)):
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}); "
                    "give another adapter another id"
                )
            return
        self._host_adapter(request)
        self._requests[request.lora_int_id] = request

    def _host_adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.model, self.max_lora_rank)
            self._host[request.lora_int_id] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(request.lora_int_id)
        return adapter

    def acquire(self, lora_id: int) -> bool:
        """Pins a slot for one more request of adapter ``lora_id`` (loading it there if it is
        not in one); ``False`` when every slot is pinned by other adapters."""
        slot = self._slot_of.get(lora_id)
        if slot is None:
            taken = set(self._slot_of.values())
            free = [s for s in range(self.slots.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:
                idle = [other for other in self._slot_of if self._users[other] == 0]
                if not idle:
                    return False
                slot = self._slot_of.pop(idle[0])  # the least recently used unpinned adapter
            request = self._requests[lora_id]
            self.slots.load(slot, self._host_adapter(request))
            self._slot_of[lora_id] = slot
            if self.on_slot_load is not None:
                self.on_slot_load(slot, request)
        self._slot_of.move_to_end(lora_id)
        self._users[lora_id] += 1
        return True

    def place(self, slot: int, request: LoRARequest) -> None:
        """Puts ``request``'s adapter in ``slot``, as another rank's manager decided (the other
        tensor-parallel ranks follow rank 0's `acquire`)."""
        self.register(request)
        for other, taken in list(self._slot_of.items()):
            if taken == slot:
                del self._slot_of[other]
        self.slots.load(slot, self._host_adapter(request))
        self._slot_of[request.lora_int_id] = slot

    def release(self, lora_id: int) -> None:
        """One request of adapter ``lora_id`` left the scheduler."""
        self._users[lora_id] -= 1
        if self._users[lora_id] <= 0:
            del self._users[lora_id]

    def slot(self, lora_id: int) -> int:
        return self._slot_of[lora_id]

    def set_step(self, row_slots: np.ndarray | None, device: torch.device) -> bool:
        """Makes ``row_slots`` (each token row's slot, -1 for none) the step's; returns
        whether any row has an adapter."""
        self.state.batch = None if row_slots is None else LoRABatch.of(row_slots, device)
        return self.state.batch is not None

    def names(self, lora_ids: set[int] | list[int]) -> list[str]:
        """The adapters' names, sorted."""
        return sorted(self._requests[lora_id].lora_name for lora_id in lora_ids if lora_id in self._requests)

    def running_ids(self) -> list[int]:
        """Adapters with requests in the scheduler."""
        return list(self._users)

    @property
    def num_running(self) -> int:
        """Adapters with requests in the scheduler."""
        return len(self._users)
