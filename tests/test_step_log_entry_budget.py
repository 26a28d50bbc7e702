"""What a step costs against the step log's ``max_entries`` budget, counted by hand as the module docstring states:
one entry for the step, one per scheduled sequence, one per tenant row (tenant rows only once tenants are logged)."""

from minivllm.labs.workloads import sim_engine
from minivllm.sampling_params import SamplingParams


def _decode_step_size(tenant: str) -> int:
    engine = sim_engine(num_blocks=4096, max_num_seqs=256, max_num_batched_tokens=8192)
    for k in range(256):
        engine.add_request({"prompt_token_ids": [11 + k % 50] * 8}, SamplingParams(max_tokens=50, ignore_eos=True),
                           request_id=f"q{k}", tenant=tenant)
    for _ in range(3):  # one prefill step, then decodes
        engine.step()
    last = engine.step_log[-1]
    assert len(last.seq_ids) == last.num_decodes == 256
    return last.size


def test_a_256_decode_step_costs_257_entries_without_tenants_and_258_with_one_named_tenant():
    assert _decode_step_size("default") == 256 + 1
    assert _decode_step_size("chat") == 256 + 1 + 1


def test_an_idle_step_costs_one_entry():
    engine = sim_engine()
    engine.step()
    assert engine.step_log[-1].size == 1 and not engine.step_log[-1].seq_ids


def test_the_engine_option_bounds_entries_not_scheduled_sequences():
    """``step_log_max_entries=100`` with 8 decodes a step: 9 entries a record, so 11 records (99 entries) and
    88 scheduled sequences are kept, not 100 sequences."""
    engine = sim_engine(num_blocks=256, max_num_seqs=8, step_log_max_entries=100)
    for k in range(8):
        engine.add_request({"prompt_token_ids": [11 + k] * 16}, SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(40):
        engine.step()
    log = engine.step_log
    assert (len(log), log.num_entries, sum(len(r.seq_ids) for r in log)) == (100 // 9, 11 * 9, 11 * 8)


def _bytes_per_entry(seqs: int, tokens: int) -> float:
    """Memory the log frees when cleared, over its entries (traced from before the run)."""
    import gc
    import tracemalloc

    engine = sim_engine(num_blocks=4096, max_num_seqs=seqs, max_num_batched_tokens=8192)
    for k in range(seqs):
        engine.add_request({"prompt_token_ids": [11 + k % 50] * 8}, SamplingParams(max_tokens=tokens, ignore_eos=True))
    tracemalloc.start()
    try:
        while engine.has_unfinished_requests():
            engine.step()
        gc.collect()
        entries, before = engine.step_log.num_entries, tracemalloc.get_traced_memory()[0]
        engine.step_log.clear()
        gc.collect()
        return (before - tracemalloc.get_traced_memory()[0]) / entries
    finally:
        tracemalloc.stop()


def test_an_entry_costs_tens_of_bytes_in_a_large_batch_and_about_150_alone():
    """The sizes the docs quote (EngineConfig, this module): measured 31 and 154 bytes an entry."""
    assert 15 < _bytes_per_entry(256, 30) < 60
    assert 100 < _bytes_per_entry(1, 200) < 250
