"""The `dflash` command: a thin click layer over the library; each subcommand lives in its own module.

Multi-GPU: run any GPU command under torchrun, e.g.
    torchrun --nproc-per-node 5 -m dflash extract ...
or let it launch torchrun for you with --gpus 0,1,2,3,4.
"""

from __future__ import annotations

import json
import sys

import click

import dflash_cache


class CleanErrors(click.Group):
    """Known errors (bad input, bad cache) print one clear line and exit 2, never a deep traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except dflash_cache.CacheError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=CleanErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dflash")
def main():
    """Train DFlash speculative-decoding drafters for a Hugging Face causal LM.

    \b
    Pipeline:  regenerate (optional) -> extract -> train -> eval
    extract runs the frozen target once and writes hidden states to a cache on disk;
    train reads that cache (as often as you like) on other GPUs; eval measures the
    drafter by real speculative decoding. `dflash demo` runs it all on a tiny real model.
    """


@main.group()
def cache():
    """Inspect and check a hidden-state cache."""


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
    rep = dflash_cache.info(path)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
        return
    m = rep["metadata"]
    info = m.get("info", {})
    target = info.get("target", {})
    lines = [
        ("path", rep["path"]),
        ("status", "complete" if rep["complete"] else f"INCOMPLETE ({rep['shards_committed']}/{rep['shards_planned']} shards committed)"),
        ("target", f"{target.get('name_or_path', '?')} ({target.get('num_layers', '?')} layers, hidden {m['hidden_size']})"),
        ("layers captured", str(m["layer_ids"])),
        ("rows", f"{rep['rows']} x {rep['seq_len']} tokens ({rep['shards_committed']} shards of {m['rows_per_shard']} rows)"),
        ("real tokens", f"{rep['real_tokens']:,} ({rep['supervised_tokens']:,} supervised)"),
        ("padding", f"{100 * rep['padding_fraction']:.2f}% of stored tokens"),
        ("on disk", f"{_human(rep['bytes_on_disk'])} ({m['codec']}; {rep['bytes_per_real_token'] or 0:,.0f} bytes per real token, "
                    f"raw bf16 hidden = {rep['raw_hidden_bytes_per_token']:,})"),
        ("format", f"{m['format']} v{m['format_version']}"),
    ]
    for k in ("data_fingerprint", "tokenizer_fingerprint", "chat_template_fingerprint"):
        if k in info:
            lines.append((k.replace("_", " "), info[k]))
    w = max(len(k) for k, _ in lines)
    for k, v in lines:
        click.echo(f"{k:<{w}}  {v}")


@cache.command("verify")
@click.argument("path")
@click.option("--threads", default=4, show_default=True, help="Decoding threads.")
def cache_verify(path, threads):
    """Re-read every shard, check checksums and shapes; exit 1 naming every bad shard."""
    from tqdm import tqdm

    c = dflash_cache.open(path, allow_incomplete=True)
    with tqdm(total=len(c.commits), desc="verify", unit="shard", disable=None) as bar:
        rep = dflash_cache.verify(path, threads=threads, progress=bar.update)
    click.echo(f"{path}: {len(rep.shards_ok)} of {rep.shards_planned} shards OK, {rep.bytes_checked / 1e9:.2f} GB decoded")
    for s, problems in sorted(rep.bad.items()):
        for p in problems:
            click.echo(f"BAD shard {s:06d}: {p}")
    if rep.uncommitted:
        head = ", ".join(f"{s:06d}" for s in rep.uncommitted[:20])
        more = f" (+{len(rep.uncommitted) - 20} more)" if len(rep.uncommitted) > 20 else ""
        click.echo(f"NOT COMMITTED ({len(rep.uncommitted)} shards): {head}{more} - rerun the extraction to finish them")
    if not rep.ok:
        sys.exit(1)
    click.echo("OK")


if __name__ == "__main__":
    main()
