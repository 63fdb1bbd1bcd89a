"""The critique browser on the hand-built round: the data it shows (numbers worked by
hand in tests/toy_round.py), the queries it states (run again in the real catalog), escaping of
untrusted model text, and the page used in headless Chromium (filters, a click on a step)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import duckdb
import pytest

from pipeline import storage
from pipeline.browse import build_browser, chromium_executable, collect, headless_chromium
from pipeline.stages.reward import reward_stage
from pipeline.stages.vote import vote_stage
from tests.conftest import require_chromium
from tests.toy_round import toy_config, write_round

EVIL = "</script><img src=x onerror=\"document.title='pwned'\"><b>bold</b> &amp; 'quoted'"


@pytest.fixture
def toy_run(tmp_path, monkeypatch):
    import tests.toy_round as toy

    write = toy.write_rows

    def with_evil_text(cfg, name, rows, stage):  # untrusted model text in a step and in a critique
        for r in rows:
            if name == "steps" and (r["rollout_id"], r["step_idx"]) == ("A", 1):
                r["step_text"] = EVIL
            if name == "critiques" and (r["rollout_id"], r["critique_idx"]) == ("A", 0):
                r["raw_text"] = EVIL
        write(cfg, name, rows, stage)

    monkeypatch.setattr(toy, "write_rows", with_evil_text)
    cfg = toy_config(tmp_path, "vote.rule=intersection", "variant=capo-intersection")
    write_round(cfg)
    vote_stage(cfg, 1)
    reward_stage(cfg, 1)
    return cfg


def test_the_browser_shows_the_round_as_worked_by_hand(toy_run):
    cfg = toy_run
    data = collect(cfg.run_dir(), 1)
    assert data["meta"]["variant"] == "capo-intersection" and data["meta"]["rule"] == "intersection"
    (prompt,) = data["prompts"]
    assert prompt["question"].startswith("Sam has 6 apples") and prompt["gold"] == "5"
    a, b = prompt["responses"]
    assert (a["rollout_id"], a["correct"], b["rollout_id"], b["correct"]) == ("A", True, "B", False)
    # intersection: A's step 1 flagged by 2 of 2 valid critiques -> weight 1; B nothing
    assert [s["n_flagged"] for s in a["steps"]] == [0, 2, 1] and [s["weight"] for s in a["steps"]] == [0, 1, 0]
    assert [s["n_flagged"] for s in b["steps"]] == [1, 1, 0] and [s["weight"] for s in b["steps"]] == [0, 0, 0]
    assert (a["flagged_steps"], b["flagged_steps"]) == (1, 0)
    assert a["split"] and b["split"]  # A's step 2 (1 of 2), B's steps 0 and 1 (1 of 2)
    assert (a["parse_failures"], b["parse_failures"]) == (1, 0)  # A's critique 2 did not parse
    assert [c["idx"] for c in a["critiques"]] == [0, 1, 2] and a["critiques"][1]["wrong"] == [2, 1]
    assert len(a["advantages"]) == 11 and len(b["advantages"]) == 7 and len(a["tokens"]) == 11
    ov = data["overview"]
    assert ov["accuracy"] == 0.5 and ov["steps"] == 6 and ov["flagged_step_rate"] == pytest.approx(1 / 6)
    assert dict(ov["parse_status"]) == {"ok": 4, "no_verdict": 1}
    assert ov["filters"] == {"wrong_unflagged": 1, "right_flagged": 1, "split": 2, "parse_failures": 1}


def test_an_unreadable_table_file_is_named_not_a_crash(toy_run):
    """A truncated or overwritten Parquet file of the run is left out of its view and named on the page."""
    bad = toy_run.run_dir() / "round_001" / "variants" / "capo-intersection" / "eval.parquet"
    bad.write_bytes(b"PAR1x")
    data = collect(toy_run.run_dir(), 1)
    assert [len(p["responses"]) for p in data["prompts"]] == [2]  # the round's own tables still read
    (entry,) = [m for m in data["meta"]["missing_tables"] if m.startswith("eval: ")]
    assert str(bad) in entry and "unreadable" in entry
    assert str(bad) in build_browser(toy_run.run_dir(), 1).read_text()


def test_every_stated_query_runs_unchanged_in_the_catalog(toy_run):
    """What the page says it came from is what ``capo sql`` answers."""
    cfg = toy_run
    data = collect(cfg.run_dir(), 1)
    cat = storage.refresh_catalog(Path(cfg.runs_dir), Path(cfg.data_dir))
    con = duckdb.connect(str(cat), read_only=True)
    try:
        got = {name: con.execute(data["queries"][name]).fetchall()
               for name in ("responses", "steps", "critiques", "token_rewards", "parse_status")}
    finally:
        con.close()
    assert {n: len(rows) for n, rows in got.items()} == {"responses": 2, "steps": 6, "critiques": 5, "token_rewards": 2,
                                                         "parse_status": 2}
    assert [(r[1], r[6]) for r in got["responses"]] == [("A", True), ("B", False)]  # rollout, outcome_correct
    assert [(r[0], r[1]) for r in got["steps"]] == [("A", 0), ("A", 1), ("A", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert sorted((r[0], len(r[2])) for r in got["token_rewards"]) == [("A", 11), ("B", 7)]  # advantages per token
    assert got["parse_status"] == [("ok", 4), ("no_verdict", 1)]


def test_model_text_reaches_the_page_as_data_only(toy_run):
    page = build_browser(toy_run.run_dir(), 1)
    html = page.read_text()
    assert "</script><img" not in html and "<b>bold</b>" not in html
    blob = html.split('id="capo-data">', 1)[1].split("</script>", 1)[0]
    data = json.loads(blob)
    a = data["prompts"][0]["responses"][0]
    assert a["steps"][1]["text"] == EVIL and a["critiques"][0]["raw"] == EVIL  # intact once parsed


def _skip_without_chromium() -> None:
    require_chromium()


def test_a_person_filters_and_opens_the_critiques_of_a_step(toy_run):
    _skip_without_chromium()
    page_path = build_browser(toy_run.run_dir(), 1)
    with headless_chromium() as browser:
        page = browser.new_page()
        dialogs = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(page_path.as_uri())
        assert "ok 4, no_verdict 1" in page.get_by_test_id("parse-status").inner_text()
        assert page.locator(".response:not(.hidden)").count() == 2
        page.get_by_label("wrong answer, nothing flagged").check()
        visible = page.locator(".response:not(.hidden)")
        assert visible.count() == 1 and visible.first.get_attribute("data-rollout") == "B"
        page.get_by_label("right answer, steps flagged").check()
        assert page.locator(".response:not(.hidden)").first.get_attribute("data-rollout") == "A"
        # click A's step 1: its three critiques, the two that list it marked
        page.locator('.response[data-rollout="A"] .step[data-step="1"]').click()
        panel = page.locator('.response[data-rollout="A"] [data-testid="critiques"]')
        assert panel.locator('[data-testid="critique"]').count() == 3
        assert panel.locator(".critique.flags-step").count() == 2
        assert "step 1: flagged by 2 of 3" in panel.inner_text()
        # untrusted text is shown as text: no element was injected, no script ran
        assert page.locator("img").count() == 0 and page.locator("main b").count() == 0
        assert page.locator('.response[data-rollout="A"] .step[data-step="1"]').inner_text().endswith(EVIL)
        assert panel.locator('[data-testid="critique"] pre').first.inner_text() == EVIL
        assert page.title().startswith("CAPO critiques") and dialogs == []
        page.get_by_label("all").check()
        page.fill("#search", "no such text anywhere")
        assert page.locator(".response:not(.hidden)").count() == 0


def test_the_run_report_links_the_browser_of_each_round(toy_run, tmp_path):
    from pipeline.report import write_report

    out = write_report(Path(toy_run.runs_dir), toy_run.run_id)
    page = out["report_html"].read_text()
    href = "../browse/round_001-capo-intersection/index.html"
    assert f"<a href='{href}'>round 1, capo-intersection</a>" in page
    assert (out["report_html"].parent / href).resolve().is_file()
    assert f"[round 1, capo-intersection]({href})" in out["report_md"].read_text()


def test_bad_requests_name_what_would_be_valid(toy_run):
    with pytest.raises(ValueError, match=r"variant 'grpo' is not in .*valid: \['capo-intersection'\]"):
        collect(toy_run.run_dir(), 1, "grpo")
    with pytest.raises(FileNotFoundError, match=r"round_002 does not exist; rounds of .*\['round_001'\]"):
        collect(toy_run.run_dir(), 2)


def test_a_given_folder_with_someone_elses_index_html_is_refused_and_a_browser_folder_rewritten(toy_run, tmp_path):
    mine = tmp_path / "site"
    mine.mkdir()
    (mine / "index.html").write_text("<p>my page</p>")
    with pytest.raises(FileExistsError, match=r"index\.html exists and was not written by `capo browse`"):
        build_browser(toy_run.run_dir(), 1, out=mine)
    assert (mine / "index.html").read_text() == "<p>my page</p>"
    ours = tmp_path / "ours"
    build_browser(toy_run.run_dir(), 1, out=ours)
    page = build_browser(toy_run.run_dir(), 1, out=ours)  # its own page: written again
    assert "<p>my page</p>" not in page.read_text() and (ours / ".capo-browser").exists()


def test_the_same_prompt_in_another_round_is_linked(toy_run):
    """Round 2 made of round 1's tables with round = 2 and the second response now correct: the
    browser of round 2 lists round 1 (1/2 correct, 1 step flagged) and links its page."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipeline.stages.base import round_paths

    cfg = toy_run
    p1, p2 = round_paths(cfg, 1), round_paths(cfg, 2)
    for name in ("rollouts", "outcomes", "steps", "critiques", "step_verdicts", "token_rewards"):
        t = storage.read_table(p1[name], name)
        t = t.set_column(t.schema.get_field_index("round"), "round", pa.array([2] * t.num_rows, pa.int32()))
        if name == "outcomes":
            t = t.set_column(t.schema.get_field_index("outcome_correct"), "outcome_correct",
                             pa.array([True] * t.num_rows))
        storage.write_table(t, p2[name], name, stage="hand", key={"copy": name},
                            extra={"resolved_config": cfg.model_dump(mode="json")} if name == "token_rewards" else None)
    assert pc.all(pc.equal(storage.read_table(p2["outcomes"], "outcomes").column("round"), 2)).as_py()
    build_browser(cfg.run_dir(), 1)
    data = collect(cfg.run_dir(), 2)
    (prompt,) = data["prompts"]
    assert prompt["other_rounds"] == [{"round": 1, "responses": 2, "correct": 1, "flagged_steps": 1}]
    assert data["overview"]["accuracy"] == 1.0
    page = build_browser(cfg.run_dir(), 2)
    _skip_without_chromium()  # skips here (the data is checked above) where Chromium is not installed
    with headless_chromium() as browser:
        tab = browser.new_page()
        tab.goto(page.as_uri())
        link = tab.get_by_test_id("other-rounds").get_by_role("link", name="round 1")
        link.click()
        tab.wait_for_load_state()
        assert tab.url.endswith("/round_001-capo-intersection/index.html#toy-train-00000")
        assert tab.title().startswith("CAPO critiques: toy round 1 ")


