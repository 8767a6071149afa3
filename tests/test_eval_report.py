"""`dflash eval`'s report: one JSON schema on every run (train/evaluate/eval.py's docstring), and the figures of each set
and category of prompts (rows with `set` / `category`), as `dflash demo` prints them for its in-source and
out-of-source prompts:

  * a group's figures are its own prompts' (tau = accepted tokens over steps, speed-up against the target on the
    same prompts, identical outputs), checked on hand-built decodes with known numbers;
  * on a tiny target through the CLI: the keys and types of the schema, groups that add up to the whole, a
    category's figures equal to an eval of its prompts alone, and the printed table.
"""

import json
import os
import re
import sys

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, os.path.dirname(__file__))
from tiny import make_tiny_target, write_jsonl  # noqa: E402

from dflash.train.evaluate.decode import Decode
from dflash.train.evaluate.eval import SCHEMA, format_groups, group_method, groups


def dec(tokens, accepts, seconds):
    return Decode(list(tokens), accept_lengths=list(accepts), seconds=seconds)


def test_groups_aggregate_their_own_prompts_with_known_numbers():
    # 4 prompts; target: 1 token a step; dflash and ngram: accept lengths chosen by hand
    runs = {
        "target": [dec([1, 2, 3, 4], [1, 1, 1], 2.0), dec([5, 6], [1], 1.0), dec([7, 8, 9], [1, 1], 3.0),
                   dec([1, 1, 1, 1, 1], [1, 1, 1, 1], 5.0)],
        "dflash": [dec([1, 2, 3, 4], [3], 0.5), dec([5, 7], [1], 1.0), dec([7, 8, 9], [2], 1.0),
                   dec([1, 1, 1, 1, 1], [4], 1.0)],
        "ngram": [dec([1, 2, 3, 4], [1, 2], 1.0), dec([5, 6], [1], 0.5), dec([7, 8, 9], [1, 1], 2.0),
                  dec([1, 1, 1, 1, 1], [2, 2], 2.5)],
    }
    labels = [{"set": "in", "category": "a"}, {"set": "in", "category": "b"}, {"set": "out", "category": "a"},
              {"set": "out", "category": None}]
    sets, cats = groups(runs, labels)
    assert list(sets) == ["in", "out"] and list(cats) == ["a", "b"]
    g = sets["in"]  # prompts 0, 1
    assert g["prompts"] == 2
    assert g["target"] == {"tau": 1.0, "speedup": 1.0, "tokens_per_s": 2.0, "identical": 2, "prompts": 2,
                           "tokens": 6, "steps": 4, "seconds": 3.0}
    assert g["dflash"] == {"tau": 2.0, "speedup": pytest.approx(2.0), "tokens_per_s": 4.0, "identical": 1,
                           "prompts": 2, "tokens": 6, "steps": 2, "seconds": 1.5}  # (3 + 1) / 2 steps; 6 tok / 1.5 s
    assert g["ngram"]["tau"] == pytest.approx(4 / 3) and g["ngram"]["speedup"] == pytest.approx(4.0 / 2.0)
    assert g["ngram"]["identical"] == 2 and g["tau_over_ngram"] == pytest.approx(2.0 / (4 / 3))
    assert list(g["categories"]) == ["a", "b"] and g["categories"]["b"]["dflash"]["identical"] == 0
    o = sets["out"]  # prompts 2, 3 (3 has no category: in the set, in no category)
    assert o["dflash"]["tau"] == 3.0 and o["dflash"]["steps"] == 2 and o["dflash"]["tokens"] == 8
    assert o["target"]["tokens_per_s"] == 1.0 and o["dflash"]["speedup"] == pytest.approx(4.0)
    assert list(o["categories"]) == ["a"] and o["categories"]["a"]["prompts"] == 1
    a = cats["a"]  # prompts 0 and 2, across both sets
    assert a["dflash"]["tau"] == pytest.approx((3 + 2) / 2) and a["ngram"]["tau"] == pytest.approx(5 / 4)
    assert a["target"]["tokens_per_s"] == pytest.approx(7 / 5) and a["dflash"]["tokens_per_s"] == pytest.approx(7 / 1.5)
    assert "categories" not in a
    # without n-gram lookup (the GPU recipe's float32 run): the table has no n-gram columns
    no_ngram = {k: v for k, v in runs.items() if k != "ngram"}
    s2, c2 = groups(no_ngram, labels)
    table = format_groups({"sets": s2, "categories": c2, "prompts": 4, "dflash": {"tau": 2.5, "speedup": 2.0,
                                                                                    "identical": 3}})
    assert "n-gram" not in table and s2["in"]["tau_over_ngram"] is None
    assert table.splitlines()[-1].split() == ["all", "prompts", "4", "2.50", "2.00x", "3/4"]
    # without labels: no groups, no table
    assert groups(runs, [{"set": None, "category": None}] * 4) == ({}, {})
    assert format_groups({"sets": {}, "categories": {}}) == ""
    # a method that never ran a step (empty outputs) has tau 1 and no division by zero
    empty = group_method([dec([], [], 0.0)], [dec([], [], 0.0)], 0.0)
    assert empty["tau"] == 1.0 and empty["speedup"] == 0.0 and empty["identical"] == 1


