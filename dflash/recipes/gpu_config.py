"""The GPU recipe's settings: the `recipe` section of its preset (configs/demo-gpu.yaml, configs/demo-gpu-coder*.yaml;
GpuRecipe, read by load_recipe like the stages' sections, typed and checked field by field) and the bars its summary
checks (BARS, and CODER_BARS on HumanEval).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash.core.config import ConfigError, check, coerce_all, read_preset
from dflash.recipes.self_prompts import NAME as SELF
from dflash.recipes.sources import SOURCES

PRESET = "demo-gpu"


# The bars (DESIGN.md section 5), checked in the summary: tau on the in-source prompts, tau over n-gram lookup's on
# the same out-of-source prompts, the speed-up over the target alone on the in-source prompts (first eval dtype).
BARS = {"tau": 3.5, "out_of_source_tau_over_ngram": 2.0, "speedup": 2.0}
# the targets a recipe can name besides the bundled one ("": SmolLM2-135M-Instruct; dflash/recipes/coder_assets.py)
CODER_MODELS = ("", "0.5b", "1.5b")
# the coder recipe's bar on HumanEval (DESIGN.md section 5: a real ~1.5B target, tau >= 4 and >= 2.5x the target alone)
CODER_BARS = {"humaneval_tau": 4.0, "humaneval_speedup": 2.5}
# the drafter architectures a comparison can train beside DFlash's ("" = no comparison)
COMPARE_ARCHS = ("", "dflash2")


@dataclass
class GpuRecipe:
    """The `recipe` section of configs/demo-gpu.yaml."""

    heldout_percent: float = 5.0  # of conversations, chosen by a hash of the conversation id
    max_turns: int = 16  # messages kept per training conversation (user + assistant); 0 = all
    eval_max_turns: int = 0  # eval prompts end on a user turn within the first eval_max_turns messages; 0 = max_turns
    max_conversations: int = 0  # training conversations kept (the first ones after the split); 0 = all
    eval_prompts: int = 64
    eval_max_new_tokens: int = 96
    eval_dtypes: list = field(default_factory=lambda: ["bfloat16", "float32"])  # the first one gets n-gram lookup too
    later_dtype_prompts: int = 16  # prompts of the dtypes after the first (the float32 lossless check); 0 = eval_prompts
    # "dataset": one sample per user turn, its history as chitchat has it and only its answer regenerated (regenerate
    # --turns last): the target answering real conversations, as in the eval prompts; "target": one sample per
    # conversation, every answer regenerated after the target's own earlier ones (SmolLM2-135M then repeats its
    # first answer in 77-100% of the 4-grams of every later turn: BENCHMARKS.md, "GPU recipe")
    history: str = "dataset"
    # history "dataset": the messages of the data's history kept before each user turn (the last ones; 0 = all).
    # Bounds a sample's tokens, so that late turns of long conversations can be trained on (max_turns 0)
    history_messages: int = 0
    validation: bool = True  # regenerate + extract the held-out conversations too: train's --val-cache
    validation_conversations: int = 64  # held-out conversations of each source in the validation cache; 0 = all
    # the training mix, {source: share of the training samples} (dflash/recipes/sources.py names the sources): the
    # first source gives all its samples, the others as many as their share asks for (their pool repeated whole
    # when it is smaller); eval_prompts are split among them by share (the in-source set)
    sources: dict = field(default_factory=lambda: {"chitchat": 1.0})
    # the `self` source (dflash/recipes/self_prompts.py): user turns the target writes itself after its chat template's
    # user header, sampled once (seeded) before the data stage; kept: those that ended within self_prompt_tokens,
    # distinct
    self_prompts: int = 8192  # turns sampled (when `self` is in sources)
    self_prompt_tokens: int = 64
    self_temperature: float = 1.0
    self_top_p: float = 0.99
    self_seed: int = 0
    self_batch_size: int = 0  # rows sampled together; 0: regenerate's default (256 on GPU, 32 on CPU)
    heldout_source: str = ""  # a source kept whole out of training: the out-of-source eval set ("" = none)
    heldout_source_prompts: int = 0  # its prompts, taken round-robin over its categories; 0 = all
    # train while extracting: the validation data first, then `dflash train --follow` as a child process on the same
    # device beside the main extraction (dflash/pipeline.py says what sharing one GPU costs); false: one after the other
    follow: bool = False
    # the comparison (`dflash demo --compare dflash2`, dflash/recipes/compare.py): "" = none; dflash2 = a DFlash2
    # drafter trained after the DFlash one from the same cache (extracted with --last-hidden, the validation cache too)
    # for the same training time (train --time-budget = DFlash's), into run-dflash2/, and evaluated as it is; the
    # summary puts them side by side
    compare: str = ""
    # DFlash's optimizer steps in a comparison (0 = the train section's max_steps); DFlash2's provisional total, before
    # its time budget decides its steps
    compare_max_steps: int = 0
    # more out-of-source eval sets, {source: prompts (0 = all)}, each kept whole out of training and labelled with its
    # own `set` (the source's name) in the eval: the coder recipe's {humaneval: 0} (164 prompts) beside mt_bench
    eval_sources: dict = field(default_factory=dict)
    # the target: "" = the bundled SmolLM2-135M-Instruct; a model of dflash/recipes/coder_assets.py (0.5b, 1.5b) = that
    # Qwen2.5-Coder-Instruct GGUF, joined once by `make coder-assets` (the coder recipe, dflash/recipes/coder.py)
    coder_model: str = ""

    def __post_init__(self):
        check(0 < self.heldout_percent < 100, "heldout_percent", f"must be in (0, 100), got {self.heldout_percent}")
        check(self.max_turns == 0 or self.max_turns >= 2, "max_turns", f"must be 0 (all) or >= 2, got {self.max_turns}")
        check(self.eval_max_turns == 0 or self.eval_max_turns >= 1, "eval_max_turns",
              f"must be 0 (= max_turns) or >= 1, got {self.eval_max_turns}")
        check(self.max_conversations >= 0, "max_conversations", f"must be >= 0 (0 = all), got {self.max_conversations}")
        check(self.eval_prompts >= 1, "eval_prompts", f"must be >= 1, got {self.eval_prompts}")
        check(self.eval_max_new_tokens >= 1, "eval_max_new_tokens", "must be >= 1")
        check(self.history in ("dataset", "target"), "history", f"must be dataset or target, got {self.history!r}")
        check(self.history_messages >= 0 and self.history_messages % 2 == 0, "history_messages",
              f"must be an even number >= 0 (0 = the whole history; even: a sample starts on a user turn), "
              f"got {self.history_messages}")
        check(not self.history_messages or self.history == "dataset", "history_messages",
              "applies to history: dataset only (history: target regenerates every answer of a conversation)")
        check(self.validation_conversations >= 0, "validation_conversations", "must be >= 0 (0 = all)")
        check(self.later_dtype_prompts >= 0, "later_dtype_prompts", "must be >= 0 (0 = eval_prompts)")
        check(bool(self.eval_dtypes) and all(d in ("bfloat16", "float32") for d in self.eval_dtypes), "eval_dtypes",
              f"must be a non-empty list of bfloat16 / float32, got {self.eval_dtypes}")
        check(isinstance(self.sources, dict) and bool(self.sources), "sources",
              f"must map data sources to their shares, e.g. {{chitchat: 0.9, humaneval: 0.1}}, got {self.sources!r}")
        for name, share in self.sources.items():
            check(name in SOURCES or name == SELF, "sources",
                  f"{name!r} is not a data source (known: {', '.join([*SOURCES, SELF])})")
            check(isinstance(share, (int, float)) and not isinstance(share, bool) and share > 0, "sources",
                  f"the share of {name} must be a number > 0, got {share!r}")
        check(self.heldout_source == "" or self.heldout_source in SOURCES, "heldout_source",
              f"{self.heldout_source!r} is not a data source (known: {', '.join(SOURCES)})")
        check(self.heldout_source not in self.sources, "heldout_source",
              f"{self.heldout_source} is also a training source: an out-of-source set must be kept out of training")
        check(self.heldout_source_prompts >= 0, "heldout_source_prompts", "must be >= 0 (0 = all)")
        check(self.self_prompts >= 1, "self_prompts", f"must be >= 1, got {self.self_prompts}")
        check(self.self_prompt_tokens >= 1, "self_prompt_tokens", f"must be >= 1, got {self.self_prompt_tokens}")
        check(self.self_temperature > 0, "self_temperature",
              f"must be > 0 (greedy would write one turn {self.self_prompts} times), got {self.self_temperature}")
        check(0 < self.self_top_p <= 1, "self_top_p", f"must be in (0, 1], got {self.self_top_p}")
        check(self.compare in COMPARE_ARCHS, "compare",
              f"must be {' or '.join(repr(a) for a in COMPARE_ARCHS)} (none), got {self.compare!r}")
        check(self.compare_max_steps >= 0, "compare_max_steps", "must be >= 0 (0 = the train section's max_steps)")
        check(self.self_batch_size >= 0, "self_batch_size", "must be >= 0 (0 = the default)")
        check(isinstance(self.eval_sources, dict), "eval_sources",
              f"must map sources to their prompts (0 = all), e.g. {{humaneval: 0}}, got {self.eval_sources!r}")
        for name, n in self.eval_sources.items():
            check(name in SOURCES, "eval_sources", f"{name!r} is not a data source (known: {', '.join(SOURCES)})")
            check(name not in self.sources and name != self.heldout_source, "eval_sources",
                  f"{name} is also a training source or the heldout_source: an eval set of its own is kept out of "
                  "training and out of the other sets")
            check(isinstance(n, int) and not isinstance(n, bool) and n >= 0, "eval_sources",
                  f"the prompts of {name} must be an integer >= 0 (0 = all), got {n!r}")
        check(self.coder_model in CODER_MODELS, "coder_model",
              f"must be {' or '.join(repr(m) for m in CODER_MODELS)} (\"\": the bundled SmolLM2), "
              f"got {self.coder_model!r}")


def load_recipe(preset: str = PRESET) -> GpuRecipe:
    fields = read_preset(preset, "recipe")
    known = set(GpuRecipe.__dataclass_fields__)
    bad = sorted(set(fields) - known)
    if bad:
        raise ConfigError(f"--config: unknown key {bad[0]!r} in the recipe section of {preset} "
                          f"(known: {', '.join(sorted(known))})")
    return GpuRecipe(**coerce_all(GpuRecipe, fields, preset))  # typed as the stages' presets are


# Seconds of each stage of the GPU recipe on one H200 from nothing (2026-12-03, the preset with 192-token self prompts,
# follow, and the target decoding in CUDA graphs: 13 min 51 s with both evals; "train" is what training took after the
# extraction it ran beside). BENCHMARKS.md, "GPU recipe". What is shown is each stage's share of the whole.
GPU_STAGE_SECONDS = {"prepare target": 15.0, "self prompts": 46.0, "data": 4.0, "regenerate": 134.0, "extract": 62.0,
                     "validation data": 37.0, "train": 469.0, "eval bfloat16": 46.0, "eval float32": 9.0}
# What the measured preset sampled: its `self` prompts and self's share of the mix. The first source gives all of its
# samples and the others their shares of the total, so a preset's training samples scale as self_prompts / self's
# share (data_scale).
MEASURED_SELF_PROMPTS, MEASURED_SELF_SHARE = 49152, 0.5


def data_scale(recipe: GpuRecipe) -> float:
    """A GPU preset's training samples against the measured preset's (GPU_STAGE_SECONDS): self_prompts / self's share
    of the mix, against 49,152 / 0.5; 1.0 for a mix without `self` or with another first source (not estimated)."""
    names = list(recipe.sources)
    if not names or names[0] != SELF:
        return 1.0
    share = recipe.sources[SELF] / sum(recipe.sources.values())
    return (recipe.self_prompts / share) / (MEASURED_SELF_PROMPTS / MEASURED_SELF_SHARE)
