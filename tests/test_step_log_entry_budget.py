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
