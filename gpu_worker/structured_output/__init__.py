"""Structured output on the worker: manager.py (matchers and masks) over a GrammarBackend (backend.py)."""
from gpu_worker.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
