"""minivllm: a compact, complete LLM serving engine built for teaching.

    from minivllm import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)
"""

from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
]
__version__ = "0.1.0"
