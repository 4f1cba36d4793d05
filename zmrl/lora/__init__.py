"""zmrl.lora: the canonical unmerged LoRA over every attention projection, every routed expert and
the shared expert (adapter.py), and PEFT-format files (peft_io.py)."""
from zmrl.lora.adapter import DEFAULT_TARGETS, LoraAdapter, LoraConfig, LoraProjections
from zmrl.lora.peft_io import adapter_from_peft, load_peft, peft_tensors, save_peft

__all__ = ["DEFAULT_TARGETS", "LoraAdapter", "LoraConfig", "LoraProjections", "adapter_from_peft", "load_peft",
           "peft_tensors", "save_peft"]
