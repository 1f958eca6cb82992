"""LoRA adapters over one base model (issue 31): `LoRARequest` names one, `load_adapter`
reads a peft checkpoint and checks it against the model's layers (`pagedrs.lora.adapter`)."""

from pagedrs.lora.adapter import LINEARS, LoRAAdapter, LoRARequest, LoRAWeights, load_adapter

__all__ = ["LINEARS", "LoRAAdapter", "LoRARequest", "LoRAWeights", "load_adapter"]