METHOD_KEYS = {"name": str, "tau": float, "speedup": float, "tokens_per_s": float, "identical": int, "prompts": int,
               "tokens": int, "steps": int, "seconds": float, "tau_per_prompt": list, "accept_length_hist": list,
               "slot_accept_rate": list, "time_s": dict, "ms_per_step": dict}
SPEC_KEYS = {"outputs_identical": int, "output_match_rate": float, "token_match_rate": float, "differences": dict}
GROUP_METHOD_KEYS = {"tau": float, "speedup": float, "tokens_per_s": float, "identical": int, "prompts": int,
                     "tokens": int, "steps": int, "seconds": float}


def check_keys(obj, spec, where):
    for k, t in spec.items():
        assert k in obj, f"{where}: no {k}"
        ok = isinstance(obj[k], (int, float)) and not isinstance(obj[k], bool) if t is float else isinstance(obj[k], t)
        assert ok, f"{where}.{k}: {type(obj[k]).__name__}, not {t.__name__}"


def check_group(g, where, ngram=True):
    assert set(g) >= {"prompts", "target", "dflash", "tau_over_ngram"} and isinstance(g["prompts"], int)
    for m in ("target", "dflash") + (("ngram",) if ngram else ()):
        assert set(g[m]) == set(GROUP_METHOD_KEYS), f"{where}.{m}"
        check_keys(g[m], GROUP_METHOD_KEYS, f"{where}.{m}")
        assert g[m]["prompts"] == g["prompts"]
    assert g["target"]["tau"] == 1.0 and g["target"]["speedup"] == 1.0 and g["target"]["identical"] == g["prompts"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash.train.drafter.checkpoint import save_drafter
    from dflash.train.drafter.model import DFlashDrafter, DrafterConfig
    from dflash.core.target import load_config

    d = tmp_path_factory.mktemp("report")
    target = make_tiny_target(str(d / "target"), arch="qwen3", num_layers=4, hidden=64)
    cfg = DrafterConfig.from_target(load_config(target), num_layers=1, layer_ids=[1, 2], block_size=4,
                                    mask_token_id=load_config(target).vocab_size - 1)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), str(d / "drafter"), dtype=torch.float32)
    # two sets, categories within each; repeated words so that lookup finds n-grams
    words = ["alpha beta gamma", "one two three one two", "red green blue red", "x y z x y z", "cat dog cat"]
    rows = []
    for i in range(8):
        s, c = ("in-source", ["chat", "code"][i % 2]) if i < 4 else ("out-of-source", ["writing", "math"][i % 2])
        rows.append({"messages": [{"role": "user", "content": f"{words[i % 5]} {words[(i + 2) % 5]} {i}"}],
                     "set": s, "category": c})
    return {"dir": d, "target": target, "drafter": str(d / "drafter"), "rows": rows,
            "data": write_jsonl(d / "p.jsonl", rows)}


