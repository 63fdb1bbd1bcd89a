"""The OpenAI engine against a real local HTTP server that misbehaves on purpose:
429 and 5xx are retried (Retry-After honoured), every reply is validated (JSON, a
``choices`` list of exactly n, each with its text), and a request that keeps failing raises an
error naming the request and the endpoint. A real vLLM server: tests/slow/test_openai_engine.py."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.config import OpenAIEngineConfig, SamplingConfig
from pipeline.engines.openai_engine import EngineReplyError, OpenAIEngine, parse_reply


def _reply(n: int, text: str = "Step 0: correct\nWrong step list: []") -> dict:
    return {"choices": [{"index": i, "message": {"content": f"{text} #{i}"}, "finish_reason": "stop",
                         "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}} for i in range(n)],
            "usage": {"prompt_tokens": 7}}


def _serve(respond):
    """A local HTTP server whose every POST is answered by ``respond(request_json)`` ->
    ``(status, body, headers)``; yields its ``/v1`` base URL and shuts down after the test."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            status, body, headers = respond(json.loads(self.rfile.read(int(self.headers["content-length"]))))
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
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()


@pytest.fixture
def server():
    """A server answering from a script: each POST pops the next (status, body, headers)."""
    script: list[tuple[int, bytes, dict]] = []
    seen: list[dict] = []

    def respond(req: dict) -> tuple[int, bytes, dict]:
        seen.append(req)
        return script.pop(0) if script else (500, b"script exhausted", {})

    for url in _serve(respond):
        yield url, script, seen


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
])
def test_a_body_that_is_not_a_chat_completion_is_retried_and_finally_named(server, monkeypatch, body, why):
    url, script, _ = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)
    script += [(200, body, {})] * 2
    with pytest.raises(EngineReplyError, match=rf"request 0 \(http://127.0.0.1:\d+/v1/chat/completions, model 'critic'\): .*{why}"):
        _engine(url, retries=1).generate([[{"role": "user", "content": "judge"}]], 2, SAMPLING)
    assert script == []  # both attempts were made


def _malformed(body: dict) -> bytes:
    return json.dumps(body).encode()


@pytest.mark.parametrize("body,why", [
    (_malformed(_reply(1)), "asked for n=2 samples, the reply has 1"),
    (_malformed({"choices": [{"index": 0}, {"index": 1}]}), r"a choice is malformed \(KeyError: 'message'\)"),
    (_malformed({"choices": [{"index": i, "message": {"content": [{"type": "text", "text": "hi"}]}} for i in range(2)]}),
     "message content is list"),
    (_malformed({**_reply(2), "usage": {"prompt_tokens": "seven"}}), "usage.prompt_tokens is not a number"),
])
def test_a_reply_that_stays_malformed_is_recorded_as_data(server, monkeypatch, tmp_path, body, why):
    """A chat completion whose choices stay malformed after the retries is the judge's output: the
    request's n samples come back empty and marked (why, and an excerpt of the body), counted in
    the stats, and not kept in the reply cache (a later run asks again). Only for a critic
    (``malformed_as_data``): a policy's engine still fails the request."""
    url, script, seen = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)
    script += [(200, body, {})] * 2 + [(200, json.dumps(_reply(2)).encode(), {})]
    eng = _engine(url, retries=1)
    eng.reply_cache, eng.malformed_as_data = tmp_path / "replies.jsonl", True  # as the critique stages set it
    bad, good = eng.generate([[{"role": "user", "content": "judge"}], [{"role": "user", "content": "other"}]], 2, SAMPLING)
    assert len(seen) == 3 and script == []  # both attempts were made, then the next request
    assert [s.text for s in bad.samples] == ["", ""] and all(s.malformed for s in bad.samples)
    assert re.search(why, bad.samples[0].malformed) and body.decode()[:100] in bad.samples[0].malformed
    assert bad.samples[0].malformed.startswith("[malformed reply after 2 attempts] request 0 (")
    assert [s.malformed for s in good.samples] == [None, None] and good.samples[0].text.startswith("Step 0")
    assert eng.stats.as_dict()["malformed_replies"] == 1
    assert len(eng.reply_cache.read_text().splitlines()) == 1  # the good reply only
    script += [(200, body, {})] * 2  # a policy's engine (rollouts, eval) still fails the request
    with pytest.raises(EngineReplyError, match=why):
        _engine(url, retries=1).generate([[{"role": "user", "content": "judge"}]], 2, SAMPLING)


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
    """With a reply cache (the critique stage gives one per shard), a request
    that still fails after its retries costs only itself: the others' replies are kept and a
    second run sends just the failed request; the result equals a clean run's."""
    url, script, seen = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)
    convs = [[{"role": "user", "content": f"judge solution {k}"}] for k in range(3)]
    ok = [(200, json.dumps(_reply(2, f"verdict {k}")).encode(), {}) for k in range(3)]
    script += [ok[0], *[(503, b"overloaded", {})] * 4, ok[2]]  # request 1: the first try and 3 retries fail
    eng = _engine(url)
    eng.reply_cache = tmp_path / ".part-00000.replies.jsonl"
    with pytest.raises(EngineReplyError, match=r"1 of 3 requests failed after their retries \(request 1; the 2 finished "
                                               r"replies are kept in .*part-00000\.replies\.jsonl; running the stage again "
                                               r"sends only the failed requests\); first failure: request 1 .*HTTP 503") as e:
        eng.generate(convs, 2, SAMPLING)
    assert (e.value.failed, e.value.kept) == ([1], 2) and len(seen) == 6 and script == []
    script += [ok[1]]
    again = _engine(url)
    again.reply_cache = eng.reply_cache
    gens = again.generate(convs, 2, SAMPLING)
    assert len(seen) == 7 and seen[6]["messages"] == convs[1]  # only the failed request was sent again
    assert again.stats.requests == 1  # the stats count what was sent
    script += ok
    clean = _engine(url).generate(convs, 2, SAMPLING)  # no cache: all three sent
    assert len(seen) == 10 and gens == clean
    assert [g.samples[0].text for g in gens] == [f"verdict {k} #0" for k in range(3)]
    # another sampling setting is another request: the cache answers nothing
    script += ok
    other = _engine(url)
    other.reply_cache = eng.reply_cache
    other.generate(convs[:1], 2, SamplingConfig(temperature=0.5, top_p=0.95, max_tokens=32))
    assert len(seen) == 11


