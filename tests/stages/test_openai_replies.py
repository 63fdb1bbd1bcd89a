"""The OpenAI engine against a real local HTTP server that misbehaves on purpose (issue 15,
item 4): 429 and 5xx are retried (Retry-After honoured), every reply is validated (JSON, a
``choices`` list of exactly n, each with its text), and a request that keeps failing raises an
error naming the request and the endpoint. A real vLLM server: tests/slow/test_openai_engine.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.config import OpenAIEngineConfig, SamplingConfig
from pipeline.engines.openai_engine import EngineReplyError, OpenAIEngine, parse_reply


def _reply(n: int, text: str = "Step 0: correct\nWrong step list: []") -> dict:
    return {"choices": [{"index": i, "message": {"content": f"{text} #{i}"}, "finish_reason": "stop",
                         "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}} for i in range(n)],
            "usage": {"prompt_tokens": 7}}


@pytest.fixture
def server():
    """A server answering from a script: each POST pops the next (status, body, headers)."""
    script: list[tuple[int, bytes, dict]] = []
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            seen.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            status, body, headers = script.pop(0) if script else (500, b"script exhausted", {})
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", script, seen
    httpd.shutdown()


def _engine(url: str, retries: int = 3) -> OpenAIEngine:
    return OpenAIEngine("critic", OpenAIEngineConfig(base_url=url, max_retries=retries, max_concurrency=1, timeout_s=10))


SAMPLING = SamplingConfig(temperature=0.7, top_p=0.95, max_tokens=32)


def test_429_and_5xx_are_retried_then_the_reply_is_used(server, monkeypatch):
    url, script, seen = server
    waits = []
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", waits.append)
    script += [(429, b"slow down", {"retry-after": "3"}), (503, b"busy", {}), (200, json.dumps(_reply(2)).encode(), {})]
    (gen,) = _engine(url).generate([[{"role": "user", "content": "judge"}]], 2, SAMPLING)
    assert [s.text for s in gen.samples] == ["Step 0: correct\nWrong step list: [] #0", "Step 0: correct\nWrong step list: [] #1"]
    assert gen.samples[0].logprobs == [-0.5, -0.25] and len(gen.prompt_token_ids) == 7
    assert waits == [3.0, 2.0] and len(seen) == 3 and seen[0]["n"] == 2  # Retry-After honoured, then backoff


@pytest.mark.parametrize("body,why", [
    (b"<html>bad gateway</html>", "not JSON"),
    (json.dumps({"error": "x"}).encode(), "no 'choices' list"),
    (json.dumps(_reply(1)).encode(), "asked for n=2 samples, the reply has 1"),
    (json.dumps({"choices": [{"index": 0}, {"index": 1}]}).encode(), "a choice is malformed"),
])
def test_a_malformed_reply_is_retried_and_finally_named(server, monkeypatch, body, why):
    url, script, _ = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)
    script += [(200, body, {})] * 2
    with pytest.raises(EngineReplyError, match=rf"request 0 \(http://127.0.0.1:\d+/v1/chat/completions, model 'critic'\): .*{why}"):
        _engine(url, retries=1).generate([[{"role": "user", "content": "judge"}]], 2, SAMPLING)
    assert script == []  # both attempts were made


def test_a_client_error_is_not_retried(server, monkeypatch):
    url, script, seen = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: pytest.fail("no retry on 400"))
    script += [(400, b'{"error": "max_tokens too large"}', {})]
    with pytest.raises(EngineReplyError, match=r"HTTP 400 .*max_tokens too large"):
        _engine(url).generate([[{"role": "user", "content": "judge"}]], 2, SAMPLING)
    assert len(seen) == 1


def test_parse_reply_keeps_index_order_and_reads_null_text_as_empty():
    body = {"choices": [{"index": 1, "message": {"content": None}, "finish_reason": "length"},
                        {"index": 0, "message": {"content": "a"}, "finish_reason": "stop"}]}
    gen = parse_reply(json.dumps(body).encode(), 2)
    assert [(s.text, s.finish_reason) for s in gen.samples] == [("a", "stop"), ("", "length")]


def test_a_failed_request_keeps_the_shards_finished_replies(server, monkeypatch, tmp_path):
    """Issue 15 item 4: with a reply cache (the critique stage gives one per shard), a request
    that fails after its retries costs only itself: the others' replies are kept and a second run
    sends just the failed request."""
    url, script, seen = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)
    convs = [[{"role": "user", "content": f"judge solution {k}"}] for k in range(3)]
    ok = [(200, json.dumps(_reply(2, f"verdict {k}")).encode(), {}) for k in range(3)]
    script += [ok[0], (400, b'{"error": "context too long"}', {}), ok[2]]
    eng = _engine(url)
    eng.reply_cache = tmp_path / ".part-00000.replies.jsonl"
    with pytest.raises(EngineReplyError, match=r"1 of 3 requests failed after their retries \(the 2 finished replies are "
                                               r"kept in .*part-00000\.replies\.jsonl; running the stage again sends only "
                                               r"the failed requests\); first failure: request 1 .*context too long"):
        eng.generate(convs, 2, SAMPLING)
    assert len(seen) == 3
    script += [ok[1]]
    again = _engine(url)
    again.reply_cache = eng.reply_cache
    gens = again.generate(convs, 2, SAMPLING)
    assert len(seen) == 4 and seen[3]["messages"] == convs[1]  # only the failed request was sent again
    assert [g.samples[0].text for g in gens] == [f"verdict {k} #0" for k in range(3)]
    assert gens[0].samples[0].logprobs == [-0.5, -0.25] and len(gens[2].prompt_token_ids) == 7
    # another sampling setting is another request: the cache answers nothing
    script += ok
    other = _engine(url)
    other.reply_cache = eng.reply_cache
    other.generate(convs[:1], 2, SamplingConfig(temperature=0.5, top_p=0.95, max_tokens=32))
    assert len(seen) == 5


def test_the_critique_stage_resumes_a_shard_from_its_kept_replies(server, monkeypatch, tmp_path):
    """The critique stage through the OpenAI engine on the hand-built round: one shard of two
    rollouts, the second request fails; the stage fails, the first reply is kept beside the shard;
    run again, it sends one request, commits the critiques and removes the kept replies."""
    from pipeline.stages.critique import critique_parts_dir, critique_stage
    from tests.toy_round import toy_config, write_round

    url, script, seen = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)
    cfg = toy_config(tmp_path, "critique.engine.type=openai", f"critique.engine.base_url={url}",
                     "critique.engine.max_retries=0", "critique.engine.max_concurrency=1", "critique.critic=served-critic",
                     "critique.num_critiques=2", "critique.batch_rollouts=2")
    write_round(cfg)
    critiques = tmp_path / "runs" / "toy" / "round_001" / "critiques.parquet"
    critiques.unlink()  # the hand-written table: the stage computes its own
    script += [(200, json.dumps(_reply(2, "Step 0: correct\nStep 1: wrong - no\nStep 2: correct\nWrong step list: [1]")).encode(), {}),
               (503, b"overloaded", {})]
    with pytest.raises(Exception, match=r"1 of 2 requests failed after their retries \(the 1 finished replies are kept"):
        critique_stage(cfg, 1)
    kept = critique_parts_dir(cfg, 1) / ".part-00000.replies.jsonl"
    assert kept.is_file() and len(seen) == 2
    script += [(200, json.dumps(_reply(2, "Step 0: correct\nStep 1: correct\nStep 2: correct\nWrong step list: []")).encode(), {})]
    res = critique_stage(cfg, 1)
    assert not res.skipped and len(seen) == 3 and not kept.exists()
    import pyarrow.parquet as pq

    rows = pq.read_table(critiques).to_pylist()
    assert len(rows) == 4 and sorted({r["rollout_id"] for r in rows}) == ["A", "B"]
    # rollout A's two critiques are the kept first reply, B's the one sent again
    assert {r["rollout_id"]: "Wrong step list: [1]" in r["raw_text"] for r in rows} == {"A": True, "B": False}
