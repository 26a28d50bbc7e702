"""The engine: the serving loop (:mod:`~minivllm.engine.llm_engine`), input and output processing."""

from minivllm.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
