"""The `dflash` command: a thin click layer over the library; each subcommand lives in its own module.

Multi-GPU: run any GPU command under torchrun, e.g.
    torchrun --nproc-per-node 5 -m dflash extract ...
or let it launch torchrun for you with --gpus 0,1,2,3,4.
"""

from __future__ import annotations

import json
import sys

import click

# Light imports only at the top (`dflash --help` and `dflash cache ...` never load torch): the cache, the bottom's
# config, the shared options and checks (dflash/cli_options.py), the demo's sizes. torch-loading modules (dflash.core.dist, the stages) are imported
# inside the commands that run them.
import dflash_cache
from dflash.cli_options import (  # noqa: F401  (argv_without_gpus, known_errors: importable from here)
    BOUNDED_INT,
    CleanErrors,
    argv_without_gpus,
    check_paths,
    check_tokenize_cache,
    known_errors,
    option,
    refuse_gpus_under_torchrun,
    relaunch_with_gpus,
)
from dflash.core.config import ConfigError, build, flag, parse_int_list, parse_kv
from dflash.core.paths import (
    check_apart,
    check_cache_path,
    check_output_dir,
    check_run_apart_from_cache,
    in_path_forms,
    path_form,
    path_forms,
)
from dflash.recipes.demo import CPU_SIZES, DemoConfig, cpu_demo_time
from dflash_cache.lock import OutputLock


@click.group(cls=CleanErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dflash")
def main():
    """Train DFlash speculative-decoding drafters for a Hugging Face causal LM.

    \b
    Pipeline:  prompts, regenerate (optional) -> extract -> train -> eval
    extract runs the frozen target once and writes hidden states to a cache on disk;
    train reads that cache (as often as you like) on other GPUs; eval measures the
    drafter by real speculative decoding. `dflash demo` runs it all on a tiny real model.
    """


@main.group()
def cache():
    """Inspect and check a hidden-state cache."""


def check_target(path: str) -> None:
    """dflash.core.target.check_target (imported here: it loads torch, which `dflash --help` never does)."""
    from dflash.core.target import check_target as check

    check(path)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@cache.command("info")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print everything as one JSON object.")
def cache_info(path, as_json):
    """Rows, tokens, padding, bytes on disk and metadata of the cache at PATH."""
    path = path_form(path, "PATH", url="read")
    rep = dflash_cache.info(path)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
        return
    m = rep["metadata"]
    info = m.get("info", {})
    target = info.get("target", {})
    lines = [
        ("path", rep["path"]),
        ("status", ("complete" if rep["complete"] else f"INCOMPLETE ({rep['shards_committed']}/{rep['shards_planned']} shards committed)")
         + " (from the metadata only: `dflash cache verify` re-reads and checks every byte)"),
        ("target", f"{target.get('name_or_path', '?')} ({target.get('num_layers', '?')} layers, hidden {m['hidden_size']})"),
        ("layers captured", str(m["layer_ids"])),
        ("rows", f"{rep['rows']} x {rep['seq_len']} tokens ({rep['shards_committed']} shards of {m['rows_per_shard']} rows)"),
        ("real tokens", f"{rep['real_tokens']:,} ({rep['supervised_tokens']:,} supervised)"),
        ("padding", f"{100 * rep['padding_fraction']:.2f}% of stored tokens"),
        ("on disk", f"{_human(rep['bytes_on_disk'])} ({m['codec']}; {rep['bytes_per_real_token'] or 0:,.0f} bytes per real token, "
                    f"raw {m.get('hidden_dtype', 'bfloat16')} hidden = {rep['raw_hidden_bytes_per_token']:,})"),
        ("format", f"{m['format']} v{m['format_version']}"),
    ]
    b = rep.get("basis")
    if b:  # the context features on their own basis (dflash_cache/basis.py)
        per = ", ".join(f"{k}: {100 * v:.2f}%" for k, v in b["energy_per_layer"].items())
        lines.insert(-1, ("basis", f"rank {b['rank']} of {b['width']} (K*H) features, keeping {100 * b['energy']:.2f}% "
                                   f"of their energy (per layer {per}) over {b['fit_tokens']:,} fit tokens; "
                                   f"{rep['raw_hidden_bytes_per_token']:,} raw bytes per token; digest {b['digest']}"))
    for k in ("data_fingerprint", "tokenizer_fingerprint", "chat_template_fingerprint"):
        if k in info:
            lines.append((k.replace("_", " "), info[k]))
    w = max(len(k) for k, _ in lines)
    for k, v in lines:
        click.echo(f"{k:<{w}}  {v}")


@cache.command("verify")
@click.argument("path")
@click.option("--threads", default=4, show_default=True, type=click.IntRange(min=1, max=1024), help="Decoding threads.")
@click.option("--repair", is_flag=True, help="Rewrite damaged metadata from its record, and un-commit every bad shard "
              "so that rerunning the same `dflash extract` redoes them.")
def cache_verify(path, threads, repair):
    """Re-read every shard, check checksums and metadata; exit 1 naming every bad shard and metadata file.

    Metadata damage (the root zarr.json, an array's zarr.json) is told from data damage: --repair rewrites such a
    file from the record kept with the cache and un-commits no shard for it. With --repair, bad shards are
    un-committed (and named): the next `dflash extract` with the same settings rewrites exactly those, and the
    exit code stays 1 until that extraction has run. Files that dflash did not write are listed, never deleted.
    """
    from tqdm import tqdm

    from dflash_cache.inspect import repair as repair_cache

    path = path_form(path, "PATH", url="read")

    with tqdm(desc="verify", unit="shard", disable=None) as bar:
        def start(n):
            bar.total = n
            bar.refresh()

        rep = dflash_cache.verify(path, threads=threads, progress=bar.update, on_start=start)
    click.echo(f"{path}: {len(rep.shards_ok)} of {rep.shards_planned} shards OK, {rep.bytes_checked / 1e9:.2f} GB decoded")
    for line in rep.metadata + rep.unrepairable:
        click.echo(f"BAD metadata {line}")
    for s, problems in sorted(rep.bad.items()):
        for p in problems:
            click.echo(f"BAD shard {s:06d}: {p}")
    if rep.uncommitted:
        head = ", ".join(f"{s:06d}" for s in rep.uncommitted[:20])
        more = f" (+{len(rep.uncommitted) - 20} more)" if len(rep.uncommitted) > 20 else ""
        click.echo(f"NOT COMMITTED ({len(rep.uncommitted)} shards): {head}{more} - rerun the extraction to finish them")
    for note in rep.notes:
        click.echo(f"note: {note}")
    if rep.foreign:
        click.echo(f"note: {len(rep.foreign)} entries not written by dflash (not checked; dflash never deletes them): "
                   + ", ".join(rep.foreign[:20]) + (f" (+{len(rep.foreign) - 20} more)" if len(rep.foreign) > 20 else ""))
    if repair and (rep.fixes or rep.bad):
        with OutputLock(path, "dflash cache verify --repair"):  # not while an extract writes this cache
            for line in repair_cache(path, rep):
                click.echo(f"repaired: {line}")
        if rep.ok_after_repair:
            click.echo("OK (after repair)")
            return
    if not rep.ok:
        sys.exit(1)
    click.echo("OK")


@main.command()
@option("--target", help="The frozen target: a local HF model directory or a .gguf file.")
@option("--data", help="Chat data: a json/jsonl/parquet file, a glob, a directory, or a save_to_disk dataset "
        "(OpenAI `messages` or ShareGPT `conversations`).")
@option("--out", help="Where to write the cache (a directory or an fsspec URL).")
@option("--config", "preset", help="A YAML preset (path or name in configs/); flags override it.")
@option("--split", help="Dataset split.")
@option("--max-samples", type=int, help="Use only the first N conversations.")
@option("--seq-len", type=int, help="Row length T: conversations are packed into rows of exactly T tokens.")
@option("--layers", help="Target layer ids to capture, e.g. 1,9,17,25,33.", default_text="DFlash's rule, K from 1 to L-3")
@option("--num-context-layers", type=int, help="K for the default layer rule.", default_text="5")
@option("--rows-per-shard", type=int, help="Rows per committed shard.", default_text="~512 MB of hidden states")
@option("--batch-rows", type=int, help="Rows per target forward.", default_text="~16k tokens (~4k on a CPU)")
@option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), help="Target dtype.", default_text="bf16 on GPU, fp32 on CPU")
@option("--attn", type=click.Choice(["auto", "flex", "sdpa"]), help="Packed attention.", default_text="flex on GPU, sdpa on CPU")
@option("--codec", type=click.Choice(list(dflash_cache.format.CODECS)), help="Hidden-state compression.")
@option("--hidden-dtype", type=click.Choice(["bf16", "fp8", "fp4"]),
        help="Stored hidden states: bf16 (exact), fp8 (e4m3 + a scale per token and layer: half the bytes), "
             "fp4 (experimental: e2m1 + a float16 scale per 32 channels), quantised on the GPU.")