def test_a_round_whose_policy_is_gone_shows_tokens_in_the_starting_policys_tokenizer(tmp_path, tiny_model):
    """The policy that sampled a round can be gone (a pruned or moved checkpoint; here the hand-built
    rollouts name a policy ``hand`` that never existed): the token strip decodes the ids with the
    run's starting policy's tokenizer, which every round's checkpoint carries, instead of showing
    bare ids."""
    from transformers import AutoTokenizer

    from tests.toy_round import N_TOK

    cfg = toy_config(tmp_path, f"rollout.policy={tiny_model}", "vote.rule=intersection", "variant=capo-intersection")
    write_round(cfg)
    vote_stage(cfg, 1)
    reward_stage(cfg, 1)
    a = collect(cfg.run_dir(), 1)["prompts"][0]["responses"][0]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = [100 + t for t in range(N_TOK["A"] - 1)] + [2]  # response A's ids in tests/toy_round.py
    assert a["tokens"] == [tok.decode([t]) for t in ids]
    assert not any(t.startswith("#") for t in a["tokens"])


def test_the_tokenizer_fallback_finds_an_embedded_starting_policy_without_converting_it(tmp_path, tiny_model, monkeypatch):
    """With ``rollout.policy`` an embedded name (as on the defaults) the fallback reads the converted
    folder under ``data_dir/models`` and never converts or downloads: ``ensure_model`` is made to
    fail while the browser is built."""
    import pipeline.assets.models as models
    from pipeline.browse import _starting_policy
    from pipeline.config import CAPOConfig

    cfg = toy_config(tmp_path, "rollout.policy=smollm2-135m-instruct", "vote.rule=intersection", "variant=capo-intersection")
    (tmp_path / "data" / "models").mkdir(parents=True)
    (tmp_path / "data" / "models" / "smollm2-135m-instruct").symlink_to(tiny_model)
    write_round(cfg)
    vote_stage(cfg, 1)
    reward_stage(cfg, 1)

    def no_conversion(*a, **k):
        raise AssertionError("the browser must not convert a model")

    monkeypatch.setattr(models, "ensure_model", no_conversion)
    a = collect(cfg.run_dir(), 1)["prompts"][0]["responses"][0]
    assert len(a["tokens"]) == 11 and not any(t.startswith("#") for t in a["tokens"])
    other = CAPOConfig.model_validate({**cfg.model_dump(mode="json"), "data_dir": str(tmp_path / "nowhere")})
    assert _starting_policy(other) is None  # not on disk: no fallback, nothing fetched


