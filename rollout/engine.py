"""Former home of the vLLM engine; the engines now live in :mod:`rollout.engines`. Kept for imports."""

from rollout.engines import Completion, Engine, PromptResult, VLLMEngine, cpu_engine_env, make_engine

__all__ = ["Completion", "Engine", "PromptResult", "VLLMEngine", "cpu_engine_env", "make_engine"]
