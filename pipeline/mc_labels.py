"""Step labels of the policy's own responses from Monte Carlo values, as a critic-eval benchmark.

A round trained with ``reward.estimator: vineppo`` holds the value of every state of its responses
(``mc_values.parquet``). :func:`mc_label_records` turns each fully valued response into a
ProcessBench record whose ``label`` is the first step that lowers the value by at least ``drop``
(:func:`pipeline.core.mc.first_error_from_values`), so ``capo critic-eval run --benchmark FILE``
scores a critic on the errors the policy really makes, not only on planted ones.
"""

from __future__ import annotations

import pyarrow.parquet as pq

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.core.mc import first_error_from_values, leave_one_out_means
from pipeline.stages.base import prompts_path, round_paths
from pipeline.stages.mc import read_state_values


def mc_label_records(cfg: CAPOConfig, round_idx: int, drop: float = 0.5) -> list[dict]:
    """ProcessBench records (``id``, ``problem``, ``steps``, ``label``, ``gold_answer``, ``kind = 'mc'``,
    ``step_values``) of round ``round_idx``'s responses whose every state was valued (``N >= 2`` steps and
    ``N <= mc.max_states``), in rollouts-table order. ``V(S_0)`` is the group's other outcomes' mean, as
    the vineppo estimator reads it. A wrong answer whose values never fall by ``drop`` has an error no
    step can be blamed for: it is left out (labelling it -1, every step right, would be false).

    Raises:
        FileNotFoundError: the round has no committed ``mc_values`` (or rollouts, steps, outcomes) table.
        ValueError: ``drop`` outside (0, 1].
    """
    p = round_paths(cfg, round_idx)
    if storage.read_manifest(p["mc_values"]) is None:
        raise FileNotFoundError(f"{p['mc_values']} is not committed: run round {round_idx} with "
                                "reward.estimator=vineppo (preset vineppo) first")
    ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_id"]).to_pylist()
    oc = {r["rollout_id"]: float(r["outcome_correct"])
          for r in storage.read_table(p["outcomes"], "outcomes").select(["rollout_id", "outcome_correct"]).to_pylist()}
    steps: dict[str, list[tuple[int, str]]] = {}
    for r in storage.read_table(p["steps"], "steps").select(["rollout_id", "step_idx", "step_text"]).to_pylist():
        steps.setdefault(r["rollout_id"], []).append((r["step_idx"], r["step_text"]))
    vals = read_state_values(p["mc_values"])
    prompts = {r["prompt_id"]: r for r in pq.read_table(prompts_path(cfg), columns=["prompt_id", "question", "gold_answer"]).to_pylist()}
    groups = {pid: i for i, pid in enumerate(dict.fromkeys(r["prompt_id"] for r in ro))}
    v0 = leave_one_out_means([oc[r["rollout_id"]] for r in ro], [groups[r["prompt_id"]] for r in ro])
    out = []
    for r, first in zip(ro, v0):
        rid = r["rollout_id"]
        texts = [t for _, t in sorted(steps.get(rid, []))]
        have = vals.get(rid, {})
        if len(texts) < 2 or sorted(have) != list(range(1, len(texts))):
            continue  # not every state valued (past mc.max_states, or one step only)
        values = [float(first)] + [have[k] for k in range(1, len(texts))]
        label = first_error_from_values(values, oc[rid], drop)
        if label < 0 and oc[rid] < 1:
            continue  # wrong, and no step lowered the value by drop: the error has no place
        pr = prompts[r["prompt_id"]]
        out.append({"id": rid, "problem": pr["question"], "steps": texts, "gold_answer": pr["gold_answer"],
                    "label": label, "kind": "mc", "step_values": values + [oc[rid]]})
    return out
