"""A simulated engine behind the OpenAI-compatible server, for tests that talk to it through the official client.

One definition for the test files that need the real server routes and a real tokenizer but no model weights:
the engine's forward pass is a stand-in executor, so a test's answers are instant and repeatable.
"""

from __future__ import annotations

from contextlib import contextmanager

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine


def small_engine(executor, tokenizer, eos_token_ids=()) -> LLMEngine:
    """128 blocks of 4 tokens, 256 positions, 8 seats, prefix caching on."""
    cfg = EngineConfig(num_gpu_blocks_override=128, block_size=4, max_model_len=256, max_num_seqs=8,
                       enable_prefix_caching=True, device="cpu")
    return LLMEngine(cfg, executor=executor, tokenizer=tokenizer, model_max_len=256, eos_token_ids=set(eos_token_ids))


@contextmanager
def serving(engine: LLMEngine, **server_options):
    """``engine`` served as ``sim`` on a background server, with an ``openai`` client as ``.client``.  On the way
    out the server thread must stop and the engine hold no block: a test that leaked one fails here."""
    import openai

    from minivllm.server import BackgroundServer

    srv = BackgroundServer(engine, "sim", start_timeout_s=20, **server_options)
    try:
        srv.client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        yield srv
    finally:
        srv.stop(20)
    assert not srv.running, "the server thread did not stop"
    assert engine.stats()["used_blocks"] == 0