@option("--last-hidden", is_flag=True, default=None,
        help="Also store the target's last hidden state (after its final norm): what `dflash train --arch dflash2` "
             "learns the target's distribution from. H values more per token (bf16: 2H bytes); the target runs all "
             "its layers.")
@option("--basis-rank", type=int,
        help="Store the K context layers' features on their own basis of R directions (z = P x: R values per token "
             "instead of K*H; P = the top R eigenvectors of the features' uncentred second moment, fitted by the target "
             "on --basis-fit-tokens tokens of the data and kept in the cache). A drafter trained on it is written with "
             "the composed fc (K*H inputs), as any other. 0: the features as they are. With fp8 (one scale per token) "
             "or bf16; the last hidden state of --last-hidden stays as it is. It costs tau: R = H took 0.20 of fp8's "
             "bytes, and at equal steps its drafter's held-out tau was 3.6% below the lowest of three fp8 seeds' "
             "(BENCHMARKS.md, 'Cache size'); for when the disk limits the data.", default_text="0")
@option("--basis-from", metavar="CACHE",
        help="Store the features on the basis of this cache (same target and layers) instead of fitting one: a "
             "--val-cache for a cache on a basis must be on the same one.")
@option("--basis-fit-tokens", type=int,
        help="Row tokens the basis is fitted on: the real tokens of ceil(N / T) rows spread evenly over the plan. The "
             "default, 65,536, is where the held-out error settled at K*H = 2,880 (~20x the width); raise it for a "
             "wider target.")
@option("--writer-threads", type=int, help="Threads that compress and write shards, per rank.", default_text="the cores / ranks on the node")
@option("--chat-template", help="A Jinja chat template file to use instead of the tokenizer's.")
@option("--chat-template-kwargs", multiple=True, metavar="KEY=VALUE", help="Extra template variables, e.g. enable_thinking=false.")
@option("--overwrite", is_flag=True, default=None, help="Replace an existing cache written with other settings.")
@option("--compile", type=click.Choice(["auto", "on", "off"]),
        help="Compiled target forward, checked against eager on the first batch (off = eager).", default_text="on for GPU")
@option("--tokenize-workers", type=int, help="Processes that tokenise the data (once per job, cached).", default_text="every core")
@option("--tokenize-cache", help="Directory of tokenised datasets shared by ranks and reruns, or 'off'.",
        default_text="$DFLASH_TOKENIZE_CACHE or ~/.cache/dflash/tokenized")
