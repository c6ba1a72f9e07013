"""Generation engines behind one interface (:class:`Engine`): vLLM (:mod:`.vllm`) and transformers (:mod:`.hf`).

Importing this package is cheap: a backend imports vLLM or transformers only when it is built.
"""

from rollout.engines.base import ENGINES, FORMATS, Completion, Engine, PromptResult, make_engine
from rollout.engines.vllm import VLLMEngine, cpu_engine_env

__all__ = ["ENGINES", "FORMATS", "Completion", "Engine", "PromptResult", "VLLMEngine", "cpu_engine_env",
           "make_engine"]
