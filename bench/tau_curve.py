"""tau against training tokens: the demo's recipe (SmolLM2-135M-Instruct + chitchat, regenerated replies)
at a larger scale — more data, more steps, a deeper drafter — with every checkpoint measured by real
speculative decoding on the same held-out prompts.

    python bench/tau_curve.py --workdir work/tau-curve                     # ~1.5 h on 2 CPU cores
    python bench/tau_curve.py --workdir work/tau-curve --responses original  # the same on human replies

Each stage resumes when rerun (regenerate, extract and train do; evaluated checkpoints are kept in
curve.json). Writes curve.json, curve.md and curve.png into the workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="work/tau-curve")
    ap.add_argument("--responses", choices=["regenerate", "original"], default="regenerate")
    ap.add_argument("--train-prompts", type=int, default=1200)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--config", default="smollm2-long")
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()

    from dflash.core.config import build
    from dflash.demo import DemoConfig, _regenerate, prepare_data, smollm2_gguf
    from dflash.extract.run import ExtractConfig, run_extract
    from dflash.core.target import convert_gguf
    from dflash.train.eval import EvalConfig, run_eval
    from dflash.train.trainer import TrainConfig, run_train

    demo = DemoConfig(workdir=a.workdir, responses=a.responses, train_prompts=a.train_prompts,
                      eval_prompts=a.eval_prompts, device=a.device, progress=False)
    os.makedirs(a.workdir, exist_ok=True)
    target = convert_gguf(smollm2_gguf(), os.path.join(a.workdir, "target"))
    train_jsonl, held = prepare_data(demo)
    from dflash.core.config import read_preset

    demo.regen_max_new_tokens = read_preset(a.config, "regenerate").get("max_new_tokens", demo.regen_max_new_tokens)
    data = _regenerate(demo, target, train_jsonl) if a.responses == "regenerate" else train_jsonl
    cache = os.path.join(a.workdir, f"cache-{a.responses}")
    run_extract(build(ExtractConfig, a.config, "extract",
                      {"target": target, "data": data, "out": cache, "device": a.device, "progress": False}))
    run = os.path.join(a.workdir, f"run-{a.responses}")
    tcfg = build(TrainConfig, a.config, "train", {"cache": cache, "target": target, "out": run, "max_steps": a.steps,
                                                   "save_every": a.eval_every, "device": a.device, "progress": False})
    run_train(tcfg)

    import dflash_cache

    T = dflash_cache.open(cache).seq_len
    path = os.path.join(a.workdir, f"curve-{a.responses}.json")
    curve = json.load(open(path)) if os.path.exists(path) else {}
    ck = os.path.join(run, "checkpoints")
    steps = sorted(int(d.split("_")[1]) for d in os.listdir(ck) if d.startswith("step_") and not d.endswith(".tmp"))
    for step in steps:
        if str(step) in curve:
            continue
        ev = run_eval(build(EvalConfig, a.config, "eval", {"target": target, "drafter": os.path.join(ck, f"step_{step:08d}"),
                                                          "data": held, "device": a.device, "progress": False}))
        curve[str(step)] = {"step": step, "ctx_tokens": step * tcfg.batch_rows * tcfg.grad_accum * T,
                            "anchors": step * tcfg.batch_rows * tcfg.grad_accum * tcfg.num_anchors,
                            "tau": ev["dflash"]["tau"], "tau_ngram": ev["ngram"]["tau"],
                            "identical": ev["dflash"]["outputs_identical"], "prompts": ev["prompts"]}
        json.dump(curve, open(path, "w"), indent=2)
        print(json.dumps(curve[str(step)]), flush=True)
    rows = [curve[k] for k in sorted(curve, key=int)]
    md = ["| step | training context tokens | anchors (blocks) | tau dflash | tau n-gram | identical outputs |",
          "|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['step']} | {r['ctx_tokens']:,} | {r['anchors']:,} | {r['tau']:.2f} | {r['tau_ngram']:.2f} | "
           f"{r['identical']}/{r['prompts']} |" for r in rows]
    open(os.path.join(a.workdir, f"curve-{a.responses}.md"), "w").write("\n".join(md) + "\n")
    print("\n".join(md))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=110)
    ax.plot([r["ctx_tokens"] / 1e6 for r in rows], [r["tau"] for r in rows], "o-", label="DFlash drafter")
    ax.axhline(rows[-1]["tau_ngram"], color="gray", ls="--", label="n-gram prompt lookup")
    ax.set_xlabel("training context tokens (millions)")
    ax.set_ylabel("tau (accepted + 1 per step)")
    ax.set_title(f"SmolLM2-135M-Instruct, {a.responses} replies, held-out chitchat prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.workdir, f"curve-{a.responses}.png"))


if __name__ == "__main__":
    main()
