"""Run critics over a step-error benchmark and write tables, a plot and a report (I/O edge).

Stages of ``critic-eval`` (each from files to files, skipped when its output is current under its
key, like the round stages; see :mod:`pipeline.storage`)::

    benchmark  -> runs/critic_eval/<name>/benchmark.parquet            one row per item
    critique   -> runs/critic_eval/<name>/critiques/<setup>.parquet    one row per critique (heavy)
    score      -> runs/critic_eval/<name>/{scores,predictions}.parquet
    report     -> runs/critic_eval/<name>/{report.md,f1_vs_n.png}

A *setup* is one critic with the gold answer on or off (``<critic name>+gold`` /
``<critic name>+nogold``). The critic runs exactly as in training: the same prompt template
(:func:`pipeline.core.critique.build_critique_messages`, the critic's ``template``), parser
(:func:`pipeline.core.critique.parse_critique`) and engines (:func:`pipeline.engines.make_engine`),
``n_max`` samples per item in one request. Scoring takes the first N of them for each N (no
further critic call), once per ``partial_critiques`` policy (how incomplete / inconsistent
critiques vote, ``vote.partial_critiques`` in training): with more than one policy a scored setup
is labelled ``<setup>/<policy>``. To compare templates, list the same critic twice under two
names with different ``template``s.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import zlib
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, field_validator, model_validator

from pipeline import storage
from pipeline.config import (
    EngineConfig,
    SamplingConfig,
    Strict,
    VLLMEngineConfig,
    check_structured_engine,
    deep_merge,
    parse_overrides,
    read_config_file,
)
from pipeline.core.critique import DATA_ESCAPE_VERSION, PARSER_VERSION, STRUCTURED_VERSION, TEMPLATE_VERSION
from pipeline.schemas import (
    CRITIC_EVAL_BENCHMARK_SCHEMA,
    CRITIC_EVAL_CRITIQUES_SCHEMA,
    CRITIC_EVAL_PREDICTIONS_SCHEMA,
    CRITIC_EVAL_SCORES_SCHEMA,
)
from pipeline.stages.base import (
    Stage,
    StageResult,
    check_outputs,
    model_fingerprint,
    resolve_model,
)

log = logging.getLogger("capo.critic_eval")

BUILTIN_BENCHMARK = "gsm8k-corrupt"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


# ------------------------------------------------------------------------------------------- config
class CriticSpec(Strict):
    """One critic (GenPRM) or step check to evaluate, as a signal source of ``vote.sources`` in training."""

    name: str = Field(pattern=_NAME)
    """Label in tables and the report, e.g. ``embedded-1.5b``."""
    source: Literal["llm", "logprob", "arithmetic"] = "llm"
    """``llm``: ``n_max`` sampled critiques per item (the paper's GenPRM). ``logprob``: the
    model's calibrated P(wrong) of every step from one teacher-forced pass
    (:mod:`pipeline.core.readout`, ``critique.logprob_readout`` in training), run with the
    transformers engine at ``engine.dtype``. ``arithmetic``: the exact check of every written
    calculation (:mod:`pipeline.core.arithmetic`); no model, no gold answer, milliseconds. A check
    gives one verdict per item, which stands for every N."""
    model: str = ""
    """Embedded model name, local checkpoint, HF id, or the model name an ``openai`` engine serves
    (``llm``, ``logprob``; empty for ``arithmetic``)."""
    engine: EngineConfig = VLLMEngineConfig(max_model_len=4096, kv_cache_gib=3.0)
    """How to run it (vllm, transformers, or an OpenAI-compatible endpoint); as ``critique.engine``."""
    sampling: SamplingConfig = SamplingConfig(temperature=0.7, top_p=0.95, max_tokens=320)
    """As ``critique.sampling`` in training."""
    template: Literal["capo-genprm-v1", "capo-genprm-v2", "capo-genprm-v3"] = TEMPLATE_VERSION
    """Critic prompt template, as ``critique.template`` in training (:mod:`pipeline.core.critique`)."""
    structured_output: bool = False
    """Constrain every critique to the verdict format, as ``critique.structured_output`` in training
    (where it is on by default with the vllm engine; here it is off unless set)."""

    @model_validator(mode="after")
    def _structured_engine(self) -> "CriticSpec":
        where = f"critics[{self.name}]"
        if self.source == "arithmetic":
            if self.model:
                raise ValueError(f"{where}: source 'arithmetic' runs no model; drop model={self.model!r}")
        elif not self.model:
            raise ValueError(f"{where}: source {self.source!r} needs a model (an embedded model name, a local "
                             "checkpoint or an HF id)")
        if self.source != "llm" and self.structured_output:
            raise ValueError(f"{where}: structured_output constrains sampled critiques; source {self.source!r} samples none")
        if self.source == "logprob":
            if self.engine.type == "openai":
                raise ValueError(f"{where}: the log-prob readout needs the critic's weights (engine type vllm or "
                                 "transformers); a served (openai) critic cannot give prompt log-probs here")
            if self.template == "capo-genprm-v3":
                raise ValueError(f"{where}: the log-prob readout is calibrated per template; capo-genprm-v3's example "
                                 "changes with every solution, use capo-genprm-v1 or capo-genprm-v2")
        check_structured_engine(self.structured_output, self.engine.type, where)
        return self

    @property
    def uses_gold(self) -> bool:
        """Whether ``include_gold_answer`` changes what this critic sees (not for ``arithmetic``)."""
        return self.source != "arithmetic"


class BenchmarkConfig(Strict):
    source: str = BUILTIN_BENCHMARK
    """``gsm8k-corrupt`` (GSM8K reference solutions, one corrupted copy each; see
    :mod:`critic_eval.items`) or a ProcessBench-format ``.jsonl``/``.json``/``.parquet`` file:
    ``problem``, ``steps`` (list of strings), ``label`` (first wrong step, -1 if none), optional
    ``id``, ``gold_answer``, ``step_labels`` (0/1 per step) and ``kind``."""
    split: Literal["test", "train"] = "test"
    """GSM8K split of the built-in benchmark."""
    n_problems: int = Field(8, ge=1)
    """Built-in: GSM8K problems used; each gives an original, a corrupted and (with ``adversarial``)
    an adversarial item, and (with ``reasoning_errors``) up to one item per reasoning-error kind."""
    adversarial: bool = True
    """Built-in: add one adversarial copy of each corrupted item (critic robustness)."""
    reasoning_errors: bool = True
    """Built-in: add the errors a calculator cannot see, one item per kind a problem allows
    (``wrong_operation``, ``wrong_quantity``, ``missing_step``, ``misread_relation``: every written
    calculation stays right; :func:`critic_eval.items.reasoning_error`)."""
    max_items: int | None = Field(None, ge=1)
    """A file: keep only its first ``max_items`` rows."""


def _default_critics() -> list[CriticSpec]:
    return [CriticSpec(name="embedded-1.5b", model="qwen2.5-coder-1.5b-instruct"),
            CriticSpec(name="policy-self", model="qwen2.5-coder-0.5b-instruct")]


class CriticEvalConfig(Strict):
    """A critic evaluation: one benchmark, several critics x gold answer on/off, several N."""

    name: str = Field("default", pattern=_NAME)
    """Run directory: ``<runs_dir>/critic_eval/<name>/``."""
    runs_dir: str = "runs"
    data_dir: str = "data"
    """Where ``capo setup`` put the embedded models and prompt tables."""
    seed: int = 0
    """Seeds the built-in benchmark and every critic engine."""
    benchmark: BenchmarkConfig = BenchmarkConfig()
    critics: list[CriticSpec] = Field(default_factory=_default_critics)
    include_gold_answer: list[bool] = [True, False]
    """Each critic runs once per value (the paper's gold-answer ablation)."""
    n_values: list[int] = [1, 2, 4, 8]
    """N values scored; the critic samples ``max(n_values)`` critiques per item once."""
    majority_threshold: float = Field(0.5, ge=0, lt=1)
    """As ``vote.majority_threshold`` in training."""
    logprob_threshold: float = Field(0.5, gt=0, lt=1)
    """As ``vote.logprob_threshold`` in training: a ``logprob`` critic flags a step when its calibrated
    P(wrong) is above this (under ``average`` the weight is P(wrong) itself)."""
    unions: list[list[str]] = []
    """Sources voting together, as ``vote.sources`` with several entries: each a list of two or more
    critic names, scored as one setup whose step weight is the largest of its members' (per gold
    setting, rule and N), e.g. ``[[embedded-1.5b, arithmetic], [readout-1.5b, arithmetic]]``."""
    partial_critiques: list[Literal["list", "lines", "drop"]] = ["list", "lines", "drop"]
    """Policies scored for critiques that did not judge every step in its own line or whose
    lines contradict their list (``vote.partial_critiques`` in training); each is a scored setup."""

    @field_validator("n_values")
    @classmethod
    def _ns(cls, v: list[int]) -> list[int]:
        if not v or any(n < 1 for n in v):
            raise ValueError(f"n_values must be a non-empty list of N >= 1, got {v}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _check(self) -> "CriticEvalConfig":
        names = [c.name for c in self.critics]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"critics need distinct names (got {names}); give each a `name:`")
        if not self.include_gold_answer:
            raise ValueError("include_gold_answer must hold true, false or both, e.g. [true, false]")
        if not self.partial_critiques or len(set(self.partial_critiques)) != len(self.partial_critiques):
            raise ValueError(f"partial_critiques must list distinct policies of list, lines, drop; got "
                             f"{self.partial_critiques}")
        for u in self.unions:
            if len(u) < 2 or len(set(u)) != len(u) or any(m not in names for m in u):
                raise ValueError(f"each of unions must name two or more distinct critics of {names}; got {u}")
        return self

    @property
    def n_max(self) -> int:
        return max(self.n_values)

    def run_dir(self) -> Path:
        return Path(self.runs_dir).resolve() / "critic_eval" / self.name

    def setups(self) -> dict[str, tuple[CriticSpec, bool]]:
        """``{setup id: (critic, include_gold_answer)}`` in report order: ``<name>+gold`` /
        ``<name>+nogold`` per gold setting, and ``<name>`` alone for a check that reads no gold
        answer (``arithmetic``)."""
        out: dict[str, tuple[CriticSpec, bool]] = {}
        for c in self.critics:
            if not c.uses_gold:
                out[c.name] = (c, False)
                continue
            for g in dict.fromkeys(self.include_gold_answer):
                out[f"{c.name}+{'gold' if g else 'nogold'}"] = (c, g)
        return out

    def _member_setup(self, name: str, gold: bool) -> str:
        c = next(c for c in self.critics if c.name == name)
        return f"{name}+{'gold' if gold else 'nogold'}" if c.uses_gold else name

    def scored_setups(self) -> dict[str, tuple[tuple[str, ...], str]]:
        """``{label: (member setups, partial-critique policy)}``: the setups as the scores and report
        name them; a setup of sampled critiques once per policy (``<setup>/<policy>`` when there are
        several), a check once, and each of ``unions`` once per gold setting and policy (``a|b+gold``)."""
        one = len(self.partial_critiques) == 1
        out: dict[str, tuple[tuple[str, ...], str]] = {}
        for s, (c, _) in self.setups().items():
            pols = self.partial_critiques if c.source == "llm" else self.partial_critiques[:1]
            for pol in pols:
                out[s if one or c.source != "llm" else f"{s}/{pol}"] = ((s,), pol)
        for u in self.unions:
            crit = [next(c for c in self.critics if c.name == m) for m in u]
            golds = dict.fromkeys(self.include_gold_answer) if any(c.uses_gold for c in crit) else {False: None}
            pols = self.partial_critiques if any(c.source == "llm" for c in crit) else self.partial_critiques[:1]
            for g in golds:
                members = tuple(self._member_setup(m, g) for m in u)
                base = "|".join(u) + (f"+{'gold' if g else 'nogold'}" if any(c.uses_gold for c in crit) else "")
                for pol in pols:
                    out[base if one or len(pols) == 1 else f"{base}/{pol}"] = (members, pol)
        return out


def load_eval_config(path: str | Path | None = None, overrides: list[str] | None = None) -> CriticEvalConfig:
    """Load a ``critic-eval`` YAML config and apply ``key=value`` overrides (YAML values, e.g.
    ``n_values=[1,2]`` or ``critics=[{name: big, model: Qwen/Qwen2.5-72B-Instruct, engine: {type:
    openai, base_url: "http://host:8000/v1"}}] unions=[]``: a new ``critics`` list replaces the
    config's, whose ``unions`` name the old critics).

    Raises:
        FileNotFoundError: no such config file.
        pydantic.ValidationError: an unknown key or a bad value.
    """
    raw = read_config_file(path, "configs/critic_eval.yaml") if path is not None else {}
    return CriticEvalConfig.model_validate(deep_merge(raw, parse_overrides(overrides)))


def write_resolved_config(cfg: CriticEvalConfig) -> Path:
    """The resolved config as YAML in the run dir (what child processes read):
    :func:`pipeline.config.write_resolved_config`."""
    from pipeline.config import write_resolved_config as write

    return write(cfg, cfg.run_dir())


# ------------------------------------------------------------------------------------------ tables
def paths(cfg: CriticEvalConfig) -> dict[str, Path]:
    rd = cfg.run_dir()
    return {"run_dir": rd, "benchmark": rd / "benchmark.parquet", "critiques_dir": rd / "critiques",
            "scores": rd / "scores.parquet", "predictions": rd / "predictions.parquet",
            "report": rd / "report.md", "plot": rd / "f1_vs_n.png"}


# ---------------------------------------------------------------------------------------- benchmark
def _read_records(path: Path) -> list[tuple[str, dict]]:
    """The items of a ProcessBench file, each with where it is (file and line or row):
    :func:`pipeline.assets.prompts.read_records`.

    Raises:
        ValueError: not .jsonl, .json or .parquet, empty, not UTF-8, a line that is not a JSON
            object, or a Parquet file that does not read (names the file, the line and the reason).
    """
    from pipeline.assets.prompts import read_records

    return read_records(path, "benchmark file")


def benchmark_stage(cfg: CriticEvalConfig, unit: None = None, force: bool = False) -> StageResult:
    """Build the built-in benchmark, or load and check a ProcessBench file -> ``benchmark.parquet``
    (one per evaluation: ``unit`` is None).

    Raises:
        FileNotFoundError: the ProcessBench file does not exist.
        ValueError: the file cannot be read as items (:func:`_read_records`) or an item breaks
            :func:`critic_eval.items.processbench_rows`'s rules (names the file, line and field);
            the built-in benchmark cannot give ``n_problems`` problems.
    """
    from critic_eval import items as critic_bench

    b, out = cfg.benchmark, paths(cfg)["benchmark"]
    if b.source == BUILTIN_BENCHMARK:
        from pipeline.assets.prompts import ensure_embedded_prompts

        src = ensure_embedded_prompts(Path(cfg.data_dir).resolve() / "prompts")[f"gsm8k_{b.split}"]
        key = {"source": b.source, "generator": critic_bench.GENERATOR_VERSION, "split": b.split,
               "n_problems": b.n_problems, "adversarial": b.adversarial, "seed": cfg.seed,
               **({} if b.reasoning_errors else {"reasoning_errors": False}),  # on: the v2 generator's key
               "prompts": storage.file_sha256(src)}
    else:
        src = Path(b.source).expanduser().resolve()
        if not src.is_file():
            raise FileNotFoundError(f"benchmark file {src} not found; give a ProcessBench .jsonl/.parquet "
                                    f"or {BUILTIN_BENCHMARK!r}")
        key = {"source": str(src), "file": storage.file_sha256(src), "max_items": b.max_items}
    if (res := check_outputs("benchmark", [out], key, force)).skipped:
        return res
    t0 = time.perf_counter()
    if b.source == BUILTIN_BENCHMARK:
        rows = critic_bench.build_benchmark(pq.read_table(src).to_pylist(), b.n_problems, cfg.seed, b.adversarial,
                                            critic_bench.KINDS_REASONING if b.reasoning_errors else ())
    else:
        records = _read_records(src)[: b.max_items]
        rows = critic_bench.processbench_rows([r for _, r in records], src.stem, where=[w for w, _ in records])
    table = pa.Table.from_pylist(rows, schema=CRITIC_EVAL_BENCHMARK_SCHEMA)
    man = storage.write_table(table, out, "critic_eval_benchmark", stage="benchmark", key=key)
    return StageResult("benchmark", str(out), False, "built", man["rows"], time.perf_counter() - t0)


def _benchmark_fingerprint(cfg: CriticEvalConfig) -> str:
    path = paths(cfg)["benchmark"]
    man = storage.read_manifest(path)
    if man is None or not path.is_file():
        raise FileNotFoundError(f"{path} is missing or uncommitted; run the benchmark stage first "
                                "(python -m flows.critic_eval bench)")
    return man["fingerprint"]


def read_benchmark(cfg: CriticEvalConfig) -> list[dict]:
    path = paths(cfg)["benchmark"]
    _benchmark_fingerprint(cfg)
    return storage.read_table(path, "critic_eval_benchmark").to_pylist()


# ----------------------------------------------------------------------------------------- critique
def critique_path(cfg: CriticEvalConfig, setup: str) -> Path:
    return paths(cfg)["critiques_dir"] / f"{setup}.parquet"


def replies_path(cfg: CriticEvalConfig, setup: str) -> Path:
    """The OpenAI engine's reply cache of ``setup`` (beside its critiques table, removed once the
    table is written): the replies finished before a request failed, reused by the next run."""
    return paths(cfg)["critiques_dir"] / f".{setup}.replies.jsonl"


def critique_key(cfg: CriticEvalConfig, setup: str) -> dict:
    critic, gold = cfg.setups()[setup]
    bench = _benchmark_fingerprint(cfg)
    if critic.source == "arithmetic":
        from pipeline.core.arithmetic import VERSION as ARITHMETIC_VERSION

        return {"benchmark": bench, "source": "arithmetic", "checker": ARITHMETIC_VERSION}
    spec = critic.model_dump(mode="json")
    spec.pop("source")  # sampled-critique setups keep the keys they had before the option
    key = {"benchmark": bench, "critic": spec,
           "include_gold_answer": gold, "n_max": cfg.n_max, "template_version": critic.template,
           "parser": PARSER_VERSION, "data_escape": DATA_ESCAPE_VERSION, "seed": cfg.seed,
           "model": model_fingerprint(resolve_model(critic.model, cfg))}
    if critic.source == "logprob":
        from pipeline.core.readout import VERSION as READOUT_VERSION

        for k in ("sampling", "n_max", "seed", "parser", "structured_output"):
            spec.pop(k, None)
            key.pop(k, None)
        key.update(source="logprob", readout=READOUT_VERSION, dtype=critic.engine.dtype)
    elif spec.pop("structured_output"):  # free-text setups keep the keys they had before the option
        key["structured"] = STRUCTURED_VERSION
    return key


def _check_rows(cfg: CriticEvalConfig, setup: str, items: list[dict]) -> tuple[list[dict], dict]:
    """The arithmetic check of every item: one row each (:func:`pipeline.core.arithmetic.critique_steps`)."""
    from pipeline.core.arithmetic import VERSION, critique_steps

    t0 = time.perf_counter()
    rows = []
    for it in items:
        c = critique_steps([t or "" for t in it["steps"]])
        rows.append({"critic_model": "arithmetic", "template_version": VERSION, "include_gold_answer": False,
                     "item_id": it["id"], "n_steps": len(it["steps"]), "raw_text": c.text,
                     "wrong_steps": list(c.wrong_steps), "steps_judged": list(c.steps_judged),
                     "steps_wrong_lines": list(c.wrong_steps), "parse_status": "complete", "source": "arithmetic"})
    return rows, {"seconds": round(time.perf_counter() - t0, 4)}


def _readout_rows(cfg: CriticEvalConfig, setup: str, items: list[dict]) -> tuple[list[dict], dict]:
    """The log-prob readout of every item: one row each with ``step_scores``
    (:func:`pipeline.stages.critique.readout_scores`); an item whose readout is not finite gets a
    ``readout_nonfinite`` row with null ``step_scores`` (no score, a parse failure in the scores)."""
    from pipeline.core.readout import READOUT_NONFINITE, nonfinite_text, readout_text
    from pipeline.stages.critique import ReadoutJob, readout_scores

    critic, gold = cfg.setups()[setup]
    model = resolve_model(critic.model, cfg)
    jobs = [ReadoutJob(it["problem"], list(it["steps"]), it["gold_answer"] if gold else None) for it in items]
    t0 = time.perf_counter()
    results, stats = readout_scores(model, critic.engine.dtype, critic.template, jobs, label=f"readout {setup}")
    thr = 0.5  # the list shown and stored, as training's readout rows; scoring applies logprob_threshold
    rows = []
    for it, (q, raw, cf) in zip(items, results):
        row = {"critic_model": model, "template_version": critic.template, "include_gold_answer": gold,
               "item_id": it["id"], "n_steps": len(it["steps"]), "source": "logprob"}
        if q is None:
            log.warning("[critique] %s: the log-prob readout of item %s is not finite; recorded as %s", setup,
                        it["id"], READOUT_NONFINITE)
            rows.append({**row, "raw_text": nonfinite_text(raw, cf), "wrong_steps": None, "steps_judged": None,
                         "steps_wrong_lines": None, "parse_status": READOUT_NONFINITE, "step_scores": None})
            continue
        rows.append({**row, "raw_text": readout_text(q, raw, cf, thr), "wrong_steps": [i for i, x in enumerate(q) if x > thr],
                     "steps_judged": list(range(len(q))), "steps_wrong_lines": [i for i, x in enumerate(q) if x > thr],
                     "parse_status": "complete", "step_scores": q})
    return rows, {**stats, "seconds": round(time.perf_counter() - t0, 3)}


def check_setup(cfg: CriticEvalConfig, setup: str) -> None:
    """Refuse a critic setup that ``cfg`` does not have.

    Raises:
        ValueError: ``setup`` is not one of ``cfg.setups()`` (names it and the valid ones).
    """
    if setup not in cfg.setups():
        raise ValueError(f"unknown setup {setup!r}; valid: {', '.join(cfg.setups())} (<critic name>+gold, "
                         "<critic name>+nogold, or the name alone for a check)")


def critique_stage(cfg: CriticEvalConfig, setup: str, force: bool = False) -> StageResult:
    """One setup's verdicts on every benchmark item -> ``critiques/<setup>.parquet``: ``n_max``
    sampled critiques per item (``llm``), or one readout / check row per item (``logprob``,
    ``arithmetic``).

    A served critic (the OpenAI engine) keeps each finished reply in :func:`replies_path` as it
    arrives, so a request that fails after its retries loses no other reply: running the stage
    again sends only the failed requests. The file is removed once the table is written.

    Raises:
        ValueError: unknown setup (:func:`check_setup`: names it and the valid ones).
        pipeline.engines.openai_engine.EngineReplyError: a served critic's request failed after its
            retries (names the requests; the finished replies are kept).
    """
    from pipeline.core.critique import (
        MALFORMED_REPLY,
        build_critique_messages,
        critique_regex,
        parse_critique,
        reply_tokens,
    )
    from pipeline.engines import make_engine

    check_setup(cfg, setup)
    critic, gold = cfg.setups()[setup]
    out, key = critique_path(cfg, setup), critique_key(cfg, setup)
    replies = replies_path(cfg, setup)
    if (res := check_outputs("critique", [out], key, force)).skipped:
        return res
    items = read_benchmark(cfg)
    t0 = time.perf_counter()
    base = {"eval_name": cfg.name, "setup": setup, "critique_idx": 0, "critic_tokens": 0, "finish_reason": None,
            "step_scores": None}
    if critic.source != "llm":
        made, stats = (_check_rows if critic.source == "arithmetic" else _readout_rows)(cfg, setup, items)
        rows, model = [{**base, **r} for r in made], made[0]["critic_model"] if made else critic.source
    else:
        model = resolve_model(critic.model, cfg)
        seed = int(np.random.default_rng([cfg.seed, zlib.crc32(setup.encode())]).integers(0, 2**31 - 1))
        engine = make_engine(model, critic.engine, seed=seed)
        if hasattr(engine, "reply_cache"):  # the OpenAI engine keeps finished replies across a failed request
            engine.reply_cache = replies
            engine.malformed_as_data = True  # a reply that stays malformed is a malformed_reply critique
        convs = [build_critique_messages(it["problem"], it["steps"], it["gold_answer"] if gold else None, critic.template)
                 for it in items]
        constraints = [critique_regex(len(it["steps"])) for it in items] if critic.structured_output else None
        try:
            gens = engine.generate(convs, cfg.n_max, critic.sampling, constraints=constraints)
        finally:
            stats = engine.stats.as_dict()
            engine.close()
        rows = []
        for it, gen in zip(items, gens):
            for k, s in enumerate(gen.samples):
                bad = getattr(s, "malformed", None)  # a served critic's reply that stayed malformed: data
                parsed = parse_critique("" if bad else s.text, len(it["steps"]))
                rows.append({**base, "item_id": it["id"], "critique_idx": k,
                             "critic_model": model, "template_version": critic.template, "include_gold_answer": gold,
                             "n_steps": len(it["steps"]), "raw_text": bad or s.text,
                             "wrong_steps": None if parsed.wrong_steps is None else list(parsed.wrong_steps),
                             "steps_judged": list(parsed.judged), "steps_wrong_lines": list(parsed.wrong_by_lines),
                             "parse_status": MALFORMED_REPLY if bad else parsed.status,
                             "critic_tokens": 0 if bad else reply_tokens(s),
                             "finish_reason": None if bad else s.finish_reason, "source": "llm"})
    secs = time.perf_counter() - t0
    log.info("[critique] %s: %s", setup, json.dumps(stats))
    man = storage.write_table(pa.Table.from_pylist(rows, schema=CRITIC_EVAL_CRITIQUES_SCHEMA), out,
                              "critic_eval_critiques", stage="critique", key=key, extra={"elapsed_s": round(secs, 3), "engine": stats,
                                                         "critic": model, "setup": setup, "source": critic.source})
    replies.unlink(missing_ok=True)  # the table holds them now
    return StageResult("critique", str(out), False, "sampled" if critic.source == "llm" else "scored", man["rows"], secs)


# -------------------------------------------------------------------------------------------- score
def _seconds_per_token(manifest: dict) -> float:
    eng = manifest.get("engine") or {}
    toks, secs = eng.get("generated_tokens") or 0, eng.get("seconds") or 0.0
    return secs / toks if toks else math.nan


def _eval_items(items: list[dict], crit: list[dict], setup: str, partial: str = "list", n_max: int = 1):
    """The benchmark items with their critiques as votes (:func:`pipeline.core.critique.critique_votes`
    under the ``partial`` policy; None = the critique does not vote). A check's single row per item
    (``logprob``, ``arithmetic``) stands for every N: it is repeated ``n_max`` times, with the
    readout's ``step_scores``."""
    from critic_eval.scores import EvalItem
    from pipeline.core.critique import critique_votes

    by: dict[str, list[dict]] = {}
    for c in crit:
        by.setdefault(c["item_id"], []).append(c)
    out = []
    for it in items:
        cs = sorted(by.get(it["id"], []), key=lambda c: c["critique_idx"])
        if not cs:
            raise ValueError(f"setup {setup!r} has no critiques of item {it['id']!r}; run its critique stage again")
        scores = None
        if (cs[0].get("source") or "llm") != "llm":
            cs = cs[:1] * n_max
            scores = None if cs[0].get("step_scores") is None else tuple(float(x) for x in cs[0]["step_scores"])
        out.append(EvalItem(it["label"], len(it["steps"]),
                            tuple(critique_votes(c["parse_status"], c["wrong_steps"], c["steps_wrong_lines"], partial)
                                  for c in cs),
                            tuple(int(c["critic_tokens"] or 0) for c in cs),
                            None if it["step_labels"] is None else tuple(it["step_labels"]), scores))
    return out


def score_key(cfg: CriticEvalConfig) -> dict:
    fps = {s: (storage.read_manifest(critique_path(cfg, s)) or {}).get("fingerprint") for s in cfg.setups()}
    # "scores" names what the rows mean: a table written before per-kind subsets held their right twins
    # (or before the AUROC column) is recomputed
    return {"benchmark": _benchmark_fingerprint(cfg), "critiques": fps, "n_values": cfg.n_values,
            "majority_threshold": cfg.majority_threshold, "partial_critiques": cfg.partial_critiques,
            "scores": "kind-twins-v1", "unions": cfg.unions, "logprob_threshold": cfg.logprob_threshold}


def _setup_seconds_per_item(manifest: dict, n_items: int) -> float:
    """A check's seconds per item: its stage's elapsed seconds over the items (engine load included)."""
    secs = manifest.get("elapsed_s")
    return secs / n_items if secs is not None and n_items else math.nan


def score_stage(cfg: CriticEvalConfig, unit: None = None, force: bool = False) -> StageResult:
    """Score every setup and union, subset, rule and N -> ``scores.parquet`` and ``predictions.parquet``.

    Subsets (:func:`critic_eval.scores.subsets`): ``all``, ``plain`` / ``adversarial``, and each
    kind with the all-right twins of its problems, so F1 is defined per kind."""
    from critic_eval.scores import predict, score_grid, subsets
    from pipeline.core.voting import VOTING_RULES

    p = paths(cfg)
    key = score_key(cfg)
    if (res := check_outputs("score", [p["scores"], p["predictions"]], key, force)).skipped:
        return res
    t0 = time.perf_counter()
    items = read_benchmark(cfg)
    groups = subsets([it["kind"] for it in items], [it["label"] for it in items], [it.get("source_id") for it in items])
    scores, preds = [], []
    evals_by: dict[tuple[str, str], list] = {}
    timing: dict[str, tuple[float, float]] = {}  # setup -> (seconds per token, seconds per item)
    for setup, (critic, _) in cfg.setups().items():
        path = critique_path(cfg, setup)
        man = storage.read_manifest(path)
        if man is None:
            raise FileNotFoundError(f"{path} is missing or uncommitted; run the critique stage of setup {setup!r} first")
        crit = storage.read_table(path, "critic_eval_critiques").to_pylist()
        pols = cfg.partial_critiques if critic.source == "llm" else cfg.partial_critiques[:1]
        for pol in pols:
            evals_by[(setup, pol)] = _eval_items(items, crit, setup, pol, cfg.n_max)
        timing[setup] = ((_seconds_per_token(man), math.nan) if critic.source == "llm"
                         else (math.nan, _setup_seconds_per_item(man, len(items))))
    for label, (members, partial) in cfg.scored_setups().items():
        ev = [evals_by[(m, partial if (m, partial) in evals_by else cfg.partial_critiques[0])] for m in members]
        evals = ev[0] if len(ev) == 1 else [tuple(parts) for parts in zip(*ev)]
        # a union costs its members together: its critiques' tokens at the sampled members' mean
        # seconds per token, plus the checks' seconds per item
        spts = [timing[m][0] for m in members if not math.isnan(timing[m][0])]
        spis = [timing[m][1] for m in members if not math.isnan(timing[m][1])]
        spt = float(np.mean(spts)) if spts else math.nan
        spi = float(sum(spis)) if spis else math.nan
        for subset, idx in groups.items():
            for s in score_grid([evals[i] for i in idx], cfg.n_values, tuple(VOTING_RULES), cfg.majority_threshold,
                                seconds_per_token=spt, logprob_threshold=cfg.logprob_threshold, seconds_per_item=spi):
                row = {k: None if isinstance(v, float) and math.isnan(v) else v  # undefined -> SQL NULL
                       for k, v in s.as_dict().items()}
                scores.append({"eval_name": cfg.name, "setup": label, "partial": partial, "subset": subset, **row})
        for it, e in zip(items, evals):
            for rule in VOTING_RULES:
                for n in cfg.n_values:
                    pr = predict(e, n, rule, cfg.majority_threshold, logprob_threshold=cfg.logprob_threshold)
                    preds.append({"eval_name": cfg.name, "setup": label, "partial": partial, "item_id": it["id"],
                                  "kind": it["kind"],
                                  "rule": rule, "n": n, "label": it["label"], "earliest_flagged": pr.earliest,
                                  "n_valid": pr.n_valid, "weights": pr.weights.tolist()})
    storage.write_table(pa.Table.from_pylist(preds, schema=CRITIC_EVAL_PREDICTIONS_SCHEMA), p["predictions"],
                        "critic_eval_predictions", stage="score", key=key)
    man = storage.write_table(pa.Table.from_pylist(scores, schema=CRITIC_EVAL_SCORES_SCHEMA), p["scores"],
                              "critic_eval_scores", stage="score", key=key, extra={"elapsed_s": round(time.perf_counter() - t0, 3)})
    return StageResult("score", str(p["scores"]), False, "scored", man["rows"], time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------- report
def verdict_distribution(critiques: list[dict], top: int = 5) -> dict:
    """What a setup's critics answered: critiques per parse status, and the ``top`` most common
    non-empty final lists with their share of the non-empty lists (a weak critic echoing a
    prompt's example shows as one list with most of the share)."""
    from collections import Counter

    statuses = Counter(c["parse_status"] for c in critiques)
    lists = Counter(str(list(c["wrong_steps"])) for c in critiques if c["wrong_steps"])
    n = sum(lists.values())
    return {"statuses": dict(statuses), "non_empty_lists": n,
            "top_lists": [[v, k, k / n] for v, k in lists.most_common(top)] if n else []}


def plot_f1(scores: list[dict], setups: list[str], subset: str, path: Path) -> Path:
    """PNG of ProcessBench F1 against N, one panel per setup, one line per voting rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(setups), 2)
    rows_ = math.ceil(len(setups) / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5 * cols, 3.6 * rows_), squeeze=False, sharey=True)
    for ax, setup in zip(axes.flat, setups):
        mine = [s for s in scores if s["setup"] == setup and s["subset"] == subset]
        for j, rule in enumerate(dict.fromkeys(s["rule"] for s in mine)):
            pts = sorted((s["n"], s["f1"]) for s in mine if s["rule"] == rule)
            ax.plot([n for n, _ in pts], [f for _, f in pts], marker="osD^v"[j % 5], linestyle=("-", "--", ":", "-.")[j % 4],
                    markersize=7 - j, label=rule)  # lines of rules that agree overlap: vary the style
        ax.set_xscale("log", base=2)
        ns = sorted({s["n"] for s in mine})
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(setup)
        ax.set_xlabel("N critiques voted")
        ax.set_ylabel("ProcessBench F1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(setups):]:
        ax.axis("off")
    fig.suptitle(f"Critic step-error F1 against N (subset: {subset})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def report_meta(cfg: CriticEvalConfig) -> dict:
    """What the report says besides the scores: the benchmark (its items per kind), each scored
    setup's critic (model, template, engine, sampling, critic seconds and tokens/s from its
    critiques' manifest) and each setup's :func:`verdict_distribution`. Reads the benchmark table
    and the critique tables' manifests; nothing is written.

    Raises:
        FileNotFoundError: the benchmark stage has not run.
    """
    p = paths(cfg)
    items = read_benchmark(cfg)
    kinds: dict[str, int] = {}
    for it in items:
        kinds[it["kind"]] = kinds.get(it["kind"], 0) + 1
    setups = []
    for label, (members, partial) in cfg.scored_setups().items():
        parts = []
        for setup in members:
            critic, gold = cfg.setups()[setup]
            man = storage.read_manifest(critique_path(cfg, setup)) or {}
            eng = man.get("engine") or {}
            s = critic.sampling
            llm = critic.source == "llm"
            parts.append({"model": critic.model or critic.source, "include_gold_answer": gold and critic.uses_gold,
                          "template": (critic.template if critic.uses_gold else "–")
                          + (" + structured" if critic.structured_output else "")
                          + ("" if llm else f" ({critic.source})"),
                          "engine": critic.engine.type if llm else ("transformers" if critic.source == "logprob" else "–"),
                          "sampling": f"T={s.temperature} top_p={s.top_p} max={s.max_tokens}" if llm else "–",
                          "critic_seconds": eng.get("seconds") if llm else man.get("elapsed_s"),
                          "tokens_per_s": eng.get("generated_tokens_per_s") if llm else None})
        row = parts[0] if len(parts) == 1 else {
            k: " ∪ ".join(str(x[k]) for x in parts) for k in ("model", "template", "engine", "sampling")}
        if len(parts) > 1:
            secs = [x["critic_seconds"] for x in parts]
            row.update(include_gold_answer=any(x["include_gold_answer"] for x in parts), tokens_per_s=None,
                       critic_seconds=None if any(v is None for v in secs) else sum(secs))
        setups.append({"setup": label, "partial": partial, **row})
    verdicts = {}
    for setup in cfg.setups():
        path = critique_path(cfg, setup)
        if path.is_file():
            verdicts[setup] = verdict_distribution(storage.read_table(path, "critic_eval_critiques").to_pylist())
    b = cfg.benchmark
    desc = (f"`{b.source}` ({b.split} split, {b.n_problems} problems, seed {cfg.seed})"
            if b.source == BUILTIN_BENCHMARK else f"`{b.source}`")
    meta = {"name": cfg.name, "benchmark": f"{desc}, {len(items)} items", "kinds": kinds,
            "n_values": cfg.n_values, "setups": setups, "verdicts": verdicts, "plot": p["plot"].name}
    return meta


def report_stage(cfg: CriticEvalConfig, unit: None = None, force: bool = False) -> StageResult:
    """``report.md`` and ``f1_vs_n.png`` from ``scores.parquet`` (always rewritten, cheap: ``force`` changes
    nothing; one per evaluation: ``unit`` is None)."""
    from critic_eval.scores import main_subset, render_report

    p = paths(cfg)
    t0 = time.perf_counter()
    scores = storage.read_table(p["scores"], "critic_eval_scores").to_pylist()
    meta = report_meta(cfg)
    plot_f1(scores, list(cfg.scored_setups()), main_subset(scores), p["plot"])
    tmp = p["report"].with_name(f".{p['report'].name}.{os.getpid()}.tmp")
    tmp.write_text(render_report(meta, scores))
    os.replace(tmp, p["report"])
    return StageResult("report", str(p["report"]), False, "written", len(scores), time.perf_counter() - t0)


def evidence_lines(cfg: CriticEvalConfig) -> list[dict]:
    """A finished evaluation as JSON-able lines, the evidence a figure in the docs links to: one
    ``{"kind": "run", ...}`` line (name, benchmark, items per kind, N values, the scoring settings and
    the machine the export ran on), one ``{"kind": "setup", ...}`` line per scored setup (its critic
    as the report shows it, its ``members`` for a union), one ``{"kind": "answers", ...}`` line per
    sampled-critique setup (parse statuses and most common final lists,
    :func:`verdict_distribution`) and one ``{"kind": "score", ...}`` line per row of
    ``scores.parquet`` (every setup, treatment of partial critiques, subset, rule and N). Undefined
    figures are ``null``.

    Raises:
        FileNotFoundError: the score stage has not run, or its table was scored under other settings
            than ``cfg`` (e.g. other ``n_values``): names the table and the command that rescores.
    """
    from pipeline.precision import bench_context

    p = paths(cfg)
    cur = storage.is_current(p["scores"], score_key(cfg))
    if not cur.current:
        raise FileNotFoundError(f"{cur.reason}: run `capo critic-eval run` with this config and these overrides "
                                "first (it rescores from the cached critiques)")
    meta = report_meta(cfg)

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    out = [{"kind": "run", "eval_name": cfg.name, "benchmark": meta["benchmark"], "kinds": meta["kinds"],
            "n_values": list(cfg.n_values), "seed": cfg.seed, "majority_threshold": cfg.majority_threshold,
            "logprob_threshold": cfg.logprob_threshold, "partial_critiques": list(cfg.partial_critiques),
            "include_gold_answer": list(cfg.include_gold_answer), "exported_on": bench_context()}]
    scored = cfg.scored_setups()
    for st in meta["setups"]:
        members, _ = scored[st["setup"]]
        out.append({"kind": "setup", "eval_name": cfg.name, **st, "members": list(members)})
    for setup, (critic, _) in cfg.setups().items():
        if critic.source == "llm" and setup in meta["verdicts"]:
            out.append({"kind": "answers", "eval_name": cfg.name, "setup": setup, **meta["verdicts"][setup]})
    out += [{"kind": "score", **r} for r in storage.read_table(p["scores"], "critic_eval_scores").to_pylist()]
    return [clean(x) for x in out]


# ------------------------------------------------------------------------------------------ records
def _critique_child(cfg: CriticEvalConfig, setup: str) -> list[str]:
    """The child process of one setup's critique stage (``python -m flows.critic_eval critique``)."""
    return ["-m", "flows.critic_eval", "critique", "--config", str(write_resolved_config(cfg)), "--setup", setup]


def _run_paths(cfg: CriticEvalConfig, unit: None) -> dict[str, Path]:
    return paths(cfg)


def get_stage(name: str) -> Stage:
    """The record of critic-eval stage ``name``.

    Raises:
        ValueError: unknown stage (lists the valid ones).
    """
    for st in STAGES:
        if st.name == name:
            return st
    raise ValueError(f"unknown critic-eval stage {name!r}; valid: {[st.name for st in STAGES]}")


STAGES = (
    Stage("benchmark", (), ("benchmark",), False, None, "critic_eval.stages:benchmark_stage", paths=_run_paths),
    Stage("critique", ("benchmark",), ("critiques",), True, critique_key, "critic_eval.stages:critique_stage",
          paths=lambda cfg, setup: {"critiques": critique_path(cfg, setup)}, units=lambda cfg: list(cfg.setups()),
          child_argv=_critique_child),
    Stage("score", ("critiques",), ("scores", "predictions"), False, None, "critic_eval.stages:score_stage",
          paths=_run_paths),
    Stage("report", ("scores",), ("report", "plot"), False, None, "critic_eval.stages:report_stage", paths=_run_paths),
)
"""critic-eval's stages in order, as records the round's runner runs (:func:`flows.runner.run_record`):
the benchmark once, the critique once per critic setup in a child process (a model's memory is
returned before the next loads), the score and the report once."""