@pytest.fixture
def judge_server():
    """A server that answers by the request's text, so that concurrent requests may come in any
    order: ``failing`` holds the texts answered 503; ``hits`` counts the requests per text."""
    failing: set[str] = set()
    hits: dict[str, int] = {}
    lock = threading.Lock()

    def respond(req: dict) -> tuple[int, bytes, dict]:
        text = req["messages"][-1]["content"]
        with lock:
            hits[text] = hits.get(text, 0) + 1
        if text in failing:
            return 503, b"overloaded", {}
        return 200, json.dumps(_reply(2, f"verdict on {text}")).encode(), {}

    for url in _serve(respond):
        yield url, failing, hits


def test_concurrent_requests_keep_every_finished_reply_and_name_every_failure(judge_server, monkeypatch, tmp_path):
    """Six requests, four at a time; two fail on every try. Both are named, the four others kept
    (the cache file has four lines); the re-run sends the two and equals a clean run. A torn last
    line (a kill while appending) is skipped and the next reply still lands."""
    url, failing, hits = judge_server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)
    texts = [f"solution {k}" for k in range(6)]
    convs = [[{"role": "system", "content": "be a judge"}, {"role": "user", "content": t}] for t in texts]
    cache = tmp_path / "parts" / ".part-00003.replies.jsonl"

    def engine() -> OpenAIEngine:
        eng = OpenAIEngine("critic", OpenAIEngineConfig(base_url=url, max_retries=2, max_concurrency=4, timeout_s=10))
        eng.reply_cache = cache
        return eng

    failing |= {texts[2], texts[5]}
    with pytest.raises(EngineReplyError, match=r"2 of 6 requests failed after their retries \(requests 2, 5; the 4 "
                                               r"finished replies are kept in .*; first failure: request 2 "):
        engine().generate(convs, 2, SAMPLING)
    assert hits == {t: 3 if t in failing else 1 for t in texts}  # each failure tried 3 times, the others once
    assert len(cache.read_text().splitlines()) == 4
    with open(cache, "a") as f:
        f.write('{"key": "torn-by-a-kill", "generation": {"prompt_')
    failing.clear()
    gens = engine().generate(convs, 2, SAMPLING)
    assert hits == {t: 4 if t in (texts[2], texts[5]) else 1 for t in texts}  # only the two failed ones again
    assert len([ln for ln in cache.read_text().splitlines() if ln.startswith('{"key": "')]) == 7  # 4 + torn + 2
    clean = OpenAIEngine("critic", OpenAIEngineConfig(base_url=url, max_concurrency=4, timeout_s=10)).generate(convs, 2, SAMPLING)
    assert gens == clean and [g.samples[1].text for g in gens] == [f"verdict on {t} #1" for t in texts]
    assert engine().generate(convs, 2, SAMPLING) == clean and sum(hits.values()) == 12 + 6  # all six from the cache