@option("--device", help="cpu, cuda or cuda:N.", default_text="the local rank's GPU, else cpu")
@option("--gpus", help="Launch torchrun on these GPU ids, one process each (e.g. 0,1,2,3,4).")
@option("--json", "json_out", help="Also write the run summary to this JSON file.")
@option("--no-progress", is_flag=True, help="No progress bar.")
def extract(preset, gpus, json_out, no_progress, **flags):
    """Run the frozen target over chat data and write its hidden states to a cache.

    Conversations are tokenised with the target's chat template (loss mask = assistant tokens),
    packed into rows of exactly T tokens, and the K captured layers are written as committed
    shards. Rerunning the same command resumes; a changed setting is an error unless --overwrite.

    \b
    Multi-GPU:  torchrun --nproc-per-node 5 -m dflash extract ...   (or --gpus 0,1,2,3,4)
    """
    refuse_gpus_under_torchrun(gpus)
    from dflash.extract.run import ExtractConfig, run_extract

    if no_progress:
        flags["progress"] = False
    flags["layers"] = parse_int_list(flags["layers"], "layers")
    flags["chat_template_kwargs"] = parse_kv(flags["chat_template_kwargs"], "chat_template_kwargs") or None
    cfg = in_path_forms(build(ExtractConfig, preset, "extract", flags), {"out": "write", "basis_from": "read"})
    json_out = path_form(json_out, "json")  # (all before --gpus: fails once)
    check_paths(json=json_out, chat_template=cfg.chat_template, out=cfg.out, data=cfg.data, target=cfg.target)
    if cfg.basis_from:  # a cache with a basis, of the rank asked: before the target loads or the data tokenises
        from dflash.extract.basis_fit import basis_source

        check_cache_path(cfg.basis_from, "basis_from")
        basis_source(cfg)
    check_tokenize_cache(cfg.tokenize_cache)
    check_target(cfg.target)
    relaunch_with_gpus(gpus, "extract")
    summary = run_extract(cfg)
    if json_out:
        from dflash.core.dist import write_json0

        write_json0(json_out, summary)


@main.command()
@option("--cache", help="The hidden-state cache written by `dflash extract` (never modified).")
@option("--target", help="The target the cache came from (only its embedding, LM head, config and tokenizer are loaded).")
@option("--out", help="The run directory: checkpoints, metrics.jsonl, summary.json and final/ (the servable drafter).")
@option("--config", "preset", help="A YAML preset (path or name in configs/); flags override it.")
@option("--max-steps", type=int, help="Optimizer steps to train for.")
@option("--epochs", type=float, help="Epochs over the cache (instead of --max-steps).", default_text="1")
@option("--time-budget", "time_budget_s", metavar="SECONDS",
        help="Train for about this much training time instead of a number of steps: seconds, or 90m, 2h. The "
             "steps are chosen after a probe (the step time over --time-budget-probe steps after 3 warm-up steps) as "
             "SECONDS / step time; training time leaves out the first compiled call, validations and --follow waits. "
             "At half and nine tenths of the steps the total is decided again from the time spent. The decision "
             "and its revisions are kept in RUN/run.json: a resumed run replays them. Not with --max-steps or "
             "--epochs (a preset's give the schedule's provisional length until the decision).")
@option("--time-budget-probe", type=int, help="With --time-budget: the steps timed to decide the run's steps.")
@option("--arch", type=click.Choice(["dflash", "dflash2"]),
        help="dflash, or dflash2: grouped causal convolutions inside the block and a candidate selector reranking "
             "each slot's top-k, trained on the target's distribution (needs a cache from `dflash extract "
             "--last-hidden`; --val-cache too). Its draft step in `dflash eval` is one CUDA graph on a GPU, the "
             "selector's greedy pass included, as dflash's. Its training step costs ~1.3x dflash's at the 8B shape "
             "(BENCHMARKS.md).")
@option("--conv-kernel-size", type=int, help="dflash2: taps of each layer's grouped causal convolution over the "
        "block's slots (at most --block-size).")
@option("--conv-group-size", type=int, help="dflash2: channels per group of the convolution's token-conditioned "
        "kernel (must divide the target's hidden size).")
@option("--selector-rank", type=int, help="dflash2: rank of the candidate selector's bilinear term.")
@option("--selector-top-k", type=int, help="dflash2: candidates per slot (the unary top-k) the selector reranks.")
@option("--selector-loss-alpha", type=float, help="dflash2: weight of the selector's loss beside the KL to the "
        "target's distribution.")
@option("--drafter-layers", type=int, help="Drafter decoder layers.")
@option("--draft-window", type=int, help="Sliding-window draft layers: each block sees this many context positions "
        "before its anchor (and its own block, bidirectionally), so the step's cost stays flat in the row length.",
        default_text="none (full attention)")
@option("--draft-layer-types", help="Per drafter layer, sliding_attention or full_attention (comma-separated).",
        default_text="every layer sliding with --draft-window")
@option("--block-size", type=int, help="Block size B: the anchor plus B-1 drafted tokens.")
@option("--num-anchors", type=int, help="Blocks per row.")
@option("--gamma", type=float, help="Slot k weighs exp(-(k-1)/gamma).")
@option("--batch-rows", type=int, help="Rows per micro-batch per GPU.")
@option("--grad-accum", type=int, help="Micro-batches per optimizer step.")
@option("--lr", type=float, help="Peak learning rate (AdamW, warm-up then cosine).")
@option("--warmup-ratio", type=float, help="Fraction of steps for linear warm-up.")
@option("--min-lr-ratio", type=float, help="Final lr as a fraction of the peak.")
@option("--weight-decay", type=float, help="AdamW weight decay.")
@option("--grad-clip", type=float, help="Gradient-norm clip.")
@option("--mask-token-id", type=int, help="Mask token id.", default_text="an unused id of the target's vocabulary")
@option("--seed", type=int, help="Seed for init, data order and anchors.")
@option("--shuffle-window", type=int, help="Rows per shuffle window of the first epoch, read in the order extraction "
        "writes shards (later epochs: one permutation); 0 = one permutation of the whole cache.")
