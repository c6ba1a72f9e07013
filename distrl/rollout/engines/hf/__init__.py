"""The transformers engine (``--engine hf``), for machines without vLLM, and the samplers it runs.

- :mod:`.engine`: :class:`HFEngine`, the :class:`distrl.rollout.engines.base.Engine` on a transformers model
  (weight loads by version, the eager sampling loop).
- :mod:`.continuous`: continuous batching (``ContinuousSampler``), each row in a slot refilled as rows end.
- :mod:`.slots`: the continuous sampler's slot state (its buffers, its per-slot KV cache, moving rows).
- :mod:`.static`: static batches over a static KV cache (``StaticSampler``), the fast path on GPU.
- :mod:`.decode`: what both samplers' decode steps share (grouped attention, the fp32 head, the token pick,
  compiling the step and capturing it in a CUDA graph).
- :mod:`.kernels`: the continuous sampler's CUDA kernels (Triton): attention over each slot's own positions,
  the token pick in one pass over the logits.

Importing this package imports torch and transformers; :func:`distrl.rollout.engines.make_engine` imports it
only when ``--engine hf`` is asked for.
"""

from distrl.rollout.engines.hf.engine import HFEngine

__all__ = ["HFEngine"]