def test_the_critique_stage_resumes_a_shard_from_its_kept_replies(server, monkeypatch, tmp_path):
    """The critique stage through the OpenAI engine on the hand-built round: one shard of two
    rollouts, the second request fails; the stage fails naming the shard and rollout, the first
    reply is kept beside the shard; run again, it sends one request, commits the critiques and
    removes the kept replies; the table equals that of a run that never failed."""
    import pyarrow.parquet as pq

    from pipeline.stages.critique import critique_parts_dir, critique_stage
    from tests.toy_round import toy_config, write_round

    url, script, seen = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)

    def round_at(root):
        root.mkdir()
        cfg = toy_config(root, "critique.engine.type=openai", f"critique.engine.base_url={url}",
                         "critique.engine.max_retries=0", "critique.engine.max_concurrency=1",
                         "critique.critic=served-critic", "critique.num_critiques=2", "critique.batch_rollouts=2")
        write_round(cfg)
        table = root / "runs" / "toy" / "round_001" / "critiques.parquet"
        table.unlink()  # the hand-written table: the stage computes its own
        return cfg, table

    reply_a = (200, json.dumps(_reply(2, "Step 0: correct\nStep 1: wrong - no\nStep 2: correct\nWrong step list: [1]")).encode(), {})
    reply_b = (200, json.dumps(_reply(2, "Step 0: correct\nStep 1: correct\nStep 2: correct\nWrong step list: []")).encode(), {})
    cfg, critiques = round_at(tmp_path / "failed")
    script += [reply_a, (503, b"overloaded", {})]
    with pytest.raises(EngineReplyError, match=r"critique shard 0 of round 1: the critic failed on rollout B: 1 of 2 "
                                               r"requests failed after their retries \(request 1; the 1 finished replies "
                                               r"are kept .*running the stage again sends only the failed requests"):
        critique_stage(cfg, 1)
    kept = critique_parts_dir(cfg, 1) / ".part-00000.replies.jsonl"
    assert kept.is_file() and len(seen) == 2 and not critiques.exists()
    script += [reply_b]
    res = critique_stage(cfg, 1)
    assert not res.skipped and len(seen) == 3 and not kept.exists()
    every = pq.read_table(critiques).to_pylist()
    rows = [r for r in every if r["source"] == "llm"]  # beside one arithmetic check per rollout
    assert len(rows) == 4 and len(every) == 6 and sorted({r["rollout_id"] for r in rows}) == ["A", "B"]
    # rollout A's two critiques are the kept first reply, B's the one sent again
    assert {r["rollout_id"]: "Wrong step list: [1]" in r["raw_text"] for r in rows} == {"A": True, "B": False}
    # the same round with a server that never fails: the same table
    clean_cfg, clean_table = round_at(tmp_path / "clean")
    script += [reply_a, reply_b]
    critique_stage(clean_cfg, 1)
    assert len(seen) == 5 and pq.read_table(clean_table).to_pylist() == every


def test_a_constraint_is_sent_as_vllms_structured_outputs_and_a_refusal_says_so(server, monkeypatch):
    from pipeline.core.critique import critique_regex

    url, script, seen = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: pytest.fail("no retry on 400"))
    conv = [{"role": "user", "content": "judge"}]
    script += [(200, json.dumps(_reply(2)).encode(), {}), (200, json.dumps(_reply(2)).encode(), {})]
    _engine(url).generate([conv, conv], 2, SAMPLING, constraints=[critique_regex(1), None])
    assert seen[0]["structured_outputs"] == {"regex": critique_regex(1)} and "structured_outputs" not in seen[1]
    # a server without vLLM's structured outputs (OpenAI itself, say) refuses the unknown field
    script += [(400, b'{"error": "Unrecognized request argument supplied: structured_outputs"}', {})]
    with pytest.raises(EngineReplyError, match=r"HTTP 400 .*structured_outputs.*critique.structured_output=false"):
        _engine(url).generate([conv], 2, SAMPLING, constraints=[critique_regex(1)])
    with pytest.raises(ValueError, match="2 constraints for 1 conversations"):
        _engine(url).generate([conv], 2, SAMPLING, constraints=[None, None])