def run_cli(tiny, data, out, *extra):
    from dflash.cli import main

    r = CliRunner().invoke(main, ["eval", "--target", tiny["target"], "--drafter", tiny["drafter"], "--data", data,
                                  "--max-new-tokens", "10", "--dtype", "float32", "--device", "cpu", "--json", str(out),
                                  "--no-progress", *extra], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output, json.loads(out.read_text())


def test_eval_report_schema_and_groups_on_a_tiny_target(tiny, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    text, rep = run_cli(tiny, tiny["data"], tiny["dir"] / "eval.json", "--chat-template-kwargs", "enable_thinking=false")
    assert rep["schema"] == SCHEMA and rep["prompts"] == 8
    # the harness settings a serving benchmark must match, in the JSON and the printed report
    assert rep["harness"] == {"decoding": "greedy", "temperature": 0.0, "block_size": 4, "max_new_tokens": 10,
                              "stop_at_eos": True, "chat_template_kwargs": {"enable_thinking": False},
                              "enable_thinking": False}
    assert ('harness: greedy (temperature 0), block 4, at most 10 new tokens, stop at EOS, chat template kwargs '
            '{"enable_thinking": false}') in text
    for k in ("config", "device", "dtype", "block_size", "drafter_layers", "draft_graph", "target_attention",
              "target_tokens_per_s", "target_tokens", "tau_gain_over_ngram", "sets", "categories"):
        assert k in rep, k
    for m in ("target", "dflash", "ngram"):
        check_keys(rep[m], METHOD_KEYS, m)
        assert rep[m]["prompts"] == 8
    for m in ("dflash", "ngram"):
        check_keys(rep[m], SPEC_KEYS, m)
        assert rep[m]["identical"] == rep[m]["outputs_identical"] == 8  # lossless in float32
    assert rep["target"]["speedup"] == 1.0 and rep["target"]["identical"] == 8 and rep["target"]["tau"] == 1.0
    # the schema's description (train/evaluate/eval.py's docstring, which `eval --help` points to) names every key it writes
    from dflash.train.evaluate import eval as ev
    named = set(re.findall(r"[a-z_]+", ev.__doc__[ev.__doc__.index("The JSON report"):]))
    g = rep["sets"]["in-source"]
    keys = set(rep) | set(rep["dflash"]) | set(rep["target"]) | set(g) | set(g["dflash"])
    assert keys - named == set(), f"keys of the report not described in train/evaluate/eval.py: {sorted(keys - named)}"
    # groups: the sets in the data's order, their categories, and categories over all prompts
    assert list(rep["sets"]) == ["in-source", "out-of-source"]
    assert list(rep["sets"]["in-source"]["categories"]) == ["chat", "code"]
    assert list(rep["sets"]["out-of-source"]["categories"]) == ["writing", "math"]
    assert list(rep["categories"]) == ["chat", "code", "writing", "math"]
    for s, g in rep["sets"].items():
        check_group(g, s)
        for c, cg in g["categories"].items():
            check_group(cg, f"{s}.{c}")
            assert cg == rep["categories"][c]  # each category lies in one set here
    # the groups add up to the whole: prompts, tokens, steps, identical; tau is the step-weighted mean
    for m in ("target", "dflash", "ngram"):
        parts = [g[m] for g in rep["sets"].values()]
        for k in ("prompts", "tokens", "steps", "identical"):
            assert sum(p[k] for p in parts) == rep[m][k], (m, k)
        assert sum(p["tau"] * p["steps"] for p in parts) / rep[m]["steps"] == pytest.approx(rep[m]["tau"])
        cats = list(rep["categories"].values())
        assert sum(c[m]["steps"] for c in cats) == rep[m]["steps"]
        assert sum(c[m]["tau"] * c[m]["steps"] for c in cats) == pytest.approx(rep[m]["tau"] * rep[m]["steps"])
    # the printed table: one line per set and per category in it, then all prompts
    lines = text.splitlines()
    head = next(i for i, x in enumerate(lines) if x.split()[:2] == ["prompts", "dflash"])
    end = next((i for i in range(head, len(lines)) if not lines[i].strip()), len(lines))
    labels = [re.match(r"\s*\S+(?: \S+)*", x).group(0) for x in lines[head + 1:end]]
    assert labels == ["in-source", "  chat", "  code", "out-of-source", "  writing", "  math", "all prompts"]
    g = rep["sets"]["out-of-source"]
    assert f"{g['dflash']['tau']:.2f}" in lines[head + 4] and f"{g['ngram']['tau']:.2f}" in lines[head + 4]
    assert f"{g['dflash']['identical']}/4" in lines[head + 4]


def test_a_categorys_figures_are_an_eval_of_its_prompts_alone(tiny, monkeypatch):
    """Decoding is deterministic (float32, greedy): the 'code' category's tau, steps, tokens and identical
    outputs in the whole eval are exactly those of an eval of its prompts alone."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _, whole = run_cli(tiny, tiny["data"], tiny["dir"] / "whole.json")
    alone = write_jsonl(tiny["dir"] / "code.jsonl", [r for r in tiny["rows"] if r["category"] == "code"])
    _, part = run_cli(tiny, alone, tiny["dir"] / "code.json")
    g = whole["categories"]["code"]
    assert g["prompts"] == part["prompts"] == 2  # rows 1 and 3
    for m in ("target", "dflash", "ngram"):
        for k in ("tau", "steps", "tokens", "identical"):
            assert g[m][k] == part[m][k], (m, k)
    assert part["sets"] == {"in-source": part["sets"]["in-source"]} and list(part["categories"]) == ["code"]


def test_prompts_are_decoded_round_robin_over_their_groups_and_reported_in_the_datas_order():
    """The eval's bar measures its rate on a mix from the first prompts on (16 short chitchat prompts before 4 long
    MT-Bench ones made its first ETA 12.7x too low); every prompt is decoded once."""
    from dflash.train.evaluate.eval import decode_order

    labels = [{"set": "in-source", "category": "chitchat"}] * 16 + [{"set": "out-of-source", "category": c}
                                                                    for c in ("writing", "math", "coding", "stem")]
    order = decode_order(labels)
    assert sorted(order) == list(range(20))
    assert order[:5] == [0, 16, 17, 18, 19]  # one of each group first
    assert order[5:] == list(range(1, 16))  # then the rest of the only group left, in the data's order
    assert decode_order([{"set": None, "category": None}] * 3) == [0, 1, 2]