@option("--follow", is_flag=True, default=None, help="Train while `dflash extract` still writes --cache: wait for the "
        "shards the next batch needs, stop with an error if the extraction dies; the schedule is over the cache's "
        "final size. Equals a run over the finished cache.")
@option("--follow-timeout", type=float, help="With --follow: give up when the extraction commits nothing for this "
        "many seconds, or when no extraction has taken the cache's lock for this many (at most 120).")
@option("--val-cache", help="A cache extracted from held-out conversations (same target and layers): held-out loss, "
        "decoding tau (greedy speculative decoding simulated along each held-out answer, what `dflash eval` measures "
        "on answers the target wrote) and expected tau at every checkpoint and at the end, in metrics.jsonl and "
        "summary.json. With --arch dflash2 it must hold the target's last hidden state (extract --last-hidden), "
        "and its drafts are the selector's greedy path, as `dflash eval` drafts.", default_text="none")
@option("--val-rows", type=int, help="Rows of --val-cache per validation (0 = all).")
@option("--val-max-new-tokens", type=int, help="The decoding tau stops each held-out answer after this many tokens, "
        "as `dflash eval --max-new-tokens` does (0 = whole answers).")
@option("--compile", type=click.Choice(["auto", "on", "off"]), help="Compiled CUDA-graph step (off = eager).", default_text="on for GPU, off for CPU")
@option("--compile-check/--no-compile-check", default=None,
        help="Before training, compare the compiled step's loss and gradients on the first batch with the eager "
             "step's (attention through SDPA); if they disagree, train eagerly and say so.")
@option("--attn", type=click.Choice(["auto", "flex", "split", "sdpa"]),
        help="Attention: flex (GPU), split (context and own block apart, exact), sdpa (dense mask, the reference).",
        default_text="flex on GPU, split on CPU")
@option("--compile-scope", type=click.Choice(["regions", "step"]),
        help="regions: the blocks and layers as one graph, the loss's chunk compiled once (fast to compile); step: "
             "the whole step as one graph (the loss's chunks unrolled).")
@option("--compile-cache", help="Where the compiled step's artifacts are saved and loaded from (a restart or a fresh "
        "machine then skips the kernel builds), or 'off'.", default_text="RUN/compile")
@option("--param-dtype", type=click.Choice(["auto", "bfloat16", "float32"]), help="Weights.", default_text="bf16 on GPU, fp32 on CPU")
@option("--log-every", type=int, help="Steps between metric logs (the only host syncs).")
@option("--save-every", type=int, help="Steps between checkpoints.")
@option("--keep-checkpoints", type=int, help="Checkpoints kept in RUN/checkpoints (oldest removed).")
@option("--loader-threads", type=int, help="Cache decoding threads.")
@option("--wandb-project", help="Log to this wandb project (rank 0).", default_text="off")
@option("--wandb-run-name", help="wandb run name.")
@option("--wandb-mode", type=click.Choice(["online", "offline", "disabled"]), help="wandb mode (offline needs no account).")
@option("--overwrite", is_flag=True, default=None, help="Start over in --out: remove what an earlier run wrote there (without it, the same run resumes).")
@option("--device", help="cpu, cuda or cuda:N.", default_text="the local rank's GPU, else cpu")
@option("--gpus", help="Launch torchrun on these GPU ids, one process each (e.g. 5,6,7).")
@option("--no-progress", is_flag=True, help="No progress bar.")
def train(preset, gpus, no_progress, **flags):
    """Train a DFlash drafter from a hidden-state cache.

    Resumes automatically when --out holds checkpoints of the same run (model, optimizer,
    schedule, data position and anchor randomness are restored exactly). With --follow it
    trains while `dflash extract` writes the cache (or `dflash pipeline` runs both).

    \b
    Multi-GPU:  torchrun --nproc-per-node 3 -m dflash train ...   (or --gpus 5,6,7)
    """
    refuse_gpus_under_torchrun(gpus)
    from dflash.train.fit.trainer import TrainConfig, run_train

    if no_progress:
        flags["progress"] = False
    if flags.get("draft_layer_types") is not None:
        flags["draft_layer_types"] = [k.strip() for k in flags["draft_layer_types"].split(",")]
    check_time_budget(flags)
    cfg = in_path_forms(build(TrainConfig, preset, "train", flags), {"cache": "read", "val_cache": "read"})  # fails once
    refuse_dflash2_flags(cfg.arch, flags)
    check_paths(out=cfg.out, read={"target": cfg.target})
    if not cfg.follow:  # --follow: the cache may not exist yet
        check_cache_path(cfg.cache, "cache")
    check_cache_path(cfg.val_cache, "val_cache")
    check_target(cfg.target)
    relaunch_with_gpus(gpus, "train")
    run_train(cfg)


def check_time_budget(flags: dict) -> None:
    """--time-budget as seconds (train/fit/config.py parse_duration); beside a --max-steps or --epochs flag, which
    would also set the run's steps, one error line naming both."""
    from dflash.train.fit.config import parse_duration

    flags["time_budget_s"] = parse_duration(flags.get("time_budget_s"))
    other = next((k for k in ("max_steps", "epochs") if flags.get(k) is not None), None)
    if flags["time_budget_s"] is not None and other:
        raise ConfigError(f"--time-budget and {flag(other)} both set the run's steps: give one (--time-budget chooses "
                          "the steps that fill the time)", "time_budget_s")