def test_each_variant_trained_on_the_same_responses_shows_where_it_puts_credit(toy_run, tmp_path):
    """Other methods retrained on the round's cached responses (here GRPO, DenseR and GRPO-λ beside
    CAPO): the page of one variant shows the others' token credit under each response, as the table
    holds it: their advantages, or for GRPO-λ the credit its traced ratio gives."""
    from pipeline.stages.base import round_paths
    from tests.toy_round import write_rows

    grpo = toy_config(tmp_path, "critique.enabled=false", "reward.estimator=grpo", "reward.process_weight=0",
                      "variant=grpo")
    reward_stage(grpo, 1)
    densr = toy_config(tmp_path, "critique.enabled=false", "reward.estimator=densr", "reward.process_weight=0",
                       "variant=densr")
    write_rows(densr, "token_divergence", [
        {"rollout_id": "A", "prompt_id": "toy-train-00000", "outcome_correct": True, "layer": -1, "n_opposite": 1,
         "divergence": [0.0] * 10 + [1.0]},
        {"rollout_id": "B", "prompt_id": "toy-train-00000", "outcome_correct": False, "layer": -1, "n_opposite": 1,
         "divergence": [0.0] * 6 + [1.0]}], "densr")
    reward_stage(densr, 1)
    lam = toy_config(tmp_path, "critique.enabled=false", "reward.estimator=grpo-lambda", "reward.process_weight=0",
                     "variant=grpo-lambda", "train.ratio_trace={kappa: 0.5, style: recent}")
    reward_stage(lam, 1)
    data = collect(toy_run.run_dir(), 1, "capo-intersection")
    assert data["meta"]["variants"] == ["capo-intersection", "densr", "grpo", "grpo-lambda"]
    a, b = data["prompts"][0]["responses"]
    cfgs = {"grpo": grpo, "densr": densr, "grpo-lambda": lam}
    table = {(r["variant"], r["rollout_id"]): r for c in cfgs.values()
             for r in storage.read_table(round_paths(c, 1)["token_rewards"], "token_rewards").to_pylist()}
    # GRPO-λ's advantage is GRPO's, floored at -0.1; its credit is that advantage traced back:
    # A * (1 - 0.5^(T - j)) / (1 - 0.5), 2x A on the first token, A on the last
    lam_adv = {rid: table["grpo-lambda", rid]["advantages"] for rid in "AB"}
    credit = {rid: [lam_adv[rid][0] * (1 - 0.5 ** (len(lam_adv[rid]) - j)) / 0.5 for j in range(len(lam_adv[rid]))]
              for rid in "AB"}
    assert lam_adv["B"] == pytest.approx([-0.1] * 7)
    for resp, rid in ((a, "A"), (b, "B")):
        (d, dv, dt), (g, gv, gt), (lam_name, lv, lt) = resp["other_advantages"]
        assert (d, dv, dt) == ("densr", table["densr", rid]["advantages"], None)
        assert (g, gv, gt) == ("grpo", table["grpo", rid]["advantages"], None)
        assert lam_name == "grpo-lambda" and lt == "trace" and lv == pytest.approx(credit[rid], rel=1e-5)
    # GRPO: one value per response; DenseR: all of it on the last token (weights 0 x 10, 11 for A)
    assert len(set(table["grpo", "A"]["advantages"])) == 1 and table["densr", "A"]["advantages"][:10] == [0.0] * 10
    assert table["densr", "A"]["advantages"][10] == pytest.approx(11 * table["grpo", "A"]["advantages"][0], rel=1e-5)
    assert collect(toy_run.run_dir(), 1, "grpo")["prompts"][0]["responses"][0]["other_advantages"][0][0] == "capo-intersection"
    own = collect(toy_run.run_dir(), 1, "grpo-lambda")["prompts"][0]["responses"][0]
    assert own["credit"] == pytest.approx(credit["A"], rel=1e-5) and own["advantages"] == lam_adv["A"]
    assert own["credit_kind"] == "trace"
    assert a["credit"] == [] and a["credit_kind"] is None  # CAPO's page: no traced ratio, no credit strip
    lam_page = build_browser(toy_run.run_dir(), 1, "grpo-lambda")
    page = build_browser(toy_run.run_dir(), 1, "capo-intersection")
    html = page.read_text()
    assert "variant &lt;&gt; &#39;capo-intersection&#39;" in html or "variant <> 'capo-intersection'" in html

    # the round's rollouts sampled again: the other variants' advantages are of the old text, left out
    rows = storage.read_table(round_paths(grpo, 1)["rollouts"], "rollouts").to_pylist()
    rows[0]["response_text"] += " "
    write_rows(grpo, "rollouts", [{k: v for k, v in r.items() if k not in ("run_id", "round")} for r in rows], "rollout")
    reward_stage(toy_run, 1)  # CAPO's rewards made again on the new sample
    assert collect(toy_run.run_dir(), 1, "capo-intersection")["prompts"][0]["responses"][0]["other_advantages"] == []
    _skip_without_chromium()
    with headless_chromium() as browser:
        tab = browser.new_page()
        tab.goto(page.as_uri())
        strips = tab.locator('.response[data-rollout="A"] [data-testid="variant-strip"]')
        assert strips.count() == 3 and strips.first.get_attribute("data-variant") == "densr"
        assert strips.first.locator(".strip span").count() == 11
        assert "grpo on the same response" in strips.nth(1).inner_text()
        assert "grpo-lambda on the same response (credit of its traced ratio)" in strips.nth(2).inner_text()
        tab.goto(lam_page.as_uri())
        credit = tab.locator('.response[data-rollout="A"] [data-testid="credit-strip"]')
        assert credit.count() == 1 and credit.locator(".strip span").count() == 11
        assert "credit 1.41" in credit.locator(".strip span").first.get_attribute("title")


