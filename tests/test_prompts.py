"""`dflash prompts` (extract/generation/prompts.py): user turns the target writes itself, for `dflash regenerate` to answer.

  * the output: OUT/prompts.jsonl (the kept turns, in row order, as plain one-user-turn conversations)
    and its record OUT/dflash_prompts.json (settings, the target's identity, counts adding up to --num);
  * a row's text depends on neither the part nor the batch it was sampled in: any --part-size and --batch-size give
    the same turns (the streams are keyed by row);
  * killed between two parts, a rerun samples only the parts not written and ends with the same file; a finished
    output is not sampled again; another setting is one error line naming it; --overwrite starts over;
  * `dflash regenerate --data OUT` answers the turns; an unfinished output given as --data is named, not read.
Bad flags and paths of the command are in tests/test_hostile_input.py's tables.
"""

import json
import os

import pytest

from dflash.extract.generation.prompts import PARTS_DIR, PROMPTS_FILE, PromptsConfig, run_prompts
from tests.test_trust import cli, error_line, ok
from tests.tiny import make_tiny_target

NUM, TOKENS = 40, 40  # the tiny target ends about a fifth of its turns within 40 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("prompts") / "target")


def run(tiny, out, *more):
    return ok("prompts", "--target", tiny, "--out", out, "--num", NUM, "--max-new-tokens", TOKENS, "--device", "cpu",
              "--no-progress", *more)


def lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def record(out):
    with open(os.path.join(out, "dflash_prompts.json"), encoding="utf-8") as f:
        return json.load(f)


def test_prompts_are_kept_by_rule_and_the_same_in_any_part_or_batch(tiny, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    out = run(tiny, a, "--part-size", 1000, "--batch-size", 40)
    run(tiny, b, "--part-size", 7, "--batch-size", 3)
    rows, rec = lines(a / PROMPTS_FILE), record(a)
    assert rows == lines(b / PROMPTS_FILE)  # 6 parts of 7 rows in batches of 3 = one part of 40 in one batch
    assert rec["complete"] and rec["sampled"] == NUM and rec["kept"] == len(rows) >= 3
    assert rec["kept"] + sum(rec["dropped"].values()) == NUM and rec["dropped"]["not_ended"] > 0
    assert rec["settings"]["num"] == NUM and rec["target"]["config"] and rec["prefix"].endswith("<|im_start|>user\n")
    texts = [r["messages"][0]["content"] for r in rows]
    assert len(set(texts)) == len(texts) and all(t == t.strip() and t for t in texts)
    assert all(list(r) == ["messages"] and len(r["messages"]) == 1 and r["messages"][0]["role"] == "user"
               for r in rows)  # the plain form: mixes with other prompt files
    assert not (a / PARTS_DIR).exists()  # the parts are gone once prompts.jsonl is written
    assert f"{NUM} user turns sampled" in out and f"{len(rows)} kept" in out and "dflash regenerate" in out


def test_a_killed_run_resumes_with_the_parts_it_lacks_and_a_finished_one_is_kept(tiny, tmp_path, monkeypatch):
    whole, out = tmp_path / "whole", tmp_path / "out"
    run(tiny, whole, "--part-size", 10)
    import dflash.extract.generation.prompts as pr

    real, calls = pr.Sampler.rows, []

    def rows_then_die(self, first, last, settings, on_row=None):  # killed while sampling the third part
        calls.append(first)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, first, last, settings, on_row)

    monkeypatch.setattr(pr.Sampler, "rows", rows_then_die)
    cfg = PromptsConfig(target=str(tiny), out=str(out), num=NUM, max_new_tokens=TOKENS, part_size=10, device="cpu",
                        progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_prompts(cfg)
    assert sorted(os.listdir(out / PARTS_DIR)) == ["part-00000.jsonl", "part-00001.jsonl"]
    assert record(out)["complete"] is False and not (out / PROMPTS_FILE).exists()
    ans = tmp_path.parent / f"{tmp_path.name}-ans"  # outside every --data below (an output inside its data is refused)
    for data in (out, tmp_path):  # the output itself, or a folder above it (beside other prompt files)
        code, said = cli("regenerate", "--target", tiny, "--data", data, "--out", ans, "--no-progress")
        error_line(code, said, str(out), "unfinished `dflash prompts` output")
    calls.clear()
    monkeypatch.setattr(pr.Sampler, "rows", lambda self, first, last, settings, on_row=None: (
        calls.append(first), real(self, first, last, settings, on_row))[1])
    rec = run_prompts(cfg)
    assert calls == [20, 30]  # only the two parts not written
    assert lines(out / PROMPTS_FILE) == lines(whole / PROMPTS_FILE) and rec["kept"] == record(whole)["kept"]
    calls.clear()
    said = run(tiny, out, "--part-size", 10)
    assert calls == [] and "nothing to do" in said  # finished: read, not sampled again


def test_another_setting_is_named_and_overwrite_starts_over(tiny, tmp_path):
    out = tmp_path / "p"
    run(tiny, out)
    first = lines(out / PROMPTS_FILE)
    error_line(*cli("prompts", "--target", tiny, "--out", out, "--num", NUM, "--max-new-tokens", TOKENS,
                    "--seed", 5, "--device", "cpu", "--no-progress"), str(out), "seed: 0 there, 5 now", "--overwrite")
    assert lines(out / PROMPTS_FILE) == first  # untouched
    run(tiny, out, "--seed", 5, "--overwrite")
    assert lines(out / PROMPTS_FILE) != first and record(out)["settings"]["seed"] == 5
    (out / "mine.txt").write_text("x")
    error_line(*cli("prompts", "--target", tiny, "--out", out, "--device", "cpu", "--no-progress"), "mine.txt")
    error_line(*cli("prompts", "--target", tiny, "--out", tmp_path / "q", "--temperature", 0, "--no-progress"),
               "--temperature")


def test_regenerate_answers_the_prompts(tiny, tmp_path):
    out, ans = tmp_path / "p", tmp_path / "ans"
    run(tiny, out)
    kept = lines(out / PROMPTS_FILE)
    ok("regenerate", "--target", tiny, "--data", out, "--out", ans, "--max-new-tokens", 8, "--device", "cpu",
       "--no-progress")
    convs = [json.loads(line) for f in sorted((ans / "data").glob("part-*.jsonl")) for line in open(f)]
    assert len(convs) == len(kept)
    for c, k in zip(convs, kept):
        assert c["messages"][0] == k["messages"][0] and c["messages"][1]["role"] == "assistant"


def test_a_target_without_a_chat_template_is_one_error_line(tiny, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    os.remove(bare / "chat_template.jinja")
    error_line(*cli("prompts", "--target", bare, "--out", tmp_path / "p", "--num", 4, "--device", "cpu",
                    "--no-progress"), "no chat template", "--chat-template")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    assert not (tmp_path / "p").exists()  # refused before anything was written
    run(bare, tmp_path / "p", "--chat-template", template)
    assert record(tmp_path / "p")["prefix"] == "<|im_start|>user\n" and record(tmp_path / "p")["kept"] >= 1
