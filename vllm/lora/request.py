"""upstream's LoRARequest, for code that imports and builds it: this engine serves no adapters,
so `LLM.generate(..., lora_request=...)` refuses any request that is not None."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False