def test_fipo_shows_the_credit_its_update_recorded(toy_run, tmp_path):
    """FIPO's weights exist only inside the update, so its page shows the train stage's
    ``token_credit`` (a table written here by hand: each token's credit A * f with f = 1 + 0.01 * t,
    under a key as the train stage writes it, with the checkpoint committed under the same key),
    beside CAPO's page. A table that is not the variant's current update is left out and FIPO shows
    its advantages: one made from an earlier sample of the rollouts, from earlier token rewards, or
    whose checkpoint was never committed under its key (a kill between the two writes)."""
    import pyarrow as pa

    from pipeline.schemas import SCHEMAS
    from pipeline.stages.base import input_fp, round_paths

    fipo = toy_config(tmp_path, "critique.enabled=false", "reward.estimator=fipo", "reward.process_weight=0",
                      "variant=fipo", "train.future_kl={half_life: 32}")
    reward_stage(fipo, 1)
    p = round_paths(fipo, 1)
    adv = {r["rollout_id"]: r["advantages"] for r in storage.read_table(p["token_rewards"], "token_rewards").to_pylist()}
    recorded = {rid: [x * (1 + 0.01 * t) for t, x in enumerate(a)] for rid, a in adv.items()}
    rows = [{"run_id": fipo.run_id, "round": 1, "variant": "fipo", "rollout_id": rid, "credit": c, "passes": 1}
            for rid, c in recorded.items()]
    key = {"rollouts": input_fp(p["rollouts"]), "token_rewards": input_fp(p["token_rewards"]),
           "train": {"future_kl": {"half_life": 32.0}}}
    (p["checkpoint"]).mkdir(parents=True)
    (p["checkpoint"] / "config.json").write_text("{}")

    def update(credit_key: dict, checkpoint_key: dict) -> dict:
        storage.write_table(pa.Table.from_pylist(rows, schema=SCHEMAS["token_credit"]), p["token_credit"],
                            "token_credit", stage="train", key=credit_key)
        storage.commit_manifest(p["checkpoint"], stage="train", key=checkpoint_key, rows=None)
        return collect(toy_run.run_dir(), 1, "fipo")["prompts"][0]["responses"][0]

    own = update(key, key)
    assert own["credit_kind"] == "recorded" and own["credit"] == pytest.approx(recorded["A"], rel=1e-6)
    assert own["advantages"] == adv["A"] and own["credit"][10] == pytest.approx(1.1 * adv["A"][10], rel=1e-6)
    other = collect(toy_run.run_dir(), 1, "capo-intersection")["prompts"][0]["responses"][0]["other_advantages"]
    assert [o[0] for o in other] == ["fipo"] and other[0][2] == "recorded"
    assert other[0][1] == pytest.approx(recorded["A"], rel=1e-6)
    page = build_browser(toy_run.run_dir(), 1, "fipo")
    # the table as the catalog shows it: the page's query run in the real catalog
    con = duckdb.connect(str(storage.refresh_catalog(Path(fipo.runs_dir), Path(fipo.data_dir))), read_only=True)
    try:
        got = con.execute(collect(toy_run.run_dir(), 1, "fipo")["queries"]["token_credit"]).fetchall()
    finally:
        con.close()
    assert {r[0]: r[2] for r in got} == {rid: pytest.approx(c, rel=1e-6) for rid, c in recorded.items()}
    if chromium_executable() or os.environ.get("CAPO_REQUIRE_BROWSER") == "1":
        require_chromium()
        with headless_chromium() as browser:
            tab = browser.new_page()
            tab.goto(page.as_uri())
            strip = tab.locator('.response[data-rollout="A"] [data-testid="credit-strip"]')
            assert strip.count() == 1 and "credit its update recorded" in strip.inner_text()
            assert strip.locator(".strip span").count() == 11

    stale = [({**key, "rollouts": "an earlier sample"},) * 2, ({**key, "token_rewards": "earlier rewards"},) * 2,
             (key, {**key, "train": {}})]  # the last: the checkpoint committed is another update's
    for credit_key, checkpoint_key in stale:
        own = update(credit_key, checkpoint_key)
        assert own["credit"] == [] and own["credit_kind"] is None, credit_key
    assert update(key, key)["credit_kind"] == "recorded"


def test_a_missing_browser_skips_here_and_fails_under_ci(monkeypatch):
    monkeypatch.setattr("pipeline.browse.chromium_executable", lambda: None)
    monkeypatch.delenv("CAPO_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Chromium is not installed"):
        require_chromium()
    monkeypatch.setenv("CAPO_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="Chromium is not installed.*CAPO_REQUIRE_BROWSER=1 requires"):
        require_chromium()
