"""flows.runner helpers that need no model: the light-stage memory probe and engine statistics."""

from __future__ import annotations

import numpy as np

from flows.runner import PeakRSS
from pipeline.engines.base import EngineStats, Generation, Sample
from pipeline.engines.transformers_engine import TransformersEngine


def test_peak_rss_sees_memory_allocated_and_freed_inside_the_block():
    with PeakRSS(interval_s=0.01) as base:
        pass
    with PeakRSS(interval_s=0.01) as mem:
        block = np.ones(400 * 2**20 // 8)  # 400 MiB, touched
        import time

        time.sleep(0.2)
        del block
    assert base.peak_mb is not None and mem.peak_mb is not None
    assert mem.peak_mb - base.peak_mb > 300


def test_engine_stats_count_scheduled_cached_and_computed_prompt_tokens():
    """Two requests with prompts of 10 and 6 tokens, n=3 samples each: 48 prompt tokens scheduled.
    Without engine counters the cached part comes from the generations (4 + 0)."""
    eng = TransformersEngine.__new__(TransformersEngine)
    eng.stats = EngineStats()
    gens = [Generation(list(range(10)), [Sample("a", [1, 2], None, "stop")] * 3, cached_prompt_tokens=4),
            Generation(list(range(6)), [Sample("b", [1], None, "stop")] * 3)]
    eng._account(gens, 2.0)
    d = eng.stats.as_dict()
    assert (d["prompt_tokens"], d["scheduled_prompt_tokens"], d["cached_prompt_tokens"]) == (16, 48, 4)
    assert d["prompt_tokens_computed"] == 44 and d["generated_tokens"] == 9 and d["generated_tokens_per_s"] == 4.5
    # an engine's own counters (vLLM: every one of the n samples counted) take precedence
    eng._account(gens, 1.0, scheduled=48, cached=36)
    d = eng.stats.as_dict()
    assert (d["scheduled_prompt_tokens"], d["cached_prompt_tokens"], d["prompt_tokens_computed"]) == (96, 40, 56)


def test_engine_process_env_preloads_tcmalloc_before_what_was_there(monkeypatch, tmp_path):
    import sys

    from pipeline.engines import base as engines

    lib = tmp_path / "lib" / "capo-preload" / engines.TCMALLOC_NAME
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(engines, "has_cuda", lambda: False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    monkeypatch.delenv("CAPO_NO_PRELOAD", raising=False)
    assert engines.engine_process_env() == {"LD_PRELOAD": f"{lib}:/opt/other.so"}
    monkeypatch.setenv("LD_PRELOAD", f"{lib}")
    assert engines.engine_process_env() == {}  # already there
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv("CAPO_NO_PRELOAD", "1")
    assert engines.engine_process_env() == {}
    monkeypatch.delenv("CAPO_NO_PRELOAD")
    monkeypatch.setattr(engines, "has_cuda", lambda: True)
    assert engines.engine_process_env() == {}  # GPU machines: nothing


def test_stream_child_adds_env_and_returns_the_result_line(tmp_path):
    import logging
    import sys

    from flows.children import stream_child
    from pipeline.stages.base import RESULT_TAG

    code = ("import os, json; print('hello'); "
            f"print({RESULT_TAG!r} + json.dumps({{'x': os.environ['CAPO_TEST_X'], 'child': os.environ['CAPO_CHILD']}}))")
    out = stream_child([sys.executable, "-c", code], "t", logging.getLogger("t"), "test child", {"CAPO_TEST_X": "42"})
    assert out == {"x": "42", "child": "1"}
