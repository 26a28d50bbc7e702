"""Shared fixtures.  The default model is loaded once per test session (once per worker under ``make test``)."""

from __future__ import annotations

import os

import pytest
import torch

# Two compute threads, or the cores split between pytest-xdist's workers (``make test`` runs two): torch threads
# that outnumber the cores spin against each other, and a model test then took five times as long.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(_THREADS)
if _WORKERS > 1:  # the notebooks' kernels and the CLI subprocesses a test starts get the same share
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

# Without a GPU every Triton kernel runs in the interpreter, and Triton reads TRITON_INTERPRET when triton.language
# is first imported (it decorates its own library then).  A test module that imports transformers imports Triton,
# so the variable is set here, before any test module is collected: otherwise the lab 7 checker, collected after
# such a module, fails every kernel case with "Cannot call @triton.jit'd outside of the scope of a kernel".
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

LONG_TEXT = (
    "The history of computing is a story of layers. Early machines were programmed by rewiring "
    "panels; later, stored programs let the same hardware run many tasks. Operating systems "
    "arrived to share one expensive computer among many users, and with them came schedulers, "
    "virtual memory and paging, ideas that reappear today inside the software that serves large "
    "language models to thousands of people at once. A serving engine must decide, many times a "
    "second, which requests run, how much memory each may hold, and who waits. Memory for the "
    "attention keys and values grows with every token, so engines cut it into fixed-size blocks, "
    "much as an operating system cuts memory into pages, and keep a table per request that maps "
    "logical positions to physical blocks. When memory runs out, some request must give its blocks "
    "back, and either recompute them later or have them copied somewhere slower. Good schedulers "
    "keep the machine busy without letting any single user starve the others, and they measure "
    "everything: time to first token, time between tokens, throughput and memory in use. "
)


@pytest.fixture(scope="session")
def default_model_dir():
    from minivllm.model.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from minivllm.model.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def parity_prompts(tokenizer):
    """Eight token prompts of 20..400 tokens, cut from one long text at different offsets."""
    ids = tokenizer.encode(LONG_TEXT * 3)
    lengths = [20, 45, 80, 130, 190, 250, 320, 400]
    return [ids[7 * i : 7 * i + n] for i, n in enumerate(lengths)]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with HF's own forward + KV cache; EOS does not stop it (like ignore_eos)."""
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        past = out.past_key_values
        tokens = []
        nxt = int(out.logits[0, -1].argmax())
        for _ in range(max_new_tokens):
            tokens.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = int(out.logits[0, -1].argmax())
    return tokens


@pytest.fixture(scope="session")
def hf_reference_tokens(hf_model, parity_prompts):
    return [hf_greedy(hf_model, p, 32) for p in parity_prompts]


@pytest.fixture(scope="session")
def default_llm():
    """One engine on the default model, shared by tests that do not change its options."""
    from minivllm import LLM

    return LLM(dtype="float32")


@pytest.fixture(scope="session")
def small_llm():
    """A default-model engine with a short max_model_len, for API and bad-input tests."""
    from minivllm import LLM

    return LLM(dtype="float32", max_model_len=512, num_gpu_blocks_override=128)
