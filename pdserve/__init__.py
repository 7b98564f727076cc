"""pdserve: disaggregated prefill/decode LLM serving."""

from pdserve.engine.engine import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]
