"""A hunt at the configuration boundary: values ``EngineConfig`` and the command line accepted that then could not
serve a request, or were dropped without a word.

The project's rule (README, ``minivllm/config.py``): an impossible configuration fails loudly with a ``ValueError``
(or an argparse error) naming the field, before any request is accepted -- and a configuration that is accepted
works.  Each test names the bug it pins and fails on the code before its fix.
"""

from __future__ import annotations

import pytest
import torch

import minivllm
from minivllm.cli import main as cli_main
from minivllm.config import EngineConfig


@pytest.mark.parametrize("bad", [torch.int8, torch.bool, torch.complex64, ["float32"]],
                         ids=["int8", "bool", "complex64", "a list"])
def test_a_dtype_no_model_can_run_in_is_refused_when_the_config_is_built(bad):
    """Pins: any ``torch.dtype`` passed through unchecked.  ``LLM(dtype=torch.int8)`` loaded the model, cast its
    weights to int8, and every request then finished with ``"error"`` ("silu_cpu not implemented for 'Char'");
    a list reached a dict lookup as ``TypeError: unhashable type``.  Oracle: the documented dtypes are
    floating-point names (``parse_dtype``'s table), and a refusal is a ``ValueError`` naming the field."""
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(device="cpu", dtype=bad)


def test_floating_point_torch_dtypes_are_still_accepted():
    """The other side of the check above: the dtypes the names spell, and fp64 (which serves exactly, slowly)."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert EngineConfig(device="cpu", dtype=dtype).dtype == dtype


def test_a_block_larger_than_the_kv_memory_is_refused_before_anything_is_allocated():
    """Pins: a KV budget smaller than one block rounded up to one block.  ``block_size=2**40`` (a power of two,
    so accepted) then asked the allocator for 50 PB and ``LLM(...)`` -- and ``minivllm generate --block-size``
    -- died with a ``RuntimeError`` traceback; a 1 MiB ``kv_cache_memory_bytes`` with 64-token blocks of about
    2.9 MB each silently got a pool three times the bytes asked for.  Oracle: ``kv_cache_memory_bytes`` is the
    KV memory in bytes (``EngineConfig``'s docstring), and a simulated engine given the same budget already
    refused the config (its pool is ``budget // bytes_per_block`` = 0 blocks)."""
    with pytest.raises(ValueError, match="block_size"):
        minivllm.LLM(dtype="float32", block_size=2**40, max_model_len=256)
    with pytest.raises(ValueError, match="block_size"):
        minivllm.LLM(dtype="float32", block_size=64, max_model_len=64, kv_cache_memory_bytes=1 << 20)


class _Reached(Exception):
    pass


def test_serve_refuses_min_free_blocks_without_the_queue_limit_it_works_with(monkeypatch, capsys):
    """Pins: ``minivllm serve --min-free-blocks 8`` alone accepted and then ignored (no door is built without
    ``--max-waiting-requests``, so nothing was ever shed).  Oracle: the flag's help and the README ("with
    ``--max-waiting-requests``").  With both flags the server still starts: the engine is a stub that stops
    there, so no model loads."""
    pytest.importorskip("uvicorn")
    monkeypatch.delenv("MINIVLLM_API_KEYS", raising=False)

    def fake_llm(model, **options):
        raise _Reached

    monkeypatch.setattr(minivllm, "LLM", fake_llm)
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--min-free-blocks", "8"])
    assert exc.value.code == 2 and "--min-free-blocks" in capsys.readouterr().err
    with pytest.raises(_Reached):
        cli_main(["serve", "--min-free-blocks", "8", "--max-waiting-requests", "4"])
    with pytest.raises(_Reached):  # the default, 0, asks for nothing
        cli_main(["serve"])