def test_a_constrained_request_is_another_request_in_the_reply_cache():
    eng = OpenAIEngine("critic", OpenAIEngineConfig(base_url="http://127.0.0.1:1/v1"))
    conv = [{"role": "user", "content": "judge"}]
    free = eng.request_key(conv, 2, SAMPLING, 0)
    assert eng.request_key(conv, 2, SAMPLING, 0, None) == free  # free-text keys as before the option
    assert eng.request_key(conv, 2, SAMPLING, 0, "Step 0: correct\\nWrong step list: \\[\\]") != free


def _processbench_eval(tmp_path, url: str, data_dir, n_items: int = 3):
    """A critic-eval of ``n_items`` hand-made ProcessBench items, one setup: a served critic at ``url``."""
    from critic_eval import stages as ces

    items = [{"id": f"q{i}", "problem": f"Problem number {i}?", "steps": ["a", "b"], "label": -1,
              "step_labels": [0, 0]} for i in range(n_items)]
    bench = tmp_path / "pb.jsonl"
    bench.write_text("\n".join(json.dumps(it) for it in items))
    conf = tmp_path / "ce.yaml"
    conf.write_text(json.dumps({
        "name": "served", "runs_dir": str(tmp_path / "runs"), "benchmark": {"source": str(bench)},
        "critics": [{"name": "served", "model": "served-critic",
                     "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 32},
                     "engine": {"type": "openai", "base_url": url, "max_retries": 0, "max_concurrency": 1}}],
        "include_gold_answer": [False], "n_values": [1, 2]}))
    cfg = ces.load_eval_config(conf, [f"data_dir={data_dir}"])
    ces.benchmark_stage(cfg)
    return cfg


def test_critic_eval_keeps_a_served_critics_replies_across_a_failed_request(judge_server, monkeypatch, tmp_path, data_dir):
    """critic-eval through the OpenAI engine: one of three requests fails; the other two replies are
    kept beside the critiques table, the run again sends only the failed one, the kept file is
    removed once the table is written, and tokens per item count the log-probs (no token ids in
    the OpenAI API)."""
    import pyarrow.parquet as pq

    from critic_eval import stages as ces
    from pipeline.core.critique import build_critique_messages

    url, failing, hits = judge_server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)
    cfg = _processbench_eval(tmp_path, url, data_dir)
    (setup,) = cfg.setups()
    texts = {it["id"]: build_critique_messages(it["problem"], it["steps"], None)[-1]["content"]
             for it in ces.read_benchmark(cfg)}
    failing.add(texts["q1"])
    with pytest.raises(EngineReplyError, match=r"1 of 3 requests failed .*the 2 finished replies are kept"):
        ces.critique_stage(cfg, setup)
    kept = ces.replies_path(cfg, setup)
    assert kept.is_file() and len(kept.read_text().splitlines()) == 2
    failing.clear()
    res = ces.critique_stage(cfg, setup)
    assert not res.skipped and hits == {texts["q0"]: 1, texts["q1"]: 2, texts["q2"]: 1}  # only q1 sent again
    assert not kept.exists()
    rows = pq.read_table(res.path).to_pylist()
    assert len(rows) == 3 * 2 and {r["item_id"] for r in rows} == {"q0", "q1", "q2"}


def test_critic_eval_counts_a_served_critics_tokens_by_its_logprobs(judge_server, monkeypatch, tmp_path, data_dir):
    """The OpenAI API returns no token ids: a served critic's tokens are its per-token log-probs
    (as in training's critiques), so tokens/item and s/item are not 0 for it."""
    import pyarrow.parquet as pq

    from critic_eval import stages as ces

    url, _, _ = judge_server
    cfg = _processbench_eval(tmp_path, url, data_dir)
    (setup,) = cfg.setups()
    rows = pq.read_table(ces.critique_stage(cfg, setup).path).to_pylist()
    assert [r["critic_tokens"] for r in rows] == [2] * 6  # the two log-probs of each reply (_reply)
    ces.score_stage(cfg)
    scores = pq.read_table(cfg.run_dir() / "scores.parquet").to_pylist()
    assert {s["critic_tokens_per_item"] for s in scores if s["subset"] == "all"} == {2.0, 4.0}  # N = 1, 2