def refuse_dflash2_flags(arch: str, flags: dict) -> None:
    """A DFlash2 setting given as a flag to another arch is an error, even at its default (a preset's values are
    unused there, and the trainer says so: one preset may serve both archs)."""
    from dflash.train.fit.config import DFLASH2_ONLY, DFLASH2_SETTINGS

    given = [name for name in DFLASH2_SETTINGS if flags.get(name) is not None]
    if given and arch != "dflash2":
        raise ConfigError(f"{flag(given[0])} {DFLASH2_ONLY}", given[0])


@main.command()
@click.option("--target", required=True, help="The frozen target (HF directory or .gguf).")
@click.option("--data", required=True, help="Chat data for `dflash extract`.")
@click.option("--cache", required=True, help="The cache: `dflash extract`'s --out, `dflash train`'s --cache.")
@click.option("--out", required=True, help="The run directory of `dflash train`.")
@click.option("--config", "preset", help="A YAML preset for both (path or name in configs/).")
@click.option("--extract-gpus", help="GPU ids of the extraction, one process each (e.g. 0,1,2,3,4).  "
              "[default: one process on its default device]")
@click.option("--train-gpus", help="GPU ids of the trainer, one process each (e.g. 5,6,7; the same id as "
              "--extract-gpus shares that GPU).  [default: one process on its default device]")
@click.option("--extract-args", default="", help='More `dflash extract` flags, as one string: "--seq-len 4096 '
              '--hidden-dtype fp8".')
@click.option("--train-args", default="", help='More `dflash train` flags, as one string: "--epochs 2".')
@click.option("--arch", type=click.Choice(["dflash", "dflash2"]),
              help="The trainer's --arch. dflash2 (here, in --train-args or in the preset) makes the extraction record "
                   "the target's last hidden state (extract --last-hidden), and refuses an existing --cache without it."
                   "  [default: --train-args' or the preset's, else dflash]")
@click.option("--status-every", type=float, default=60.0, show_default=True,
              help="Seconds between the lines that say how far both are.")
@click.option("--json", "json_out", help="Also write both summaries and the wall clock to this JSON file.")
def pipeline(**kw):
    """Extract and train at the same time: `dflash extract` and `dflash train --follow` as two jobs.

    The trainer reads each shard once the extraction commits it and equals a run over the finished
    cache. Output is forwarded behind [extract] / [train]; both rates are reported. Rerun to resume.
    On one GPU both share it (each slower than alone; see dflash/pipeline.py for what that costs).
    """
    kw = path_forms(kw, {"cache": "write"})
    check_paths(json=kw["json_out"], out=kw["out"], target=kw["target"], data=kw["data"])
    check_output_dir(kw["cache"], "cache")
    check_apart(kw["cache"], "cache", data=kw["data"], target=kw["target"])
    check_run_apart_from_cache(kw["out"], kw["cache"])  # before either job starts, not when train's own check runs
    from dflash.pipeline import PipelineConfig, run_pipeline

    sys.exit(run_pipeline(PipelineConfig(**kw)))


@main.command("eval")
@option("--target", help="The target model (HF directory or .gguf).")
@option("--drafter", help="A drafter checkpoint (e.g. RUN/final).")
@option("--data", help="Prompts: a chat dataset; each row's turns before its first assistant turn (or a `prompt` field).")
@option("--config", "preset", help="A YAML preset (path or name in configs/); flags override it.")
@option("--split", help="Dataset split.")
@option("--max-prompts", type=int, help="Evaluate at most N prompts.")
@option("--skip-prompts", type=int, help="Skip the first N rows (e.g. to reach a held-out tail).")
@option("--max-new-tokens", type=int, help="Tokens to generate per prompt.")
@option("--ngram-max", type=int, help="Longest n-gram for the prompt-lookup baseline.")
@option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), help="Target dtype.", default_text="bf16 on GPU, fp32 on CPU")
@option("--device", help="cpu, cuda or cuda:N.", default_text="the GPU when there is one, else cpu")
@option("--threads", type=int, help="Intra-op CPU threads while decoding.",
        default_text="1 on a CPU ($OMP_NUM_THREADS when set); on a GPU left as they are")
@option("--chat-template-kwargs", multiple=True, metavar="KEY=VALUE", help="Extra template variables.")
@option("--json", "json_out", help="Write the full report here: target, dflash and ngram each with tau, speedup, identical, per-prompt tau, "
             "histograms and timings; sets and categories likewise (schema dflash.eval/1, every key described in "
             "train/evaluate/eval.py's docstring).")
@option("--plot", help="Write the acceptance-by-slot bar chart (PNG) here.")
@option("--target-graph/--no-target-graph", default=None,
        help="Decode the target in CUDA graphs over a static KV cache (one replay per step, as serving engines run "
             "it); off: the eager HF forward. Its outputs are checked against the target's own either way.",
        default_text="on a GPU, for Llama/Qwen2/Qwen3/Mistral-type targets and Qwen3.5/3.6 hybrids "
                     "(not their MoE)")
@option("--draft-graph/--no-draft-graph", default=None,
        help="Run the drafter's step (the verified block into its context, then the next draft) as one CUDA "
             "graph, checked against the eager step once (near ties aside).",
        default_text="on a GPU")
