"""Multi-LoRA on the worker: adapters kept in `--max-loras` slots beside the base weights (manager.py),
each adapted Linear's method adding the step's per-token delta (layer.py, delta.py)."""
from gpu_worker.lora.manager import LoRAManager

__all__ = ["LoRAManager"]
