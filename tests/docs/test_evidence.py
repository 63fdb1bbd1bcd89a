"""The figures the README and the docs quote match the evidence committed under ``docs/data/``
(the JSON lines the command next to each figure printed): a rerun that changes a number must change
the text too, and a figure edited by hand without its evidence fails here."""

from __future__ import annotations

import json
import re

from tests.conftest import REPO

DATA = REPO / "docs" / "data"


def _lines(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def _text(path: str) -> str:
    return " ".join((REPO / path).read_text().split())  # line breaks as spaces


def test_every_evidence_file_the_docs_link_exists():
    """Every docs/data file the docs name is committed, except those the commands of the benchmarks
    page's "Figures awaiting evidence" list would write."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"\*\*Figures awaiting evidence\.\*\*.*?\n## ", "", doc.read_text(), flags=re.S)
        for name in re.findall(r"(?:docs/)?data/([\w.+-]+\.jsonl?)\b", text):
            assert (DATA / name).is_file(), f"{doc.name} names docs/data/{name}, which is not committed"



def test_every_committed_evidence_file_is_linked_from_a_page():
    """Evidence no page links is a figure a reader cannot find: every file under docs/data/ is
    linked (``data/<name>``) from the README or a docs page."""
    pages = " ".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    linked = set(re.findall(r"data/([\w.+-]+\.jsonl?)\b", pages))
    orphans = sorted(p.name for p in DATA.iterdir() if p.suffix in (".json", ".jsonl") and p.name not in linked)
    assert not orphans, f"docs/data/ files no page links: {orphans}"

def test_held_out_hygiene_figures():
    (line,) = _lines("heldout-hygiene-mawps.jsonl")
    h = line["hygiene"]
    assert h["kept"] == h["training_rows"] - h["removed"] and len(h["removed_origins"]) == h["removed"]
    assert f"**{h['removed']} of {h['training_rows']}**" in _text("docs/benchmarks.md")
    assert f"train on the other {h['kept']}" in _text("docs/benchmarks.md")


def test_default_round_minutes():
    rec = json.loads((DATA / "round-default-avx512bf16.json").read_text())
    minutes = round(rec["wall_seconds"] / 60)
    assert f"A round took {minutes} minutes on a 2-core AMD EPYC with native bf16" in _text("README.md")


def test_readout_headline_on_new_rollouts():
    rows = {(r["variant"], r["source"], r["scope"]): r for r in _lines("signal-readout-heldout-56x4.jsonl")
            if r.get("kind") == "summary"}
    text = _text("docs/benchmarks.md")
    for scope in ("all_steps", "before_answer"):
        r = rows[("capo-logprob-arithmetic-t0.8", "logprob+arithmetic", scope)]
        pen = f"{100 * r['right_penalized']:.1f} % / {100 * r['wrong_penalized']:.1f} %"
        auc = f"{r['auroc']:.3f} [{r['auroc_low']:.3f}, {r['auroc_high']:.3f}]"
        assert pen in text and auc in text, (scope, pen, auc)


def test_suite_time_in_the_readme():
    """The README's suite times are their evidence's: the fresh-clone CI run on the slowest CPU (AVX2
    only) with its install, tests and slow tier, and the earlier run on a CPU with native bf16."""
    text = " ".join(_text("README.md").split())
    slow = next(r for r in _lines("test-suite-avx2.jsonl") if r["kind"] == "suite")
    assert slow["passed"] and slow["cpu_flags"] == "avx2"
    install = slow["wall_seconds_with_install"] - slow["pytest_seconds"]
    assert (f"took {round(slow['wall_seconds_with_install'] / 60)} minutes on a 2-core AMD EPYC with AVX2 only "
            f"(bf16 emulated, the slowest CPU it runs on): {round(install / 60)} of install, "
            f"{slow['pytest_seconds'] / 60:.1f} of tests, the slow tier {round(slow['seconds_per_tier']['slow'] / 60)} "
            f"of them ([per test](docs/data/test-suite-avx2.jsonl))") in text
    old = next(r for r in _lines("test-suite-avx512bf16.jsonl") if r["kind"] == "suite")
    assert (f"took {round(old['wall_seconds_with_install'] / 60)} minutes on a 2-core EPYC with native bf16 "
            f"([per test](docs/data/test-suite-avx512bf16.jsonl))") in text


def test_reference_guided_readout_table():
    rows = {(r["variant"], r["scope"]): r for r in _lines("signal-readout-reference-heldout-56x4.jsonl")
            if r.get("kind") == "summary" and r["source"] == "logprob+arithmetic"}
    text = _text("docs/benchmarks.md")
    for thr, variant in (("0.5", "capo-logprob-arithmetic"), ("0.7", "capo-logprob-arithmetic-t0.7"),
                         ("0.8", "capo-logprob-arithmetic-t0.8"), ("0.9", "capo-logprob-arithmetic-t0.9")):
        a, b = rows[(variant, "all_steps")], rows[(variant, "before_answer")]
        cells = (f"| {thr} | {100 * a['right_penalized']:.1f} % / {100 * a['wrong_penalized']:.1f} % | "
                 f"{a['auroc']:.3f} [{a['auroc_low']:.3f}, {a['auroc_high']:.3f}] | "
                 f"{b['auroc']:.3f} [{b['auroc_low']:.3f}, {b['auroc_high']:.3f}] |")
        assert cells in text, cells


def test_noise_floor_table():
    rec = json.loads((DATA / "noise-floor-round0-default-avx512bf16.json").read_text())
    text = _text("docs/benchmarks.md")
    rows = {(arm, b["benchmark"]): b for arm, a in rec["arms"].items() for b in a["benchmarks"]}
    assert all(rows[("repeat", b)]["diff"] == 0.0 and rows[("repeat", b)]["same_text"] == 1.0 for b in ("gsm8k", "math500"))
    share = rec["arms"]["one_rounding"]["changed_share"]
    for bench, name in (("gsm8k", "GSM8K"), ("math500", "MATH-500")):
        r = rows[("one_rounding", bench)]
        def pts(x: float) -> str:  # points, with the sign of a gain
            return f"{100 * x:+.1f}" if round(100 * x, 1) > 0 else f"{100 * x:.1f}".replace("-0.0", "0.0")

        cells = (f"| one bf16 step on {100 * share:.1f} % of the weights | {name} | {pts(r['diff'])} | "
                 f"[{pts(r['lo'])}, {pts(r['hi'])}] | {r['n10']} / {r['n01']} | {100 * r['same_text']:.0f} % |")
        assert cells in text, cells


MATRIX_TITLES = {"capo": "CAPO (`capo-readout`)", "grpo": "GRPO", "random-credit": "random credit"}


def _matrix_runs(lines: list[dict]) -> list[tuple[str, int]]:
    """The matrix's finished runs: those whose round-K item records the evidence file holds."""
    rounds = next(r for r in reversed(lines) if "run_ids" in r)["rounds"]
    return sorted({(r["items"], r["seed"]) for r in lines if "items" in r and r["round"] == rounds})


def matrix_table(lines: list[dict], arm: str, seed: int, budget: list[dict]) -> str:
    """The table of one finished matrix run as docs/benchmarks.md prints it: greedy and sampled
    accuracy with their paired intervals, the format breakdown, and (when ``budget``, the lines of
    budget-512.jsonl, holds the run) greedy accuracy at 512 tokens."""
    s = next(r for r in lines if r.get("summary") == arm)["paired_change_from_round0"][str(seed)]
    g, smp = s["format"], s["sampled"]

    def fmt(label, mode, field):
        return f"| {label} | {100 * g['round0'][mode][field]:.1f} % | {100 * g['roundK'][mode][field]:.1f} % | |"

    rows = [f"| held-out metric, {MATRIX_TITLES[arm]} seed {seed} | round 0 | round 10 | change, 95 % interval |",
            "| --- | ---: | ---: | --- |",
            f"| greedy accuracy | {100 * s['acc_a']:.1f} % | {100 * s['acc_b']:.1f} % | **{100 * s['diff']:+.1f}** points "
            f"[{100 * s['lo']:.1f}, {100 * s['hi']:.1f}], McNemar p = {s['p_mcnemar']:.4f} |".replace("+-", "-"),
            fmt("greedy accuracy within boxed answers", "greedy", "accuracy_boxed"),
            fmt("greedy answers cut at the token budget", "greedy", "share_cut")]
    rechecks = [r for r in budget if "run" in r and r["arm"].split()[0] == arm and r["seed"] == seed]
    if rechecks:
        b = rechecks[-1]["at_512"]
        rows.append(f"| greedy accuracy at 512 tokens | {100 * b['acc_a']:.1f} % | {100 * b['acc_b']:.1f} % | "
                    f"{100 * b['diff']:+.1f} points [{100 * b['lo']:.1f}, {100 * b['hi']:.1f}] |")
    rows += [f"| sampled accuracy (4 samples per problem) | {100 * smp['rate_a']:.1f} % | {100 * smp['rate_b']:.1f} % | "
             f"**{100 * smp['diff']:+.1f}** points [{100 * smp['lo']:+.1f}, {100 * smp['hi']:+.1f}] |",
             fmt("sampled accuracy within boxed answers", "sample", "accuracy_boxed"),
             fmt("samples that are Python programs", "sample", "share_program")]
    return "\n".join(rows)


def test_learning_matrix_tables():
    """Every finished run of the matrix has its table on the benchmarks page, exactly as its
    evidence renders (:func:`matrix_table`)."""
    lines = _lines("learning-readout-3seeds.jsonl")
    budget = _lines("budget-512.jsonl")
    raw = (REPO / "docs" / "benchmarks.md").read_text()
    runs = _matrix_runs(lines)
    assert len(runs) >= 4
    for arm, seed in runs:
        table = matrix_table(lines, arm, seed, budget)
        assert table.split("\n")[0] in raw, f"{MATRIX_TITLES[arm]} seed {seed} finished: add its table"
        assert table in raw, table


def _pts(x: float) -> str:
    return f"{100 * x:+.1f}"


def _iv(c: dict) -> str:
    return f"[{_pts(c['lo'])}, {_pts(c['hi'])}]"


WORDS = dict(enumerate(["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]))
WHOSE = {"capo": "CAPO's", "grpo": "GRPO's", "random-credit": "random credit's"}
RIVALS = {"grpo": "GRPO", "random_credit": "random credit"}


def _seeds(n: int) -> str:
    return f"{WORDS[n]} seed" + ("s" if n != 1 else "")


def _and(xs: list[str]) -> str:
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]


def matrix_sentences(lines: list[dict]) -> dict[str, str]:
    """The sentences of docs/benchmarks.md and the README that read the matrix, built from its
    evidence lines: each arm's change pooled over its seeds (seeds and items both random), CAPO's
    differences from GRPO and from random credit over the seeds both finished, and the verdicts."""
    summary = {r["summary"]: r for r in lines if "summary" in r}
    heads = {k: v for r in lines for k, v in r.items() if "capo_minus_" in k and k.endswith("_pooled")}
    pooled = {arm: summary[arm]["pooled_change_from_round0"] for arm in WHOSE}
    n_runs = len(_matrix_runs(lines))
    out = {"status": ("The matrix has finished" if n_runs == 9 else
                      f"**The matrix has not finished**: {WORDS[n_runs]} of its nine runs have")}
    gains = [summary[arm]["paired_change_from_round0"][str(seed)]["sampled"]["diff"] for arm, seed in _matrix_runs(lines)]
    out["gains"] = (f"All {WORDS[n_runs]} runs gained sampled accuracy" if min(gains) > 0 and n_runs > 1 else
                    f"{WORDS[sum(g > 0 for g in gains)].capitalize()} of the {WORDS[n_runs]} runs gained sampled accuracy")
    out["spread"] = "per seed, " + "; ".join(
        f"{who} greedy change was {_and([_pts(x) for x in pooled[arm]['greedy']['per_seed']])} points and its sampled "
        f"{_and([_pts(x) for x in pooled[arm]['sampled']['per_seed']])}" for arm, who in WHOSE.items())
    for arm, who in WHOSE.items():
        g, smp, box = (pooled[arm][k] for k in ("greedy", "sampled", "sampled_boxed"))
        assert g["seeds"] == smp["seeds"] == box["seeds"]
        out[f"pooled {arm}"] = (f"{who} change over {_seeds(g['seeds'])} is {_pts(g['diff'])} points greedy {_iv(g)}, "
                                f"{_pts(smp['diff'])} sampled {_iv(smp)} and {_pts(box['diff'])} sampled within boxed "
                                f"answers {_iv(box)}")
    for other, name in RIVALS.items():
        g, gb, smp, sb = (heads[f"{p}capo_minus_{other}_pooled"] for p in ("", "greedy_boxed_", "sampled_", "sampled_boxed_"))
        assert g["seeds"] == gb["seeds"] == smp["seeds"] == sb["seeds"]
        seeds = _seeds(g["seeds"])
        out[f"minus {other}"] = (f"CAPO minus {name} over {seeds} is {_pts(g['diff'])} points greedy {_iv(g)}, "
                                 f"{_pts(smp['diff'])} sampled {_iv(smp)}, {_pts(gb['diff'])} greedy within boxed answers "
                                 f"{_iv(gb)} and {_pts(sb['diff'])} sampled within boxed answers {_iv(sb)}")
        out[f"per seed {other}"] = (f"per seed {_and([_pts(x) for x in g['per_seed']])} points greedy, "
                                    f"{_and([_pts(x) for x in smp['per_seed']])} sampled")
        metrics = {"greedy": g, "greedy within boxed answers": gb, "sampled": smp, "sampled within boxed answers": sb}
        below = [m for m, c in metrics.items() if c["hi"] < 0]
        above = [m for m, c in metrics.items() if c["lo"] > 0]
        rest = WORDS[4 - len(below) - len(above)]
        if not below and not above:
            out[f"verdict {other}"] = (f"No interval excludes 0: over {seeds} CAPO's credit is neither shown "
                                       f"better nor worse than {name}")
        elif below and not above:
            out[f"verdict {other}"] = (f"{name[0].upper() + name[1:]} did better than CAPO over {seeds} on "
                                       f"{_and(below)} only (the other {rest} intervals include 0)")
        elif above and not below:
            out[f"verdict {other}"] = (f"CAPO did better than {name} over {seeds} on {_and(above)} only "
                                       f"(the other {rest} intervals include 0)")
        else:
            out[f"verdict {other}"] = f"Over {seeds} the intervals that exclude 0 disagree in sign"
        excluding = [c for c in (g, smp) if not c["lo"] <= 0 <= c["hi"]]  # the README gives greedy and sampled
        short = ("no interval excluding 0" if not excluding else
                 f"{name} ahead" if all(c["hi"] < 0 for c in excluding) else
                 "CAPO ahead" if all(c["lo"] > 0 for c in excluding) else "intervals of both signs")
        out[f"readme {other}"] = (f"CAPO minus {name} on the same problems over {seeds} is {_pts(g['diff'])} points "
                                  f"greedy {_iv(g)} and {_pts(smp['diff'])} sampled {_iv(smp)}, {short}")
    c, r = pooled["capo"], pooled["grpo"]
    out["readme pooled"] = (f"CAPO's held-out accuracy changed by {_pts(c['greedy']['diff'])} points greedy and "
                            f"{_pts(c['sampled']['diff'])} sampled over {_seeds(c['greedy']['seeds'])}, GRPO's by "
                            f"{_pts(r['greedy']['diff'])} and {_pts(r['sampled']['diff'])} over {WORDS[r['greedy']['seeds']]}")
    cb, rb = c["sampled_boxed"], r["sampled_boxed"]
    out["readme boxed"] = (f"within boxed answers they changed by {_pts(cb['diff'])} {_iv(cb)} and "
                           f"{_pts(rb['diff'])} {_iv(rb)} points, "
                           + ("intervals that include 0" if cb["lo"] <= 0 and rb["lo"] <= 0 else
                              "both intervals above 0" if cb["lo"] > 0 and rb["lo"] > 0 else
                              "one interval above 0"))
    rose = [MATRIX_TITLES[a] for a in WHOSE if pooled[a]["sampled"]["lo"] > 0]
    flat = [MATRIX_TITLES[a] for a in WHOSE if pooled[a]["sampled"]["lo"] <= 0]
    boxed = [MATRIX_TITLES[a] for a in WHOSE if pooled[a]["sampled_boxed"]["lo"] > 0]
    greedy = [MATRIX_TITLES[a] for a in WHOSE if not pooled[a]["greedy"]["lo"] <= 0 <= pooled[a]["greedy"]["hi"]]
    out["claims"] = (f"Sampled accuracy rose with an interval above 0 under {_and(rose) if rose else 'no arm'}"
                     + (f", not under {_and(flat)}" if flat else "") + "; within boxed answers "
                     + (f"under {_and(boxed)}" if boxed else "no arm's interval excludes 0") + "; greedy accuracy "
                     + (f"moved beyond noise under {_and(greedy)}" if greedy else "did not move beyond noise in any arm"))
    return out


def test_learning_matrix_verdicts():
    """The sentences that read the matrix (see :func:`matrix_sentences`), in docs/benchmarks.md
    and the README, and the claims about them that the intervals must bear out."""
    lines = _lines("learning-readout-3seeds.jsonl")
    page = _text("docs/benchmarks.md")
    readme = _text("README.md")
    said = matrix_sentences(lines)
    for key, sentence in said.items():
        assert sentence in (readme if key.startswith("readme") else page), (key, sentence)
    summary = {r["summary"]: r for r in lines if "summary" in r}
    t = summary["capo"]["paired_change_from_round0"]["0"]["transitions"]
    assert f"({t['right->wrong (ok->ok)']} right -> wrong, {t['wrong->right (ok->ok)']} wrong -> right" in page


def noise_sentence(lines: list[dict]) -> str:
    """The matrix's noise-floor sentence: the starting policy's held-out accuracy under each sample
    seed (round 0's eval first), the sampled spread, and which arms' pooled sampled change starts
    above it (``sampled_beyond_noise``)."""
    noise = next(r["noise_floor"] for r in lines if "noise_floor" in r)
    summary = {r["summary"]: r for r in lines if "summary" in r}
    seeds, accs, spread = _noise_figures(noise)
    above = [MATRIX_TITLES[arm] for arm in WHOSE if summary[arm]["sampled_beyond_noise"]]
    below = [MATRIX_TITLES[arm] for arm in WHOSE if summary[arm]["sampled_beyond_noise"] is False]
    verdict = (f"the pooled sampled change of {_and(above)} starts above that spread" if above else "") + (
        (f"; that of {_and(below)} does not" if above else
         f"the pooled sampled change of {_and(below)} does not start above that spread") if below else "")
    greedy = _and([f"{100 * x:.1f}" for x in noise["greedy"]["accuracy"]])
    return (f"Sampled under engine seeds {seeds}, the starting policy scored {accs} % sampled (a spread of "
            f"{spread} points) and {greedy} % greedy; {verdict}")


def _noise_figures(noise: dict) -> tuple[str, str, str]:
    """A ``noise_floor`` line's sample seeds, sampled accuracies (%) and their spread (points), as written."""
    smp = noise["sample"]
    return (_and([str(s) for s in noise["sample_seeds"]]), _and([f"{100 * x:.1f}" for x in smp["accuracy"]]),
            f"{100 * smp['spread']:.1f}")


def test_learning_noise_floor_sentence():
    """The matrix's noise floor as the page states it, and the claim that the sampled gains lie
    above it, which the evidence must bear out."""
    lines = _lines("learning-readout-3seeds.jsonl")
    assert noise_sentence(lines) in _text("docs/benchmarks.md")


def placement_sentences(rows: list[dict]) -> dict[str, str]:
    """Per matrix run with a process penalty: where its trained penalty falls (``capo signal``
    rows of the source it trains on, all steps), averaged over its rounds."""
    out = {}
    runs = sorted({r["run"] for r in rows})
    for run in runs:
        arm, seed = re.fullmatch(r"learn-(.+)-s(\d+)-[0-9a-f]+", run).groups()
        mine = [r for r in rows if r["run"] == run and r["trains"] and r["scope"] == "all_steps"]
        assert len({r["round"] for r in mine}) == len(mine) >= 1

        def mean(field):
            xs = [r[field] for r in mine if r[field] is not None]
            return sum(xs) / len(xs)

        out[run] = (f"{MATRIX_TITLES[arm]} seed {seed}: a penalty in {100 * mean('wrong_penalized'):.0f} % of wrong "
                    f"and {100 * mean('right_penalized'):.0f} % of right responses, starting at "
                    f"{mean('wrong_penalty_starts'):.2f} of a wrong response and {mean('right_penalty_starts'):.2f} of "
                    f"a right one")
    return out


def test_penalty_placement_sentences():
    """Where CAPO's and random credit's penalties fall, as docs/benchmarks.md says it."""
    page = _text("docs/benchmarks.md")
    said = placement_sentences(_lines("penalty-placement.jsonl"))
    assert any("capo" in run for run in said) and any("random-credit" in run for run in said)
    for run, sentence in said.items():
        assert sentence in page, (run, sentence)


def test_budget_recheck_rows():
    """The 512-token rows of the matrix's tables are the budget file's per-run lines."""
    page = _text("docs/benchmarks.md")
    runs = [r for r in _lines("budget-512.jsonl") if "run" in r]
    assert len(runs) >= 4
    titles = {(r["arm"].split()[0], r["seed"]): f"{MATRIX_TITLES[r['arm'].split()[0]]} seed {r['seed']}" for r in runs}
    for r in runs:
        assert r["round"] == 10
        b = r["at_512"]
        raw = (REPO / "docs" / "benchmarks.md").read_text()  # the run's own table: up to its blank line
        text = raw.split(f"| held-out metric, {titles[r['arm'].split()[0], r['seed']]} |", 1)[1].split("\n\n", 1)[0]
        assert (f"| greedy accuracy at 512 tokens | {100 * b['acc_a']:.1f} % | {100 * b['acc_b']:.1f} % | "
                f"{100 * b['diff']:+.1f} points [{100 * b['lo']:.1f}, {100 * b['hi']:.1f}] |") in text, r["run"]
        assert abs(b["diff"] - r["at_320"]["diff"]) <= 0.015 + 1e-9  # "within 1.5 points" of the 320-token change


def test_rivals_cost_table():
    lines = _lines("rivals-cost-default-avx512bf16.jsonl")
    summary = {x["arm"]: x for x in lines if x.get("summary")}
    assert set(summary) == {"grpo", "capo", "grpo-lambda", "fipo", "vineppo", "densr"}
    page = (REPO / "docs" / "benchmarks.md").read_text()
    section = page.split("## What each credit-assignment method costs per round", 1)[1].split("\n## ", 1)[0]
    text = " ".join(section.split())
    for arm, s in summary.items():
        rss = "" if s["own_stages_peak_rss_mb"] is None else f"{s['own_stages_peak_rss_mb'] / 1024:.1f} GiB"
        train = "not measured" if s["train_s"] is None else f"{s['train_s']:.0f}"
        row = re.search(rf"\| `{re.escape(arm)}` \|[^|]*\|([^|]*)\|([^|]*)\|([^|]*)\|", text)
        assert row is not None, arm
        assert [c.strip() for c in row.groups()] == [f"{s['own_stages_s']:.0f}", rss, train], arm
    trains = [s["train_s"] for s in summary.values() if s["train_s"] is not None]
    assert f"from {min(trains):.0f} to {max(trains):.0f} s across four methods" in text
    peaks = {round(x["train_peak_rss_mb"] / 1024, 1) for x in lines if x.get("train_peak_rss_mb")}
    assert len(peaks) == 1 and f"(peak RSS {peaks.pop():.1f} GiB in each)" in text  # MiB / 1024, as every table
    mc = next(x for x in lines if x.get("stage") == "mc")
    assert f"{mc['rows']} states x 4 continuations" in text
    own = {arm: s["own_stages_s"] / 60 for arm, s in summary.items()}
    assert (f"CAPO's critic {own['capo']:.1f} minutes, DenseR's hidden states {round(own['densr'])}, VinePPO's "
            f"continuations {round(own['vineppo'])} (training: {round(sorted(trains)[len(trains) // 2] / 60)})") in _text("README.md")


RIVAL_TITLES = {"grpo": "GRPO", "capo": "CAPO (`capo-readout`)", "random-credit": "random credit (control)",
                "grpo-lambda": "GRPO-λ", "fipo": "FIPO", "vineppo": "VinePPO", "densr": "DenseR"}


def rivals_table(lines: list[dict]) -> str:
    """The rivals' learning table of docs/benchmarks.md, built from learning-rivals.jsonl: per arm of
    the invocation, its change from round 0 (greedy, sampled, sampled within boxed answers) with its
    interval, and its sampled result minus GRPO's and minus CAPO's, paired by seed and item; an arm
    with no finished run reads "not run yet"."""
    last = next(r for r in reversed(lines) if "run_ids" in r)
    summary = {r["summary"]: r for r in lines if "summary" in r}
    vs = {(r["rival"], r["against"]): r["rival_minus_other_pooled"] for r in lines
          if "rival" in r and r["metric"] == "sampled"}
    head = next((r["sampled_capo_minus_grpo_pooled"] for r in lines if "sampled_capo_minus_grpo_pooled" in r), None)
    vs[("capo", "grpo")] = head

    def cell(c: dict | None) -> str:
        return f"{_pts(c['diff'])} {_iv(c)}" if c else ""

    seeds = ", ".join(str(s) for s in last["seeds"])
    rows = [f"| method (seed {seeds}) | greedy change | sampled change | sampled within boxed answers | "
            "sampled, minus GRPO | sampled, minus CAPO |",
            "| --- | --- | --- | --- | --- | --- |"]
    for arm in last["arms"]:
        if arm not in summary:
            rows.append(f"| {RIVAL_TITLES[arm]} | not run yet | | | | |")
            continue
        p = summary[arm]["pooled_change_from_round0"]
        cells = [cell(p.get(m)) for m in ("greedy", "sampled", "sampled_boxed")]
        cells += [cell(vs.get((arm, other))) if arm != other else "" for other in ("grpo", "capo")]
        rows.append(f"| {RIVAL_TITLES[arm]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def rivals_noise_sentence(lines: list[dict]) -> str:
    """The noise floor the rivals' page states: the starting policy's sampled accuracy over sample seeds."""
    seeds, accs, spread = _noise_figures(next(r["noise_floor"] for r in lines if "noise_floor" in r))
    return f"the starting policy sampled under engine seeds {seeds} scored {accs} % (a spread of {spread} points)"


RIVAL_ARMS = ("grpo-lambda", "fipo", "vineppo", "densr")


def rivals_result_sentence(lines: list[dict]) -> str:
    """What the rivals' table reads, as docs/benchmarks.md states it under the table: the methods
    whose sampled change's interval starts above the noise floor's spread (the matrix's
    ``sampled_beyond_noise`` criterion, here on one seed), the arms whose sampled result differs
    from GRPO's with an interval that excludes 0, and those whose greedy change's interval excludes 0."""
    last = next(r for r in reversed(lines) if "run_ids" in r)
    summary = {r["summary"]: r for r in lines if "summary" in r}
    done = [a for a in last["arms"] if a in summary]
    ran = [a for a in done if a in RIVAL_ARMS]
    if not ran:
        return "No rival credit method has finished its run yet."
    spread = next(r["noise_floor"] for r in lines if "noise_floor" in r)["sample"]["spread"]
    sampled = {a: summary[a]["pooled_change_from_round0"]["sampled"] for a in done}
    above = [RIVAL_TITLES[a] for a in done if sampled[a]["lo"] > spread]
    below = [RIVAL_TITLES[a] for a in done if sampled[a]["lo"] <= spread]
    vs = {r["rival"]: r["rival_minus_other_pooled"] for r in lines
          if "rival" in r and r["metric"] == "sampled" and r["against"] == "grpo"}
    vs["capo"] = next((r["sampled_capo_minus_grpo_pooled"] for r in lines if "sampled_capo_minus_grpo_pooled" in r), None)
    apart = [f"{RIVAL_TITLES[a]} ({_pts(vs[a]['diff'])} {_iv(vs[a])})" for a in done
             if vs.get(a) and (vs[a]["lo"] > 0 or vs[a]["hi"] < 0)]
    out = (f"{WORDS[len(ran)].capitalize()} of the {WORDS[len(RIVAL_ARMS)]} rivals finished ({_and([RIVAL_TITLES[a] for a in ran])}). "
           f"Sampled accuracy rose with an interval starting above the noise floor's {100 * spread:.1f} points under "
           f"{_and(above) if above else 'no arm'}" + (f"; not under {_and(below)}. " if below else ". "))
    greedy = {a: summary[a]["pooled_change_from_round0"]["greedy"] for a in done}
    fell = [a for a in done if greedy[a]["hi"] < 0]
    rose = [RIVAL_TITLES[a] for a in done if greedy[a]["lo"] > 0]
    out += ("The sampled result differs from GRPO's with an interval excluding 0 for "
            + (_and(apart) if apart else "no arm") + " on this seed. ")
    changes = [_pts(greedy[a]["diff"]) + " " + _iv(greedy[a]) for a in fell]
    said = f"{_and([RIVAL_TITLES[a] for a in fell])} ({_and(changes)} points)" if fell else "no arm"
    return out + ("Greedy accuracy fell with an interval below 0 under " + said
                  + (f" and rose with one above 0 under {_and(rose)}." if rose else "; no arm's rose with one above 0."))


def test_rivals_learning_table():
    """The rival credit methods' learning table is the one their evidence renders
    (:func:`rivals_table`); while a rival has not run, the page lists the command that runs it."""
    raw = (REPO / "docs" / "benchmarks.md").read_text()
    path = DATA / "learning-rivals.jsonl"
    command = "--evidence docs/data/learning-rivals.jsonl"
    if not path.exists():
        assert command in raw.split("## The scripts", 1)[0]
        return
    lines = _lines("learning-rivals.jsonl")
    table = rivals_table(lines)
    assert table in raw, table
    assert rivals_noise_sentence(lines) in " ".join(raw.split())
    assert rivals_result_sentence(lines) in " ".join(raw.split()), rivals_result_sentence(lines)
    assert "learning-rivals.jsonl" in raw.split(table, 1)[0].rsplit("###", 1)[1]  # the evidence named above it
    last = next(r for r in reversed(lines) if "run_ids" in r)
    missing = [arm for arm in last["arms"] if not any(r.get("summary") == arm for r in lines)]
    assert set(last["arms"]) >= {"grpo", "capo", "random-credit", "grpo-lambda", "fipo", "vineppo", "densr"}
    # a rival still to run keeps its command among the figures awaiting evidence, and only then
    assert (command in raw.split("## The scripts", 1)[0]) == bool(missing), missing
    # the runs trained on two machines start from one round-0 eval: every arm's, item by item
    start = [(r["ids"], r["greedy"], r["samples"]) for r in lines if "items" in r and r["round"] == 0]
    assert len(start) == len(last["arms"]) - len(missing) and all(x == start[0] for x in start)
    assert "their round-0 evals agree item by item" in " ".join(raw.split())


def test_generation_precision_figures():
    lines = _lines("generation-vllm-avx512bf16.jsonl")
    by = {x["dtype"]: x["tokens_per_s"] for x in lines if x.get("engine") == "vllm"}
    pick = next(x for x in lines if x.get("precision") == "vllm")
    assert pick["pick_is_fastest"] and pick["auto_picks"] == "bfloat16"
    text = _text("docs/benchmarks.md")
    assert f"**{by['bfloat16']:.0f} tokens/s in bf16 and {by['float32']:.0f} in fp32**" in text
    assert f"the faster by {pick['pick_over_slowest']:.1f}x" in text


def test_engine_reload_figures():
    lines = {x.get("way"): x for x in _lines("engine-reload-avx512bf16.jsonl")}
    text = _text("docs/benchmarks.md")
    assert f"the engine took **{lines['start']['client_seconds']:.1f} s**" in text
    assert f"in place **{lines['reload']['client_seconds']:.1f} s** (best of {lines['reload']['repeats']})" in text
    assert f"saves about {round(lines[None]['saved_seconds_per_engine_start'])} s per engine start" in text


def test_critique_n_table():
    lines = _lines("critique-n-avx512bf16.jsonl")
    ratio = next(x for x in lines if "n4_over_n1" in x)
    text = _text("docs/benchmarks.md")
    for x in (x for x in lines if x.get("n")):
        times_n1 = ratio[f"n{x['n']}_over_n1"]
        row = (f"| {x['n']} | {x['critiques']} | {x['seconds']:.1f} | {times_n1:.2f}x | "
               f"{x['vllm_prompt_tokens_cached']:,} of {x['prompt_tokens_requested']:,} |")
        assert row in text, row
    assert f"after a {next(x for x in lines if x.get('n'))['load_seconds']:.1f} s engine start" in text
    assert f"cost {ratio['n4_over_n1']:.1f} times one" in text


def test_trainer_precision_figures():
    pick = next(x for x in _lines("trainer-precision-avx512bf16.jsonl") if x.get("precision"))
    s = pick["step_seconds_by_precision"]
    assert pick["pick_is_fastest"] and pick["auto_picks"] == "bf16"
    text = _text("docs/benchmarks.md")
    assert f"**{s['bf16']:.1f} s in bf16 autocast and {s['no']:.1f} s in fp32**" in text
    assert f"`auto` picked bf16, the faster by {pick['slowest_over_pick']:.1f}x" in text


def test_trainer_memory_figures():
    s = next(x for x in _lines("trainer-memory-avx512bf16.jsonl") if x.get("memory") == "summary")
    text = _text("docs/benchmarks.md")
    assert (f"**{s['peak_rss_mb']['after'] / 1024:.1f} GiB against {s['peak_rss_mb']['before'] / 1024:.1f} GiB** "
            f"without the four, {s['saved_mb'] / 1024:.1f} GiB saved") in text


def test_arithmetic_check_alone_against_the_default_in_critic_eval():
    """docs/critic-eval.md's comparison of the arithmetic check alone with the default union
    (readout above 0.8 or the check), majority over N = 4, from critic-eval-sources-24.jsonl."""
    rows = _lines("critic-eval-sources-24.jsonl")

    def f1(setup: str, subset: str) -> float:  # the readout at the default's threshold, 0.8
        (r,) = [r for r in rows if r.get("setup") == setup and r.get("subset") == subset
                and r.get("rule") == "majority" and r.get("n") == 4
                and (setup == "arithmetic" or r.get("logprob_threshold") == 0.8)]
        return r["f1"]

    page = _text("docs/critic-eval.md")
    alone, union = "arithmetic", "readout-1.5b|arithmetic+gold"
    assert "F1 0.55 on the plain items and 0.96 on the adversarial copies" in page
    assert (round(f1(alone, "plain"), 2), round(f1(alone, "adversarial"), 2)) == (0.55, 0.96)
    assert f1(alone, "plain") > f1(union, "plain") and f1(alone, "adversarial") > f1(union, "adversarial")
    kinds = ("missing_step", "wrong_operation", "misread_relation", "wrong_quantity")
    assert [round(f1(union, k), 2) for k in kinds] == [0.15, 0.18, 0.0, 0.0]
    assert all(f1(alone, k) == 0 for k in kinds)
    assert "F1 0.15 on missing steps and 0.18 on wrong operations, 0 on the other" in page


SOURCES = [  # label, setup, the readout's threshold, bold (the default)
    ("sampled critiques, majority of 4 (the paper's, `capo-majority`)", "critic-1.5b+gold", 0.5, False),
    ("arithmetic check", "arithmetic", 0.5, False),
    ("sampled critiques + arithmetic (`capo-majority-arithmetic`)", "critic-1.5b|arithmetic+gold", 0.5, False),
    ("log-prob readout, P(wrong) > 0.5", "readout-1.5b+gold", 0.5, False),
    ("readout > 0.5 + arithmetic (`capo-logprob-arithmetic`)", "readout-1.5b|arithmetic+gold", 0.5, False),
    ("readout > 0.8", "readout-1.5b+gold", 0.8, False),
    ("readout > 0.8 + arithmetic (`capo-readout`, the default)", "readout-1.5b|arithmetic+gold", 0.8, True),
]
REASONING_KINDS = ("wrong_operation", "wrong_quantity", "missing_step", "misread_relation")


def sources_table(rows: list[dict]) -> str:
    """docs/benchmarks.md's table of every signal source in critic-eval (majority, N = 4): F1 and
    AUROC on the plain items, F1 per kind (mean and lowest over the six kinds), the reasoning kinds'
    mean F1, F1 on the copies' plain twins (`carried`, `as_was`; earliest-step accuracy weighted by
    count, with the adversarial subset's all-right items, as the report computes it) and on the
    adversarial copies, and critic seconds per plain item."""
    from critic_eval.scores import processbench_f1

    def row(setup: str, threshold: float, subset: str) -> dict:
        (r,) = [r for r in rows if r.get("setup") == setup and r.get("subset") == subset and r.get("rule") == "majority"
                and r.get("n") == 4 and r.get("logprob_threshold") == threshold]
        return r

    out = ["| source | F1, plain items | AUROC, plain | F1 per kind: mean / lowest | F1, reasoning kinds (mean) "
           "| F1, the copies' plain twins | F1, adversarial copies | critic s per plain item |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, setup, th, bold in SOURCES:
        plain, adv = row(setup, th, "plain"), row(setup, th, "adversarial")
        kinds = [row(setup, th, k)["f1"] for k in ("carried", "as_was", *REASONING_KINDS)]
        reasoning = [row(setup, th, k)["f1"] for k in REASONING_KINDS]
        twins = [row(setup, th, k) for k in ("carried", "as_was")]
        acc_err = sum(t["acc_erroneous"] * t["n_erroneous"] for t in twins) / sum(t["n_erroneous"] for t in twins)
        sec = plain["seconds_per_item"]
        b = (lambda x: f"**{x}**") if bold else (lambda x: x)
        cells = [b(label), b(f"{plain['f1']:.3f}"), b(f"{plain['auroc']:.3f}"),
                 f"{sum(kinds) / len(kinds):.3f} / {min(kinds):.3f}", f"{sum(reasoning) / len(reasoning):.3f}",
                 f"{processbench_f1(acc_err, adv['acc_correct']):.3f}", b(f"{adv['f1']:.3f}"),
                 "< 0.001" if sec < 0.001 else f"{sec:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def test_every_signal_source_table_in_critic_eval():
    """The sources table of docs/benchmarks.md is what critic-eval-sources-24.jsonl renders."""
    table = sources_table(_lines("critic-eval-sources-24.jsonl"))
    assert table in (REPO / "docs" / "benchmarks.md").read_text(), table
    assert ("F1 0.15 on the copies against 0.32 on the plain items they were made from (the same all-right "
            "items in both). The arithmetic check is not fooled (0.96 on both) and the readout with it is not "
            "either (0.87 against 0.83); the readout alone scores 0.19 against 0.23 at 0.5, and 0.28 against "
            "0.08 at 0.8") in _text("docs/benchmarks.md")

def test_adversarial_copies_against_their_plain_twins_in_critic_eval():
    """docs/critic-eval.md's robustness sentence: F1 on the calculation errors the copies are made
    from (`carried`, `as_was`, their earliest-step accuracy weighted by count) and on the copies,
    both with the adversarial subset's all-right items, as the report's robustness table computes it."""
    from critic_eval.scores import processbench_f1

    rows = _lines("critic-eval-sources-24.jsonl")

    def row(setup: str, subset: str) -> dict:
        (r,) = [r for r in rows if r.get("setup") == setup and r.get("subset") == subset
                and r.get("rule") == "majority" and r.get("n") == 4
                and (setup.startswith("critic") or r.get("logprob_threshold") == 0.8)]
        return r

    def twins_and_copies(setup: str) -> tuple[float, float]:
        twins = [row(setup, k) for k in ("carried", "as_was")]
        acc_err = sum(t["acc_erroneous"] * t["n_erroneous"] for t in twins) / sum(t["n_erroneous"] for t in twins)
        adv = row(setup, "adversarial")
        return round(processbench_f1(acc_err, adv["acc_correct"]), 2), round(adv["f1"], 2)

    assert twins_and_copies("readout-1.5b|arithmetic+gold") == (0.83, 0.87)
    assert twins_and_copies("critic-1.5b+gold") == (0.32, 0.15)
    assert ("On the calculation errors the adversarial copies are made from it scores 0.83 and on the "
            "copies 0.87; the sampled critiques 0.32 and 0.15") in _text("docs/critic-eval.md")


def amx_round_table() -> str:
    """The table of docs/benchmarks.md that sets the `capo-majority` round with the policy in fp32
    beside the same round on `auto`, on the AMX Xeon: each stage's seconds and peak RSS from the
    two rounds' ``round_summary.json``, the round's wall time, and the share of the update the
    exported checkpoint carries (``export_update_share`` of the rounds' train metrics)."""
    runs = {k: json.loads((DATA / f"round-capo-majority-amx-{k}.json").read_text()) for k in ("fp32", "auto")}
    share = {r["run_id"].split("-")[1]: r["value"] for r in _lines("round-capo-majority-amx-export.jsonl")
             if r["name"] == "export_update_share"}

    def stages(k: str, stage: str) -> list[dict]:
        return [x for x in runs[k]["stages"] if x["stage"] == stage]

    def cell(k: str, stage: str) -> str:
        st = stages(k, stage)[0]
        return f"{round(st['seconds'])} s, {st['peak_rss_mb'] / 1024:.1f} GiB"

    rows = ["| stage | policy in fp32 | policy on `auto` (bf16) |", "| --- | --- | --- |"]
    for label, stage in (("rollout (32 responses, vLLM 0.5B)", "rollout"), ("critique (128 critiques, vLLM 1.5B, bf16 in both)", "critique"),
                         ("train (2 PPO steps)", "train")):
        rows.append(f"| {label} | {cell('fp32', stage)} | {cell('auto', stage)} |")
    rows.append("| eval, round 0 and round 1 | " + " | ".join(
        " + ".join(f"{round(e['seconds'])} s" for e in stages(k, "eval")) for k in ("fp32", "auto")) + " |")
    rows.append("| **round** | " + " | ".join(f"**{runs[k]['wall_seconds']:,.0f} s ({runs[k]['wall_seconds'] / 60:.1f} min)**"
                                            for k in ("fp32", "auto")) + " |")
    rows.append("| share of round 1's update the exported checkpoint carries | " + " | ".join(
        f"{100 * share[k]:.0f} %" for k in ("fp32", "auto")) + " |")
    return "\n".join(rows)


def test_amx_round_table():
    """The `auto` round beside the fp32 one on the AMX Xeon is the table its evidence renders, and the
    all-skipped rerun's time is the benchmark's."""
    assert amx_round_table() in (REPO / "docs" / "benchmarks.md").read_text(), amx_round_table()
    resume = next(r for r in _lines("round-resume-amx.jsonl") if r.get("resume_timed"))
    assert resume["resume_stages_ran"] == [] and resume["skip_lines"] >= 9
    assert f"every stage skipped, took {resume['resume_seconds']:.1f} s" in _text("docs/benchmarks.md")
    shared = json.loads((DATA / "round-capo-majority-amx-fp32-shared-cpu.json").read_text())
    crit = next(x for x in shared["stages"] if x["stage"] == "critique")["seconds"]
    quiet = json.loads((DATA / "round-capo-majority-amx-fp32.json").read_text())
    crit_q = next(x for x in quiet["stages"] if x["stage"] == "critique")["seconds"]
    assert (f"took {shared['wall_seconds']:,.0f} s instead of {quiet['wall_seconds']:,.0f}, its critique "
            f"{crit:.0f} s instead of {crit_q:.0f}") in _text("docs/benchmarks.md")


def dead_zone_table() -> str:
    """The table of docs/benchmarks.md's bf16 dead zone: per kind of tensor, how much of round 1's
    fp32 update (the `capo-majority` round on `auto`, AMX Xeon) its bf16 checkpoint carries, from
    ``bench_export_drift.py``'s lines."""
    lines = _lines("export-drift-amx-capo-majority-round1.jsonl")
    rows = ["| tensors | elements | moved in fp32 | moved in the bf16 cast | cosine of the two updates "
            "| share of the update the cast carries |", "| --- | --- | --- | --- | --- | --- |"]
    for r in (x for x in lines if x.get("tensors")):
        cos = "-" if r["cosine"] is None else f"{r['cosine']:.2f}"
        rows.append(f"| {r['tensors']} | {r['elements'] / 1e6:,.2f} M | {100 * r['share_moved_fp32']:.1f} % "
                    f"| {100 * r['share_moved_cast']:.1f} % | {cos} | {100 * r['slope_cast_on_fp32']:.1f} % |")
    return "\n".join(rows)


def test_dead_zone_table():
    """The CPU dead-zone figures are the table the export-drift evidence renders, the round's
    checkpoint is exactly the cast of its master weights, and the headline agrees with the
    round's own ``export_update_share``."""
    assert dead_zone_table() in (REPO / "docs" / "benchmarks.md").read_text(), dead_zone_table()
    lines = _lines("export-drift-amx-capo-majority-round1.jsonl")
    run = lines[-1]
    assert run["checkpoint_elements_not_the_cast"] == 0 and run["native_bf16"]
    share = next(r["value"] for r in _lines("round-capo-majority-amx-export.jsonl")
                 if r["run_id"] == "majority-auto" and r["name"] == "export_update_share")
    fp32 = next(r["value"] for r in _lines("round-capo-majority-amx-export.jsonl")
                if r["run_id"] == "majority-fp32-quiet" and r["name"] == "export_update_share")
    assert fp32 == 1.0 and "The same round with the policy in fp32 carries all of it" in _text("docs/benchmarks.md")
    alls = next(x for x in lines if x.get("tensors") == "all")
    assert abs(alls["slope_cast_on_fp32"] - share) < 1e-9
    assert (f"carries **{100 * alls['slope_cast_on_fp32']:.0f} %** of the fp32 update "
            f"(cosine {alls['cosine']:.2f})") in _text("docs/benchmarks.md")


GOAL_SETUPS = (("v1", "v1, free text"), ("v1-structured", "v1, structured"), ("v3", "v3, free text"),
               ("v3-structured", "v3, structured"))


def _goal() -> tuple[list[dict], dict[str, dict]]:
    """The score rows, and what each critic setup answered (keyed ``<critic>+gold``)."""
    rows = _lines("critic-eval-goal-24.jsonl")
    return [r for r in rows if r["kind"] == "score"], {r["setup"]: r for r in rows if r["kind"] == "answers"}


def _goal_score(scores: list[dict], setup: str, subset: str, rule: str, n: int, partial: str = "list") -> dict:
    (r,) = [r for r in scores if r["setup"] == f"{setup}+gold/{partial}" and r["subset"] == subset
            and r["rule"] == rule and r["n"] == n]
    return r


def critic_eval_goal_table() -> str:
    """docs/benchmarks.md's critic-eval table from critic-eval-goal-24.jsonl: per template and
    output mode, F1 on the plain items at N = 4 under each rule (incomplete critiques as lists),
    the critiques that parse complete, the share of the non-empty final lists that are ``[1]`` and
    the critic seconds per item at N = 4."""
    scores, setups = _goal()
    rows = ["| critic (template, output) | F1 intersection | F1 majority | F1 union | F1 average | critiques complete "
            "| non-empty lists that are `[1]` | critic s per plain item |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, label in GOAL_SETUPS:
        f1 = [f"{_goal_score(scores, key, 'plain', rule, 4)['f1']:.2f}" for rule in ("intersection", "majority", "union", "average")]
        s = setups[f"{key}+gold"]
        total = sum(s["statuses"].values())
        ones = next((c for lst, c, _ in s["top_lists"] if lst == "[1]"), 0)
        secs = _goal_score(scores, key, "plain", "majority", 4)["seconds_per_item"]
        rows.append(f"| {label} | " + " | ".join(f1) + f" | {s['statuses'].get('complete', 0)} of {total} | "
                    f"{ones} of {s['non_empty_lists']} | {secs:.1f} |")
    return "\n".join(rows)


def test_critic_eval_goal_figures():
    """The critic-eval of templates, structured output and rules is the table its evidence renders,
    and the sentences around it quote the evidence: the best F1 anywhere, the shipped setting's,
    and how far planted verdicts lower the shipped setting's flags."""
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert critic_eval_goal_table() in page, critic_eval_goal_table()
    scores, setups = _goal()
    text = _text("docs/benchmarks.md")
    plain = [r for r in scores if r["subset"] == "plain"]
    best = max(r["f1"] for r in plain)
    best_rows = [r for r in plain if r["f1"] == best]
    assert {(r["setup"], r["rule"], r["n"]) for r in best_rows} == {("v1+gold/drop", "union", 2), ("v1+gold/drop", "average", 2)}
    assert (f"The best F1 on the plain items, under any template, rule, N and treatment of incomplete or inconsistent "
            f"critiques, is {best:.2f} (v1 free text, `union` or `average` at N = 2, such critiques dropped)") in text
    shipped_row = _goal_score(scores, "v1-structured", "plain", "majority", 4)
    right_flagged = round((1 - shipped_row["acc_correct"]) * shipped_row["n_correct"])
    assert (f"the shipped setting (v1, structured, `majority` over N = 4) scores {shipped_row['f1']:.2f}, the best of the "
            f"four at N = 4 under `majority`, and flags a step in {right_flagged} of the {shipped_row['n_correct']} right "
            "solutions") in text
    assert shipped_row["f1"] == max(_goal_score(scores, k, "plain", "majority", 4)["f1"] for k, _ in GOAL_SETUPS)
    ones = {k: next(c for lst, c, _ in setups[f"{k}+gold"]["top_lists"] if lst == "[1]") / setups[f"{k}+gold"]["non_empty_lists"]
            for k in ("v1", "v1-structured")}
    assert f"`[1]` ({100 * ones['v1']:.0f} % free, {100 * ones['v1-structured']:.0f} % structured)" in text
    assert (f"a non-empty list in {setups['v3+gold']['non_empty_lists']} and "
            f"{setups['v3-structured+gold']['non_empty_lists']} of 424 critiques") in text
    st, fr = setups["v1-structured+gold"]["statuses"], setups["v1+gold"]["statuses"]
    assert set(st) == {"complete", "inconsistent"}  # "no incomplete or unparsable one is left"
    assert (f"makes {st['complete']} of 424 critiques complete against {fr['complete']} free (no incomplete or "
            f"unparsable one is left, {st['inconsistent']} inconsistent), at "
            f"{_goal_score(scores, 'v1-structured', 'plain', 'majority', 4)['seconds_per_item']:.1f} critic seconds per item "
            f"against {_goal_score(scores, 'v1', 'plain', 'majority', 4)['seconds_per_item']:.1f}") in text
    def flagged(key: str, subsets: tuple[str, ...]) -> tuple[int, int]:  # (wrong steps flagged, erroneous items)
        rows = [_goal_score(scores, key, sub, "majority", 4) for sub in subsets]
        return round(sum(r["label_flagged"] * r["n_erroneous"] for r in rows)), sum(r["n_erroneous"] for r in rows)

    twins = {k: flagged(k, ("carried", "as_was")) for k in ("v1", "v1-structured")}  # the copies' plain twins
    copies = {k: flagged(k, ("adversarial",)) for k in ("v1", "v1-structured")}
    (s_t, n_t), (s_c, n_c), (f_t, _), (f_c, _) = twins["v1-structured"], copies["v1-structured"], twins["v1"], copies["v1"]
    assert n_t == n_c == 24
    assert (f"is flagged in {s_t} of {n_t} items and in {s_c} of their {n_c} adversarial copies with structured "
            f"critiques, in {f_t} of {n_t} and {f_c} of {n_c} free") in text
    k = next(r for r in _lines("critic-eval-goal-24.jsonl") if r["kind"] == "run")["kinds"]
    calc, adv = k["carried"] + k["as_was"], k["adv_verdict"] + k["adv_praise"] + k["adv_ignore"]
    reasoning = k["wrong_operation"] + k["wrong_quantity"] + k["missing_step"] + k["misread_relation"]
    assert sum(k.values()) == k["original"] + calc + adv + reasoning
    assert (f"24 GSM8K test problems = {sum(k.values())} items ({k['original']} right solutions, {calc} calculation "
            f"errors, {reasoning} reasoning errors, {adv} adversarial copies)") in text
    # the rows of "Defaults from evidence" that cite this run
    f1 = {rule: _goal_score(scores, "v1-structured", "plain", rule, 4)["f1"] for rule in ("intersection", "majority", "union", "average")}
    low, high = sorted((f1["union"], f1["intersection"]))
    assert (f"structured v1 critiques at N = 4 score F1 {f1['majority']:.2f} under `majority` against {f1['average']:.2f} "
            f"under `average` and {low:.2f}-{high:.2f} under `union` and `intersection`") in text
    by_n = ", ".join(f"{_goal_score(scores, 'v1-structured', 'plain', 'majority', n)['f1']:.2f}" for n in (1, 2, 4))
    assert f"score about the same at N = 1, 2 and 4 (F1 {by_n})" in text
    # the config reference (vote.rule's docstring) quotes the same rows
    free = {rule: _goal_score(scores, "v1", "plain", rule, 4)["f1"] for rule in ("majority", "average")}
    assert (f"majority scores F1 {f1['majority']:.2f}, average {f1['average']:.2f}, intersection "
            f"{f1['intersection']:.2f} and union {f1['union']:.2f}; with free-text critiques average scores highest "
            f"({free['average']:.2f} against {free['majority']:.2f})") in _text("pipeline/config.py")
    v1 = sorted(_goal_score(scores, k, "plain", "majority", 4)["f1"] for k in ("v1", "v1-structured"))
    v3 = sorted(_goal_score(scores, k, "plain", "majority", 4)["f1"] for k in ("v3", "v3-structured"))
    assert f"v1 scores F1 {v1[0]:.2f}-{v1[1]:.2f} at N = 4 under `majority`, v3 {v3[0]:.2f}-{v3[1]:.2f}" in text