@option("--no-progress", is_flag=True, help="No progress bar.")
def eval_cmd(preset, no_progress, **flags):
    """Measure a drafter by real greedy speculative decoding: tau, speed-up, losslessness.

    Also runs n-gram prompt lookup on the same prompts, so every eval shows what the drafter adds.
    """
    from dflash.train.evaluate.eval import EvalConfig, format_report, run_eval

    flags["chat_template_kwargs"] = parse_kv(flags["chat_template_kwargs"], "chat_template_kwargs") or None
    if no_progress:
        flags["progress"] = False
    cfg = in_path_forms(build(EvalConfig, preset, "eval", flags))
    check_paths(json=cfg.json_out, plot=cfg.plot, read={"target": cfg.target, "drafter": cfg.drafter, "data": cfg.data})
    check_target(cfg.target)
    click.echo(format_report(run_eval(cfg)))


@main.command()
@option("--target", help="The target model that writes the answers: a local HF model directory or a .gguf file.")
@option("--data", help="Chat data: a json/jsonl/parquet file, a glob, a directory, or a save_to_disk dataset "
        "(OpenAI `messages`, ShareGPT `conversations`, or a `prompt` column).")
@option("--out", help="Directory for the regenerated dataset (`messages` jsonl parts, read by `dflash extract --data`).")
@option("--config", "preset", help="A YAML preset (path or name in configs/); flags override it.")
@option("--split", help="Dataset split.")
@option("--max-samples", type=int, help="Use only the first N conversations.")
@option("--max-new-tokens", type=int, help="Longest answer per assistant turn; longer ones are cut and counted as truncated.")
@option("--temperature", type=float, help="Sampling temperature; 0 = greedy.")
@option("--top-p", type=float, help="Nucleus sampling mass (with --temperature > 0).")
@option("--seed", type=int, help="Sampling seed; a conversation's text depends only on it, its row and the settings.")
@option("--chat-template", help="A Jinja chat template file to use instead of the tokenizer's.")
@option("--chat-template-kwargs", multiple=True, metavar="KEY=VALUE", help="Extra template variables, e.g. enable_thinking=false.")
@option("--part-size", type=int, help="Conversations per committed part (the unit of resume).")
@option("--batch-size", type=int, help="Sequences decoded together.", default_text="256 on GPU, 32 on CPU")
@option("--max-batch-tokens", type=int, help="Bound on sequences x KV-cache length.", default_text="what fits free GPU memory at the peak (~2.5x the admitted tokens); 4 GiB peak on CPU")
@option("--prefill-tokens", type=int, help="Padded prompt tokens per prefill forward.", default_text="16384 on GPU, 2048 on CPU")
@option("--turns", type=click.Choice(["all", "last"]),
        help="all: every assistant turn, each after the target's own earlier answers; last: only the last one, after "
        "the history as the data has it (its answers kept as context, marked weight 0: extract does not train on "
        "them). One sample per user turn + --turns last = the target answering real histories.")
@option("--continue-turns/--no-continue-turns", default=None,
        help="Let a conversation's next turn go on in its row of the batch (the ids between the turns are fed one per "
             "decode step) instead of prefilling its whole history again; the same text either way.")
@option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), help="Target dtype.", default_text="bf16 on GPU, fp32 on CPU")
@option("--target-graph/--no-target-graph", default=None,
        help="Decode the target in CUDA graphs over a static KV cache (one replay per step, as serving engines run "
             "it); off: the eager HF forward. The same text either way in float32.",
        default_text="on a GPU, for Llama/Qwen2/Qwen3/Mistral-type targets and Qwen3.5/3.6 hybrids "
                     "(not their MoE)")
@option("--overwrite", is_flag=True, default=None, help="Start over in an --out written with other settings.")
@option("--device", help="cpu, cuda or cuda:N.", default_text="the local rank's GPU, else cpu")
@option("--threads", type=int, help="Intra-op CPU threads while decoding.",
        default_text="1 on a CPU ($OMP_NUM_THREADS when set); on a GPU left as they are")
@option("--gpus", help="Launch torchrun on these GPU ids, one process each (e.g. 0,1,2,3).")
@option("--json", "json_out", help="Also write the run summary to this JSON file.")
@option("--no-progress", is_flag=True, help="No progress bar.")
def regenerate(preset, gpus, json_out, no_progress, **flags):
    """Regenerate every assistant turn of a chat dataset with the target itself.

    System and user turns are kept; each assistant turn is rewritten by the target, turn by
    turn (a turn's prompt holds the target's own earlier answers). DFlash drafters learn the
    target's own distribution: train on what the target would say. Parts of --part-size
    conversations are committed as they finish; rerunning the same command resumes, and a
    changed setting is an error unless --overwrite. Truncated, empty and skipped
    conversations are counted in OUT/dflash_regenerate.json.

    \b
    Then:       dflash extract --data OUT ...
    Multi-GPU:  torchrun --nproc-per-node 4 -m dflash regenerate ...   (or --gpus 0,1,2,3)
    """
    refuse_gpus_under_torchrun(gpus)
    from dflash.extract.generation.regenerate import RegenerateConfig, run_regenerate

    flags["chat_template_kwargs"] = parse_kv(flags["chat_template_kwargs"], "chat_template_kwargs") or None
    if no_progress:
        flags["progress"] = False
    cfg = in_path_forms(build(RegenerateConfig, preset, "regenerate", flags))  # before --gpus: fails once
    json_out = path_form(json_out, "json")
    check_paths(json=json_out, chat_template=cfg.chat_template, out=cfg.out, data=cfg.data, target=cfg.target)
    check_target(cfg.target)
    relaunch_with_gpus(gpus, "regenerate")
    summary = run_regenerate(cfg)
    if json_out:
        from dflash.core.dist import write_json0

        write_json0(json_out, summary)


