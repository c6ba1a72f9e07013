"""bench/gpu_pipeline.py's learner variant names (``pack512+compile+halfmm``) -> settings."""

import pytest

from bench.gpu_pipeline import variant_settings


def test_variant_settings_heads():
    # (pack tokens, checkpointing, compiled, --learner_head)
    assert variant_settings("pack512+compile+halfmm", 2048) == (512, False, True, "halfmm")
    assert variant_settings("packed+ckpt+cce", 2048) == (2048, True, False, "cce")
    assert variant_settings("padded", 2048) == (0, False, False, "chunked")
    assert variant_settings("defaults", 2048) == (0, False, False, "auto")  # distrl train's learner
    assert variant_settings("defaults+compile+halfmm", 2048) == (0, False, True, "halfmm")
    with pytest.raises(ValueError, match="two heads"):
        variant_settings("packed+cce+halfmm", 2048)
    with pytest.raises(ValueError, match="unknown options"):
        variant_settings("packed+fast", 2048)
