"""bench/soak.py's arithmetic: the warm-up is dropped and each role's RSS is fitted against the version."""

from __future__ import annotations

import math

from bench.soak import analyse, fit_slope, rss_mb


def test_fit_slope_by_hand():
    # ys = 2 x + 1 exactly: slope 2; one x only: undefined
    assert fit_slope([0, 1, 2, 3], [1, 3, 5, 7]) == 2.0
    assert math.isnan(fit_slope([5, 5], [1, 2]))


def test_analyse_drops_the_warm_up_and_fits_per_role():
    """An actor that grows 1 MB per 1,000 versions after a 100 MB warm-up jump, a flat learner; the
    driver's pid changes once (a restart) and is reported."""
    samples = []
    for i in range(100):
        version = 10 * i
        actor = 400.0 + (100.0 if i >= 10 else 0.0) + version / 1000
        samples.append({"t": 1000.0 + 6 * i, "version": version, "rss": {"actor0": actor, "learner0": 500.0},
                        "pids": {"actor0": 7, "learner0": 8 if i < 50 else 9}})
    result = analyse(samples, warmup=0.25)
    assert result["rss_mb_per_1k_versions"]["actor0"] == 1.0
    assert result["rss_mb_per_1k_versions"]["learner0"] == 0.0
    assert result["rss_mb_start"]["actor0"] == round(500.25, 1)  # the first sample after the warm-up: version 250
    assert result["versions"] == 990 and result["restarted_roles"] == ["learner0"]
    assert len(result["series"]["rows"]) == 100


def test_rss_of_a_live_and_a_gone_process():
    import os

    assert rss_mb(os.getpid()) > 1
    assert rss_mb(2**22 + 12345) is None


def test_analyse_drops_the_samples_before_warmup_versions_too():
    """A 4 MB step at version 600, past the time warm-up (version 250): fitted, the step makes a slope;
    with warmup_versions 700 the fit starts after it and the flat role reads 0."""
    samples = [{"t": 1000.0 + 6 * i, "version": 10 * i, "rss": {"actor0": 500.0 + (4.0 if i >= 60 else 0.0)},
                "pids": {"actor0": 7}} for i in range(100)]
    assert analyse(samples, warmup=0.25)["rss_mb_per_1k_versions"]["actor0"] > 1
    result = analyse(samples, warmup=0.25, warmup_versions=700)
    assert result["rss_mb_per_1k_versions"]["actor0"] == 0.0 and result["rss_mb_start"]["actor0"] == 504.0
    assert result["peak_rss_mb_per_1k_versions"]["actor0"] == 0.0
    assert result["samples_fitted"] == 30