@main.command()
@option("--target", help="The instruction-tuned target that writes the turns: a local HF model directory or a .gguf file.")
@option("--out", help="Directory for the prompts (OUT/prompts.jsonl, read by `dflash regenerate --data OUT`).")
@option("--config", "preset", help="A YAML preset (path or name in configs/); flags override it.")
@option("--num", type=int, help="User turns to sample (those kept are fewer: the unended, empty and repeated are dropped).")
@option("--max-new-tokens", type=int, help="A turn must end within this many tokens to be kept.")
@option("--temperature", type=float, help="Sampling temperature (> 0).")
@option("--top-p", type=float, help="Nucleus sampling mass.")
@option("--seed", type=int, help="Sampling seed; row i's text depends only on it, i and the settings.")
@option("--chat-template", help="A Jinja chat template file to use instead of the tokenizer's.")
@option("--chat-template-kwargs", multiple=True, metavar="KEY=VALUE", help="Extra template variables, e.g. enable_thinking=false.")
@option("--part-size", type=int, help="Rows per written part (the unit of resume).")
@option("--batch-size", type=int, help="Sequences sampled together.", default_text="256 on GPU, 32 on CPU")
@option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), help="Target dtype.", default_text="bf16 on GPU, fp32 on CPU")
@option("--target-graph/--no-target-graph", default=None,
        help="Decode the target in CUDA graphs over a static KV cache (one replay per step, as serving engines run "
             "it); off: the eager HF forward. The same text either way in float32.",
        default_text="on a GPU, for Llama/Qwen2/Qwen3/Mistral-type targets and Qwen3.5/3.6 hybrids "
                     "(not their MoE)")
@option("--overwrite", is_flag=True, default=None, help="Start over in an --out written with other settings.")
@option("--device", help="cpu, cuda or cuda:N.", default_text="the GPU when there is one, else cpu")
@option("--threads", type=int, help="Intra-op CPU threads while decoding.",
        default_text="1 on a CPU ($OMP_NUM_THREADS when set); on a GPU left as they are")
@option("--json", "json_out", help="Also write the record (settings, counts, seconds) to this JSON file.")
@option("--no-progress", is_flag=True, help="No progress bar.")
def prompts(preset, json_out, no_progress, **flags):
    """Sample user turns from the target itself: prompts for training data beyond the data at hand.

    An instruction-tuned target, given its chat template up to where a user's words
    begin, writes a user turn of the kind it was tuned on (Magpie's pre-query
    template). Turns that end on their own within --max-new-tokens, are not empty and
    are distinct are kept in OUT/prompts.jsonl; counts and settings in
    OUT/dflash_prompts.json. Rerunning the same command resumes (by parts); a changed
    setting is an error unless --overwrite. One process (one GPU).

    \b
    Then:  dflash regenerate --target T --data OUT --out ANSWERS   (the target answers them)
           and mix ANSWERS with your other data for `dflash extract`.
    """
    from dflash.extract.generation.prompts import PromptsConfig, run_prompts

    flags["chat_template_kwargs"] = parse_kv(flags["chat_template_kwargs"], "chat_template_kwargs") or None
    if no_progress:
        flags["progress"] = False
    cfg = in_path_forms(build(PromptsConfig, preset, "prompts", flags))
    json_out = path_form(json_out, "json")
    check_paths(json=json_out, chat_template=cfg.chat_template, out=cfg.out, target=cfg.target)
    check_target(cfg.target)
    record = run_prompts(cfg)
    if json_out:
        from dflash.core.io import atomic_json

        atomic_json(json_out, record)


def _check_drafter(path: str, after_export: bool = False) -> None:
    """The serving contract check of the drafter at `path`: its table, then one verdict line (exit 2 on a misread)."""
    from dflash.train.serve.contract import ContractError, check_drafter, format_table, summary

    v = check_drafter(path)
    click.echo(format_table(v))
    if not v.ok:
        raise ContractError(summary(v) + (" (the export is written; serve it only where it is read as trained)"
                                          if after_export else ""))
    click.echo(f"check: {summary(v)}")


def _drafter_arg(path: str) -> str:
    """DRAFTER of export and check in its path form (a file:// URL is its local path; other URLs are refused)."""
    return path_form(path, "DRAFTER")


@main.command()
@click.argument("drafter")
@click.option("--format", "fmt", type=click.Choice(["zlab", "speculators"]), default="zlab", show_default=True,
              help="zlab: the layout DFlash drafters are published in (SGLang, vLLM, TensorRT-LLM serve DFlash from "
                   "it); speculators: speculators' own format (DFlash, or DFlash2 for a DFlash2 drafter).")
@click.option("--out", help="The export's directory (new, empty, or an earlier export); a local path or file:// URL.")
@click.option("--target", help="The target it was trained for (recorded by the run; speculators needs it).")
@click.option("--chat-template-kwargs", multiple=True, metavar="KEY=VALUE",
              help="The chat template kwargs the training data was rendered with (recorded in the export and its "
                   "README), when the run's cache does not record them.")
@click.option("--check", "check_only", is_flag=True,
              help="Check DRAFTER (or, with --out, the export) against each engine's reading; exit 2 on a misread.")
