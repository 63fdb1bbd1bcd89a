"""The stage registry: one record per stage that the runner, the keys, the
not-applicable rules, the outputs and the heavy set all read."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.stages import HEAVY_STAGES, REGISTRY, STAGES, get_stage
from pipeline.stages.base import round_paths


def test_registry_holds_the_round_in_order():
    assert list(REGISTRY) == ["rollout", "verify", "segment", "mc", "densr", "critique", "vote", "reward", "train",
                              "eval"]
    assert STAGES == ("rollout", "verify", "segment", "mc", "densr", "critique", "vote", "reward", "train")
    assert HEAVY_STAGES == ("rollout", "mc", "densr", "critique", "train", "eval")


def test_every_stage_names_real_tables_and_a_real_function(repo, tmp_path):
    cfg = load_config(repo / "configs" / "tiny.yaml", [f"runs_dir={tmp_path}"])
    names = set(round_paths(cfg, 1))
    produced = set()
    for stage in REGISTRY.values():
        assert set(stage.inputs) <= names and set(stage.outputs) <= names, stage.name
        assert set(stage.inputs) <= produced, f"{stage.name} reads a table no earlier stage writes"
        produced |= set(stage.outputs)
        fn = stage.load()
        assert callable(fn) and fn.__name__ == f"{stage.name}_stage"


def test_not_applicable_rules_follow_the_config(repo, tmp_path):
    base = [f"runs_dir={tmp_path}"]
    capo = load_config(repo / "configs" / "tiny.yaml", base)
    grpo = load_config(repo / "configs" / "tiny.yaml", base, preset="grpo")
    genorm = load_config(repo / "configs" / "tiny.yaml", base, preset="grpo-genorm")
    vine = load_config(repo / "configs" / "tiny.yaml", base, preset="vineppo")
    densr = load_config(repo / "configs" / "tiny.yaml", base, preset="densr")
    no_eval = load_config(repo / "configs" / "tiny.yaml", [*base, "eval.enabled=false"])
    # Monte Carlo values: VinePPO only; hidden-state divergences: DenseR only
    assert {n for n, s in REGISTRY.items() if s.not_applicable(capo)} == {"mc", "densr"}
    assert {n for n, s in REGISTRY.items() if s.not_applicable(grpo)} == {"mc", "densr", "critique", "vote"}
    assert {n for n, s in REGISTRY.items() if s.not_applicable(genorm)} == {"mc", "densr", "vote"}
    assert {n for n, s in REGISTRY.items() if s.not_applicable(vine)} == {"densr", "critique", "vote"}
    assert {n for n, s in REGISTRY.items() if s.not_applicable(densr)} == {"mc", "critique", "vote"}
    assert "eval.enabled is false" in get_stage("eval").not_applicable(no_eval)


def test_an_unknown_stage_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown stage 'votes'.*'vote'"):
        get_stage("votes")


def test_each_stage_is_one_module_that_declares_its_record():
    """Adding a stage touches one module (plus its name in the registry): ``pipeline/stages/<name>.py``
    declares the record and holds the key and the function (the train stage's library, the update
    loop on tensors, lives in ``train/``, which imports no stage)."""
    import importlib

    for name, stage in REGISTRY.items():
        module = importlib.import_module(f"pipeline.stages.{name}")
        assert module.STAGE is stage, name
        assert stage.key.__module__ == module.__name__, name
        assert stage.function.split(":")[0] == module.__name__ and stage.load().__module__ == module.__name__, name


def test_the_runner_reads_records_not_names():
    """The runner, the CLI and the Prefect flows know stages only through their records (environment,
    launcher, fan-out and rounds are fields): no string in them is a stage's name. ``flows/fanout.py``
    (the critique shards on a cluster, configured by ``scale.critique``) reaches its stage through
    the critique stage's record; ``flows/critic_eval.py`` is checked in the next test."""
    import ast

    from tests.conftest import REPO

    for module in ("runner", "cli", "round", "children", "artifacts", "fanout"):
        tree = ast.parse((REPO / "flows" / f"{module}.py").read_text())
        named = [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in REGISTRY]
        assert not named, f"flows/{module}.py names stages at {named}"


def test_critic_eval_runs_its_records_through_the_rounds_runner():
    """critic-eval's stages are :class:`Stage` records run by :func:`flows.runner.run_record`, the
    round's runner: its flow module names none of them, and each record's function, key and child
    command are where the record says."""
    import ast

    from critic_eval import stages as ces
    from tests.conftest import REPO

    names = {st.name for st in ces.STAGES}
    assert [st.name for st in ces.STAGES] == ["benchmark", "critique", "score", "report"]
    tree = ast.parse((REPO / "flows" / "critic_eval.py").read_text())
    paths = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}  # p["report"]: an output path
    paths |= {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys}  # {"report": ...}
    named = [(n.lineno, n.value) for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and n.value in names and id(n) not in paths]
    assert not named, f"flows/critic_eval.py names critic-eval stages at {named}"
    for st in ces.STAGES:
        assert st.load().__module__ == "critic_eval.stages" and st.load().__name__ == f"{st.name}_stage"
    crit = ces.get_stage("critique")
    assert crit.heavy and crit.key is ces.critique_key and [s.heavy for s in ces.STAGES].count(True) == 1
    with pytest.raises(ValueError, match="unknown critic-eval stage 'scores'; valid: .*'score'"):
        ces.get_stage("scores")


def test_round_plan_follows_each_stages_rounds():
    from pipeline.stages import round_plan

    train = [(n, 1) for n in REGISTRY if n != "eval"]
    assert round_plan(1) == train + [("eval", 0), ("eval", 1)]  # round 1 also evaluates the starting policy
    assert round_plan(3) == [(n, 3) for n in REGISTRY if n != "eval"] + [("eval", 3)]
    assert REGISTRY["eval"].batch_invariant and REGISTRY["train"].launch_module == "pipeline.stages.train_launch"
    assert [n for n, s in REGISTRY.items() if s.engine_env] == ["rollout", "mc", "densr", "critique", "train", "eval"]
    assert [n for n, s in REGISTRY.items() if s.shard_function] == ["critique"]
