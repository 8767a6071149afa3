"""What the recipes print and keep at the end, from their eval reports.

CPU recipe: eval_figures (the summary's tau, speed-up and identical outputs, in-source and out-of-source) and
format_cpu_summary (its table). Both: demo_outputs and format_outputs (the demo's last lines: where its drafter, eval
reports, plot and summary are). GPU recipe: bars (the bars of BARS checked on an eval report), set_summary (a set's or
category's figures), drafter_figures (a drafter's training and eval figures) and format_gpu_summary (its table, and a
comparison's after it).
"""

from __future__ import annotations

import os
from typing import Any

from dflash.recipes.gpu_config import BARS, CODER_BARS
from dflash.recipes.stages import train_rates


def eval_figures(ev: dict[str, Any]) -> dict[str, Any]:
    """The summary's eval figures: tau, speed-up and identical outputs on the held-out chitchat prompts (the
    in-source set; all the prompts when the report has no sets), tau and identical outputs on the MT-Bench ones
    beside them (out-of-source)."""
    ins = (ev.get("sets") or {}).get("in-source") or {
        "dflash": dict(ev["dflash"], identical=ev["dflash"]["outputs_identical"]), "ngram": ev["ngram"],
        "prompts": ev["prompts"]}
    oos = (ev.get("sets") or {}).get("out-of-source")
    return {
        "tau_dflash": ins["dflash"]["tau"], "tau_ngram": ins["ngram"]["tau"],
        "speedup_dflash": ins["dflash"]["speedup"], "speedup_ngram": ins["ngram"]["speedup"],
        **({"tau_dflash_out_of_source": oos["dflash"]["tau"], "tau_ngram_out_of_source": oos["ngram"]["tau"],
            "lossless_out_of_source": f"{oos['dflash']['identical']}/{oos['prompts']}",
            "out_of_source_prompts": oos["prompts"]} if oos else {}),
        "lossless": f"{ins['dflash']['identical']}/{ins['prompts']}",
        "eval_prompts": ins["prompts"],
    }


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _train_rate(s: dict[str, Any]) -> str:
    """The run mean of training's ctx tok/s and, when it differs, the last window's (train's own last line)."""
    mean, steps = s.get("train_tokens_per_s"), s.get("train_tokens_per_s_steps")
    if not mean:
        return "resumed"
    if not steps:  # a summary written before the figures were named
        return f"{mean:,.0f} ctx tok/s"
    out = f"{mean:,.0f} ctx tok/s (run mean, steps {steps[0]}-{steps[1]}"
    last, lsteps = s.get("train_tokens_per_s_last_window"), s.get("train_last_window_steps")
    if last and lsteps and lsteps != steps:
        out += f"; last window, steps {lsteps[0]}-{lsteps[1]}: {last:,.0f}"
    return out + ")"


