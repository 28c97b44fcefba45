"""expresslane: one LLM served in tiers (ultrafast, default, flex) over the OpenAI API."""

from expresslane.llm import LLM, Output
from expresslane.sampling_params import SamplingParams

__all__ = ["LLM", "Output", "SamplingParams"]
__version__ = "0.1.0"
