"""The tiny float32 test model: it lives in :mod:`adaptive_spec.vllm.tiny_model` (``bench serve --quick`` uses
it too); re-exported here for the tests."""

from adaptive_spec.vllm.tiny_model import TOKENIZER_FILES, make_tiny_model

__all__ = ["TOKENIZER_FILES", "make_tiny_model"]