def test_the_critique_stage_records_a_malformed_reply_and_the_vote_does_not_count_it(server, monkeypatch, tmp_path):
    """A served critic whose reply for rollout A stays malformed (one choice of two): the stage
    commits the round's critiques, A's two rows read ``malformed_reply`` with the body's excerpt as
    raw text, the manifest counts them as parse failures, and the vote counts no valid critique of A."""
    import pyarrow.parquet as pq

    from pipeline import storage
    from pipeline.stages.base import round_paths
    from pipeline.stages.critique import critique_stage
    from pipeline.stages.vote import vote_stage
    from tests.toy_round import toy_config, write_round

    url, script, seen = server
    monkeypatch.setattr("pipeline.engines.openai_engine.time.sleep", lambda s: None)
    cfg = toy_config(tmp_path, "critique.engine.type=openai", f"critique.engine.base_url={url}",
                     "critique.engine.max_retries=1", "critique.engine.max_concurrency=1",
                     "critique.critic=served-critic", "critique.num_critiques=2", "critique.batch_rollouts=2")
    write_round(cfg)
    critiques = round_paths(cfg, 1)["critiques"]
    critiques.unlink()  # the hand-written table: the stage computes its own
    one_choice = json.dumps(_reply(1, "Wrong step list: [0]")).encode()
    script += [(200, one_choice, {})] * 2
    script += [(200, json.dumps(_reply(2, "Step 0: correct\nStep 1: wrong - no\nStep 2: correct\nWrong step list: [1]\n")).encode(), {})]
    critique_stage(cfg, 1)
    assert len(seen) == 3 and script == []
    rows = [r for r in pq.read_table(critiques).to_pylist() if r["source"] == "llm"]
    by = {(r["rollout_id"], r["critique_idx"]): r for r in rows}
    for k in (0, 1):
        a = by[("A", k)]
        assert a["parse_status"] == "malformed_reply" and a["wrong_steps"] is None and a["critic_tokens"] == 0
        assert "asked for n=2 samples, the reply has 1" in a["raw_text"] and "Wrong step list: [0] #0" in a["raw_text"]
        assert by[("B", k)]["parse_status"] == "complete"
    man = storage.read_manifest(critiques)
    assert man["engine"]["malformed_replies"] == 1 and man["statuses"]["malformed_reply"] == 2 and man["parse_failures"] == 2
    vote_stage(cfg, 1)
    verdicts = pq.read_table(round_paths(cfg, 1)["step_verdicts"]).to_pylist()
    assert {r["n_valid"] for r in verdicts if r["rollout_id"] == "A"} == {0}  # no vote from a malformed reply
    assert {r["llm_weight"] for r in verdicts if r["rollout_id"] == "A"} == {0.0}
    assert {r["n_valid"] for r in verdicts if r["rollout_id"] == "B"} == {2}


def test_critic_eval_records_a_malformed_reply_as_a_parse_failure(server, monkeypatch, tmp_path, data_dir):
    import pyarrow.parquet as pq

    from critic_eval import stages as ces

    url, script, seen = server
    cfg = _processbench_eval(tmp_path, url, data_dir)
    (setup,) = cfg.setups()
    good = (200, json.dumps(_reply(2, "Step 0: correct\nStep 1: correct\nWrong step list: []\n")).encode(), {})
    script += [(200, json.dumps(_reply(1)).encode(), {}), good, good]
    rows = pq.read_table(ces.critique_stage(cfg, setup).path).to_pylist()
    assert [(r["item_id"], r["parse_status"]) for r in rows] == [
        ("q0", "malformed_reply"), ("q0", "malformed_reply"), ("q1", "complete"), ("q1", "complete"),
        ("q2", "complete"), ("q2", "complete")]
    assert "the reply has 1" in rows[0]["raw_text"] and rows[0]["critic_tokens"] == 0
    ces.score_stage(cfg)
    (s,) = [s for s in pq.read_table(cfg.run_dir() / "scores.parquet").to_pylist()
            if (s["subset"], s["rule"], s["n"]) == ("all", "majority", 2) and s["setup"].endswith("/list")]
    assert s["parse_failure_rate"] == pytest.approx(1 / 3)