def format_cpu_summary(s: dict[str, Any]) -> str:
    def taus(ins, oos):  # the held-out chitchat prompts', then the MT-Bench ones' when the demo evaluated some
        return f"{ins:.2f}" + (f" held-out chitchat, {oos:.2f} MT-Bench (out-of-source)" if oos is not None else "")

    rows = [
        ("responses trained on", s["config"]["responses"]),
        ("tokens extracted", f"{s['tokens_extracted']:,}"),
        ("cache size", f"{_human_bytes(s['cache_bytes'])} ({s['cache_bytes_per_token']:,.0f} bytes/token)"),
        ("extraction", f"{s['extract_tokens_per_s']:,.0f} tok/s" if s["extract_tokens_per_s"] else "resumed (cached)"),
        ("training", _train_rate(s)),
        ("final loss", f"{s['final_loss']:.3f}" if s["final_loss"] is not None else "-"),
        ("tau: dflash drafter", taus(s["tau_dflash"], s.get("tau_dflash_out_of_source"))),
        ("tau: n-gram lookup", taus(s["tau_ngram"], s.get("tau_ngram_out_of_source"))),
        ("speed-up vs target alone", f"dflash {s['speedup_dflash']:.2f}x, n-gram {s['speedup_ngram']:.2f}x"),
        ("lossless (identical outputs)", s["lossless"] + (f" held-out chitchat, {s['lossless_out_of_source']} MT-Bench"
                                                          if s.get("lossless_out_of_source") else "")),
        ("time", ", ".join(f"{k} {v:.0f}s" for k, v in s["timings_s"].items())),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def bars(ev: dict[str, Any]) -> dict[str, Any]:
    """The bars on one eval report: on its in-source prompts (all of them when its prompts have no sets) and, when
    it has them, its out-of-source ones (keys out_of_source_*) and its HumanEval ones (keys humaneval_*: the coder
    recipe's bar, CODER_BARS)."""
    sets = ev.get("sets") or {}
    ins = sets.get("in-source") or {"dflash": ev["dflash"], "ngram": ev.get("ngram")}
    d, n = ins["dflash"], ins.get("ngram")
    out = {"tau": d["tau"], "tau_ok": d["tau"] >= BARS["tau"], "speedup": d["speedup"],
           "speedup_ok": d["speedup"] >= BARS["speedup"]}
    if n:
        out["tau_ngram"] = n["tau"]
        out["tau_over_ngram"] = d["tau"] / n["tau"] if n["tau"] else None
    oos = sets.get("out-of-source")
    if oos:
        od, on = oos["dflash"], oos.get("ngram")
        out.update(out_of_source_tau=od["tau"], out_of_source_speedup=od["speedup"])
        if on:
            ratio = od["tau"] / on["tau"] if on["tau"] else None
            out.update(out_of_source_tau_ngram=on["tau"], out_of_source_tau_over_ngram=ratio,
                       out_of_source_tau_over_ngram_ok=ratio is not None
                       and ratio >= BARS["out_of_source_tau_over_ngram"])
    he = sets.get("humaneval")  # the coder recipe's own set (its eval_sources) and its bar (CODER_BARS)
    if he:
        hd, hn = he["dflash"], he.get("ngram") or {}
        out.update(humaneval_prompts=he["prompts"], humaneval_tau=hd["tau"], humaneval_speedup=hd["speedup"],
                   humaneval_tau_ngram=hn.get("tau"), humaneval_speedup_ngram=hn.get("speedup"),
                   humaneval_ok=hd["tau"] >= CODER_BARS["humaneval_tau"]
                   and hd["speedup"] >= CODER_BARS["humaneval_speedup"])
    return out


def set_summary(g: dict[str, Any]) -> dict[str, Any]:
    """A set's (or category's) figures in the summary: prompts, tau and speed-up of dflash and n-gram, identical."""
    n = g.get("ngram") or {}
    out = {"prompts": g["prompts"], "tau_dflash": g["dflash"]["tau"], "tau_ngram": n.get("tau"),
           "speedup_dflash": g["dflash"]["speedup"], "speedup_ngram": n.get("speedup"),
           "identical": f"{g['dflash']['identical']}/{g['prompts']}"}
    if "categories" in g:
        out["categories"] = {c: set_summary(cg) for c, cg in g["categories"].items()}
    return out


def drafter_figures(run: str, tr: dict[str, Any], evals: dict[str, dict]) -> dict[str, Any]:
    """One drafter's part of the GPU summary: "train" (from its trainer's summary `tr` and RUN/metrics.jsonl, which
    holds every logged window across resumes), "eval" ({dtype: figures of its report}) and "bars" (on the first
    dtype's report)."""
    from dflash.train.fit.run_dir import read_metrics

    hist = tr.get("history") or []
    last = hist[-1] if hist else {}
    # a resumed run's own figures cover only what it did: RUN/metrics.jsonl has every logged window of the training
    # (resumes cut it back to the checkpoint they start from)
    records = read_metrics(run) if os.path.isdir(run) else None
    records = records or hist
    rates = train_rates(records)
    val = tr.get("val") or {}
    return {
        "train": {"steps": tr.get("steps"), "final_loss": last.get("loss"), "tau_expected": last.get("tau_expected"),
                  # the run mean after the first window (the warm-up) and the last window, with their steps
                  "ctx_tokens_per_s": rates["train_tokens_per_s"], "ctx_tokens_per_s_steps": rates[
                      "train_tokens_per_s_steps"], "ctx_tokens_per_s_last_window": rates[
                      "train_tokens_per_s_last_window"], "last_window_steps": rates["train_last_window_steps"],
                  "val_tau_decode": val.get("val_tau_decode"), "val_tau_expected": val.get("val_tau_expected"),
                  "val_loss": val.get("val_loss"),
                  # [step, held-out decoding tau, held-out expected tau] at every checkpoint
                  "val_curve": [[h["step"], h.get("val_tau_decode"), h["val_tau_expected"]]
                                for h in records if "val_tau_expected" in h]},
        "eval": {dt: {"tau_dflash": ev["dflash"]["tau"], "tau_ngram": ev.get("ngram", {}).get("tau"),
                      "tokens_per_s": {"target": ev["target_tokens_per_s"], "dflash": ev["dflash"]["tokens_per_s"],
                                       "ngram": ev.get("ngram", {}).get("tokens_per_s")},
                      "speedup_dflash": ev["dflash"]["speedup"], "speedup_ngram": ev.get("ngram", {}).get("speedup"),
                      "ms_per_step": {"target": ev["target"]["ms_per_step"], "dflash": ev["dflash"]["ms_per_step"]},
                      "identical": f"{ev['dflash']['outputs_identical']}/{ev['prompts']}",
                      "differences": {k: ev["dflash"]["differences"][k] for k in ("differing", "near_tie", "suspect")},
                      "sets": {k: set_summary(g) for k, g in (ev.get("sets") or {}).items()}}
                 for dt, ev in evals.items()},
        "bars": bars(next(iter(evals.values()))),
    }


def format_gpu_summary(s: dict[str, Any]) -> str:
    b, d = s["bars"], s["data"]
    src = d.get("sources") or {}
    mix = ", ".join(f"{k} {v['train_samples']:,} ({v['share']:.0%}" + (f", {v['passes']:g} passes)" if v["passes"] > 1
                                                                    else ")") for k, v in src.items())
    held = d.get("heldout_source")
    rows = [
        ("training data", f"{d.get('train_conversations_used', d['train_samples']):,} conversations, "
                          f"{d['assistant_turns']:,} assistant turns regenerated by the target (history: "
                          f"{d.get('history', 'target')})"),
        *([("training mix", mix)] if len(src) > 1 else []),
        ("eval prompts", f"{d['eval_prompts']} from {d['heldout_conversations']} held-out conversations"
                         + (f" (in-source) + {held['prompts']} of {held['name']}, never trained on (out-of-source)"
                            if held else "")
                         + "".join(f" + {e['prompts']} of {k}, never trained on" for k, e in
                                   (d.get("eval_sources") or {}).items())),
        ("train", f"{s['train']['steps']} steps, final loss {s['train']['final_loss']:.3f}"
         if s["train"]["final_loss"] is not None else "resumed"),
        ("expected tau, train / held-out rows", f"{s['train']['tau_expected']:.2f} / "
         + (f"{s['train']['val_tau_expected']:.2f}" if s["train"].get("val_tau_expected") is not None else "-")
         if s["train"].get("tau_expected") is not None else "resumed"),
        ("held-out decoding tau (--val-cache)", f"{s['train']['val_tau_decode']:.2f}"
         if s["train"].get("val_tau_decode") is not None else "-"),
        ("tau dflash / n-gram" + (", in-source" if held else ""),
         f"{b['tau']:.2f} / "
         + (f"{b['tau_ngram']:.2f} ({b['tau_over_ngram']:.2f}x)" if b.get("tau_over_ngram") else "-")),
        *([("tau dflash / n-gram, out-of-source", f"{b['out_of_source_tau']:.2f} / "
            + (f"{b['out_of_source_tau_ngram']:.2f} ({b['out_of_source_tau_over_ngram']:.2f}x)"
               if b.get("out_of_source_tau_over_ngram") else "-"))] if "out_of_source_tau" in b else []),
        ("speed-up vs target alone", f"{b['speedup']:.2f}x" + (f" in-source, {b['out_of_source_speedup']:.2f}x "
                                                               "out-of-source" if "out_of_source_tau" in b else "")),
        *([("tau dflash / n-gram, HumanEval", f"{b['humaneval_tau']:.2f} / "
            + (f"{b['humaneval_tau_ngram']:.2f}" if b.get("humaneval_tau_ngram") is not None else "-")
            + f", speed-up {b['humaneval_speedup']:.2f}x ({b['humaneval_prompts']} prompts)"),
           (f"HumanEval bar (tau>={CODER_BARS['humaneval_tau']:g}, >={CODER_BARS['humaneval_speedup']:g}x)",
            str(b["humaneval_ok"]))] if "humaneval_tau" in b else []),
        (f"bars (tau>={BARS['tau']:g}, out-of-source >={BARS['out_of_source_tau_over_ngram']:g}x n-gram, "
         f">={BARS['speedup']:g}x)", f"{b['tau_ok']}, {b.get('out_of_source_tau_over_ngram_ok')}, {b['speedup_ok']}"),
        ("lossless in float32", str(s["lossless_float32"])),
        ("time", ", ".join(f"{k} {v:.0f}s" for k, v in s["timings_s"].items())),
    ]
    if len(s.get("all_runs", [])) > 1:
        rows.append(("time from nothing", f"{s['wall_s_all_runs']:.0f}s in {len(s['all_runs'])} runs "
                                          "(" + ", ".join(f"{r['wall_s']:.0f}s" for r in s["all_runs"]) + ")"))
    w = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
    if s.get("compare"):  # a comparison (dflash/recipes/compare.py): the two drafters side by side
        from dflash.recipes.compare import format_compare

        table += "\n\n" + format_compare(s["compare"])
    return table
