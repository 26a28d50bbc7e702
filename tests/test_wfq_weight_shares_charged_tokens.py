"""``TenantConfig.weight`` under WFQ divides *charged* tokens, not raw tokens, between backlogged tenants.

Oracle: a hand count over the step log -- each scheduled prompt token costs ``wfq_prefill_weight`` (1), each
decode token ``wfq_decode_weight`` (2) -- for two tenants of weight 2 and 1 kept backlogged the whole time.
"""

from minivllm import SamplingParams
from minivllm.config import TenantConfig
from minivllm.labs.workloads import sim_engine


def _served(shape_a, shape_b, steps=400):
    """(prefill, decode) tokens per tenant over ``steps`` steps, A of weight 2 and B of weight 1."""
    engine = sim_engine(num_blocks=2048, max_num_seqs=8, max_num_batched_tokens=256, scheduling_policy="wfq",
                        tenants={"A": TenantConfig(weight=2), "B": TenantConfig(weight=1)})
    for i in range(150):  # far more than either tenant can finish in ``steps``: both stay backlogged
        for tenant, (prompt, out) in (("A", shape_a), ("B", shape_b)):
            engine.add_request({"prompt_token_ids": [11 + i % 50] * prompt, "tenant": tenant},
                               SamplingParams(max_tokens=out, ignore_eos=True), f"{tenant}{i}")
    served = {"A": [0, 0], "B": [0, 0]}
    for _ in range(steps):
        engine.step()
        rec = engine.step_log[-1]
        for j, ((_, _, n), tenant) in enumerate(zip(rec.seqs, rec.seq_tenants)):
            served[tenant][1 if j < rec.num_decodes else 0] += n
    last = engine.step_log[-1]
    assert last.tenant("A").waiting and last.tenant("B").waiting  # still backlogged at the end
    return served


def _ratios(served):
    tokens = sum(served["A"]) / sum(served["B"])
    charged = (served["A"][0] + 2 * served["A"][1]) / (served["B"][0] + 2 * served["B"][1])
    return tokens, charged


def test_weight_two_gets_twice_the_charged_tokens_whatever_the_shapes():
    tokens, charged = _ratios(_served((200, 4), (8, 64)))  # A prefill-heavy, B decode-heavy
    assert 1.8 < charged < 2.2
    assert tokens > 3  # raw tokens are not split 2:1 (3.35:1 here): prompt tokens are charged half a decode's


def test_same_shapes_split_raw_tokens_by_weight_too():
    tokens, charged = _ratios(_served((64, 16), (64, 16)))
    assert 1.8 < charged < 2.2 and 1.8 < tokens < 2.2