def export(drafter, fmt, out, target, chat_template_kwargs, check_only):
    """Write DRAFTER (RUN/final) as a checkpoint each serving engine reads with the trained semantics.

    Layer ids, block size, mask token and per-layer attention are written where each engine looks for them, with
    a README.md naming, per engine, whether and how it serves the drafter (SGLang, vLLM and TensorRT-LLM serve
    DFlash only; a DFlash2 drafter is written as DFlash2). The files get the mode the umask gives new files (0644
    under umask 022, readable by a server of another user; 0600 under 077). The export is checked as it is written:
    a misread is a warning line (with --check: the table, and exit 2). --check alone replays how SGLang, vLLM,
    TensorRT-LLM and speculators would read DRAFTER (`dflash check`).
    """
    drafter, out, target = _drafter_arg(drafter), path_form(out, "out"), path_form(target, "target")
    check_paths(read={"drafter": drafter})
    if out is None and not check_only:
        raise click.UsageError("--out is required (or --check alone to check DRAFTER)")
    if out is not None:
        from dflash.train.serve.contract import check_drafter, summary
        from dflash.train.serve.export import export as write_export

        kwargs = parse_kv(chat_template_kwargs, "chat_template_kwargs") or None
        check_paths(out=out)
        write_export(drafter, fmt, out, target=target, chat_template_kwargs=kwargs)
        click.echo(f"export: {fmt} layout -> {out} (README.md names the engines that serve it)")
        if not check_only:
            v = check_drafter(out)
            if not v.ok:
                click.echo(f"warning: {summary(v)} (`dflash check {out}` shows each engine's reading)", err=True)
    if check_only:
        _check_drafter(out or drafter, after_export=out is not None)


@main.command()
@click.argument("drafter")
def check(drafter):
    """How SGLang, vLLM, TensorRT-LLM and speculators would read DRAFTER: architecture, target layers, block, mask
    token, attention per layer, weights. A RUN/final is checked against what RUN/run.json records the run trained.
    Exit 2 with one line naming each engine and field that would misread."""
    drafter = _drafter_arg(drafter)
    check_paths(read={"drafter": drafter})
    _check_drafter(drafter)


@main.command(help=f"""Run the whole pipeline on the built-in real model: SmolLM2-135M-Instruct + chitchat.

    Prepare the target (bundled GGUF -> bf16 folder), regenerate replies with the target, extract
    hidden states, train a small drafter, and measure it by speculative decoding against n-gram
    prompt lookup on held-out prompts. The CPU recipe took {cpu_demo_time()} on an idle 2-core CPU (every
    stage is CPU-bound: longer with fewer free cores); the GPU recipe (configs/demo-gpu.yaml: user turns the target
    writes itself, chitchat and three other sources, all answered by the target, MT-Bench kept out as the
    out-of-source set, a 4-layer block-16 drafter trained while the cache is extracted) 13 min 51 s on one
    H200 from nothing to both evals, measured. Rerun to resume; a finished demo prints its stored result.
    """)
@click.option("--recipe", type=click.Choice(["auto", "cpu", "gpu", "gpu-coder"]), default="auto", show_default=True,
              help="cpu: the 2-core recipe; gpu: ~68k samples of five sources on one GPU (configs/demo-gpu.yaml); "
                   "gpu-coder: the GPU recipe on Qwen2.5-Coder-Instruct, evaluated on HumanEval and MT-Bench "
                   "(configs/demo-gpu-coder.yaml; its target once: `make coder-assets`); "
                   "auto: gpu when CUDA is available.")
@click.option("--workdir", help="Where everything is written (reruns resume).  [default: work/demo, GPU: work/demo-gpu, "
                                "gpu-coder: work/demo-gpu-coder, with --coder-model 1.5b work/demo-gpu-coder-1.5b]")
@click.option("--config", help="The GPU recipe's preset (path or name in configs/).  [default: demo-gpu]")
@click.option("--responses", type=click.Choice(["regenerate", "original"]), default="regenerate", show_default=True,
              help="Train on the target's own regenerated replies (the DFlash recipe) or the dataset's human replies.")
@click.option("--train-prompts", type=BOUNDED_INT, help=f"Training conversations (CPU recipe).  [default: {CPU_SIZES['train_prompts']}]")
@click.option("--eval-prompts", type=BOUNDED_INT, help=f"Held-out prompts for eval.  [default: CPU {CPU_SIZES['eval_prompts']}, GPU: preset]")
@click.option("--train-steps", type=BOUNDED_INT, help=f"Drafter training steps.  [default: CPU {CPU_SIZES['train_steps']}, GPU: preset]")
@click.option("--drafter-layers", type=BOUNDED_INT, help=f"Drafter layers.  [default: CPU {CPU_SIZES['drafter_layers']}, GPU: preset]")
@click.option("--compare", type=click.Choice(["dflash2"]),
              help="GPU recipe: also train a DFlash2 drafter from the same cache (extracted with --last-hidden) for "
                   "the same training time (DFlash trains the preset's steps; DFlash2 trains with --time-budget = "
                   "DFlash's training time, so it gets the steps that time buys), evaluate both the same way and put "
                   "them side by side in the summary (tau in source and on MT-Bench, over n-gram's, speed-ups, steps, "
                   "training times).  [default workdir: work/demo-gpu-dflash2]")
@click.option("--coder-model", type=click.Choice(["0.5b", "1.5b"]),
              help="gpu-coder: the target, Qwen2.5-Coder-0.5B- or 1.5B-Instruct (configs/demo-gpu-coder-1.5b.yaml: "
                   "~18 min from nothing on one H100, measured).  [default: 0.5b, ~14 min measured on one H100; "
                   "workdir work/demo-gpu-coder(-1.5b)]")
@click.option("--coder-dir", help="gpu-coder: the folder holding the target's GGUF, joined and checked by "
                                  "`make coder-assets`.  [default: work/coder]")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, or auto (the GPU when there is one).")
@click.option("--no-progress", is_flag=True, help="No progress bars (logs only).")
def demo(no_progress, **kw):
    kw = path_forms(kw)
    check_output_dir(kw.get("workdir"), "workdir")
    if kw.get("device") not in (None, "auto"):  # before minutes of preparation, not at the first stage that uses it
        from dflash.core.dist import parse_device

        parse_device(kw["device"])
    from dflash.recipes.run_demo import run_demo  # the recipes load torch: only when the demo runs

    run_demo(DemoConfig(**kw, progress=not no_progress))


if __name__ == "__main__":
    main()
