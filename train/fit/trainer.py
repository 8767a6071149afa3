"""`dflash train`: fixed-shape batches from the cache -> compiled CUDA-graph steps -> servable drafter.

One process per GPU under torchrun (data parallel: every rank holds the whole drafter, reads a
disjoint part of each epoch, and gradients are averaged with one all-reduce per step); a single
process on CPU for tests and the demo.

The step (nothing in it syncs with the host or changes shape):
    for each of grad_accum micro-batches:
        mark the CUDA-graph step; loss, metrics = compiled forward (anchors drawn on the device)
        loss.backward()                           # the compiled backward: also a CUDA graph
        copy/add the grads into one flat buffer, drop them (they live in the graph's memory pool)
        add the metrics (cloned) into device accumulators
    all-reduce the flat buffer (ranks > 1); clip; fused AdamW with a tensor learning rate
The host reads the accumulators only every --log-every steps (one sync), which is also where a
non-finite loss is caught; checkpoints are written only after such a check, so the last one is
always good. Anchor randomness is a function of (seed, step, a row's slot in the step's global batch): a
resumed run draws exactly what an uninterrupted one would have, and ranks x accumulation x batch rows
that make the same global batch draw the same anchors (see Trainer.anchor_scores).

Trainer.train is the loop: train_step (the step above), log_window (the one host sync, the finiteness check,
metrics.jsonl, wandb) and checkpoint. Around it: train/fit/config.py (the settings), train/fit/run_dir.py (the run
directory and its checkpoints), train/drafter/target_head.py (embedding, LM head, mask token), train/fit/schedule.py
(learning rate, FLOPs, the chip's peak), train/fit/metrics.py (the window's accumulators, wandb),
train/fit/compile_check.py (the compiled step against the eager one), train/fit/time_budget.py (--time-budget: the steps
decided from the step time measured over a probe, recorded in RUN/run.json).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

import dflash_cache
from dflash.core import progress
from dflash.core.config import ConfigError
from dflash.core.dist import atomic_json, barrier, compute_init, print0, resolve_dtype
from dflash.core.paths import output_lock
from dflash.core.target import load_config, load_tokenizer, target_info, text_config
from dflash.core.weights import check_roles

from dflash.train.fit.compile_check import check_and_report, compile_count
from dflash.train.fit.compile_step import cache_counters
from dflash.train.fit.config import NonFiniteLoss, TrainConfig, TrainError, draft_layer_types, unused_dflash2_settings
from dflash.train.drafter.dflash2 import make_drafter
from dflash.train.fit.metrics import TrainMetrics, init_wandb
from dflash.train.drafter.model import DrafterConfig, DrafterError
from dflash.train.fit.run_dir import (check_out_path, check_run_dir, drop_metrics_after, finished_run, latest_checkpoint,
                      load_checkpoint, save_checkpoint, save_final, writing)
from dflash.train.fit.schedule import lr_at, peak_flops, step_flops
from dflash.train.drafter.target_head import load_target_head, resolve_mask_token_id

__all__ = ["TrainConfig", "TrainError", "Trainer", "lr_at", "resolve_mask_token_id", "run_train"]


@dataclass
class Window:
    """Host-side timing of the logging window (wall time, time spent waiting for data, steps) and of the run."""

    start: float
    wait: float = 0.0
    steps: int = 0
    wait_total: float = 0.0

    def restart(self) -> None:
        self.start, self.wait, self.steps = time.perf_counter(), 0.0, 0


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.dist = compute_init(cfg.device)
        dev = self.dev = self.dist.device
        self.cuda = dev.type == "cuda"
        self.param_dtype = resolve_dtype(cfg.param_dtype, dev)
        self.attn = cfg.attn if cfg.attn != "auto" else ("flex" if self.cuda else "split")
        if self.attn == "flex" and not self.cuda:
            raise ConfigError(f"--attn flex needs a CUDA device (flex_attention has no backward on {dev.type}); "
                              "use --attn split (the default there) or sdpa")
        self.compiled = cfg.compile == "on" or (cfg.compile == "auto" and self.cuda)

        hf = load_config(cfg.target)
        tc = text_config(hf)
        tinfo = target_info(cfg.target, hf)
        expect = {"hidden_size": tc.hidden_size, "target.config_hash": tinfo.config_hash}
        self.follower = None
        if cfg.follow:  # the cache may still be written, or not exist yet (train/fit/follow.py)
            from dflash.train.fit.follow import Follower

            self.follower = Follower(cfg.cache, self.dist.world, cfg.follow_timeout)
            self.follower.wait_for_cache()
        try:
            self.cache = dflash_cache.open(cfg.cache, expect=expect, threads=cfg.loader_threads, follow=cfg.follow)
        except dflash_cache.CacheMismatchError as e:
            raise TrainError(f"the cache does not belong to --target {cfg.target}: {e}") from e
        except dflash_cache.CacheIncompleteError as e:
            raise TrainError(f"{e}, or train while it is written: the same command with --follow") from e
        cache = self.cache
        if cfg.block_size > cache.seq_len:  # before anything is sized by it
            raise ConfigError(f"--block-size {cfg.block_size} is longer than the rows of --cache {cfg.cache} "
                              f"({cache.seq_len} tokens): a block must fit in a row (at most {cache.seq_len})",
                              "block_size")
        if self.follower is not None:
            self.follower.attach(cache)
            if not cache.complete:
                print0(f"train: --follow: {len(cache.commits)} of {cache.spec.num_shards} shards of {cfg.cache} are "
                       f"committed; training over its {len(cache)} planned rows as they come")
        if self.dist.is_main:  # the embedding and LM head this run takes from --target: the cache's own?

            note = check_roles(cache.metadata.get("info", {}).get("weights"), cfg.target, cfg.cache,
                               tied=bool(getattr(tc, "tie_word_embeddings", False)))
            if note:
                print0(f"train: {note}")
        unused = unused_dflash2_settings(cfg)
        if unused:
            print0(f"train: note: {', '.join(unused)} {'is a setting' if len(unused) == 1 else 'are settings'} of "
                   f"--arch dflash2, unused by this --arch {cfg.arch} run")
        self.validator = None
        if cfg.val_cache:
            from dflash.train.fit.validate import Validator

            self.validator = Validator(cfg.val_cache, cache, expect, cfg.val_rows, cfg.batch_rows, cfg.num_anchors,
                                       cfg.gamma, dev, cfg.loader_threads, cfg.val_max_new_tokens,
                                       last_hidden=cfg.arch == "dflash2")
        if cfg.arch == "dflash2" and not cache.last_hidden:
            raise TrainError(f"--arch dflash2 learns the target's distribution from its last hidden state, which "
                             f"--cache {cfg.cache} does not hold: extract it with `dflash extract ... --last-hidden`")
        tok = load_tokenizer(cfg.target)
        mask_id = resolve_mask_token_id(tok, tc.vocab_size, cfg.mask_token_id)
        dflash2 = dict(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                       selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k) \
            if cfg.arch == "dflash2" else {}
        try:
            self.dcfg = DrafterConfig.from_target(hf, num_layers=cfg.drafter_layers, layer_ids=cache.context_layer_ids,
                                                  block_size=cfg.block_size, mask_token_id=mask_id,
                                                  sliding_window=cfg.draft_window,
                                                  layer_types=draft_layer_types(cfg) or [], arch=cfg.arch,
                                                  basis_rank=cache.basis_rank, **dflash2, **(cfg.drafter_shape or {}))
        except DrafterError as e:  # a setting the target's shape does not allow (e.g. a group not dividing H)
            raise ConfigError(f"--arch {cfg.arch}: {e}") from None
        T = cache.seq_len
        if cfg.num_anchors >= T:
            raise ConfigError(f"--num-anchors {cfg.num_anchors} does not fit rows of {T} tokens (at most {T - 1})")
        if cfg.batch_rows * self.dist.world > len(cache):
            raise ConfigError(f"--batch-rows {cfg.batch_rows} x {self.dist.world} ranks needs at least "
                              f"{cfg.batch_rows * self.dist.world} rows; the cache has {len(cache)}")
        self.spe = cache.steps_per_epoch(cfg.batch_rows, self.dist.world)  # micro-batches per epoch per rank
        if cfg.max_steps:
            self.total_steps = cfg.max_steps
        else:
            self.total_steps = max(1, int(math.ceil((cfg.epochs or 1.0) * self.spe / cfg.grad_accum)))

        legacy_order = started_before_windows(cfg)
        if legacy_order:  # resume it in the order it began with: one permutation per epoch
            cfg.shuffle_window = 0
            print0(f"train: note: {cfg.out} began before the first epoch was read in windows: it goes on with one "
                   "permutation of the cache per epoch, as it began (--overwrite starts it over with windows)")
        self.resolved = {**asdict(cfg), "cache": os.path.abspath(cfg.cache) if "://" not in cfg.cache else cfg.cache,
                         "target": os.path.abspath(cfg.target), "mask_token_id": mask_id,
                         "param_dtype": str(self.param_dtype).replace("torch.", ""), "attn": self.attn,
                         "drafter": self.dcfg.to_dict(), "world": self.dist.world, "total_steps": self.total_steps,
                         "cache_data_fingerprint": cache.metadata.get("info", {}).get("data_fingerprint")}
        if legacy_order:
            del self.resolved["shuffle_window"]  # as its run.json has it: the same run
        if self.dist.is_main:
            check_run_dir(cfg, self.resolved)
        barrier()
        self.budget = None  # --time-budget (train/fit/time_budget.py): a recorded decision's total, else the provisional
        if cfg.time_budget_s is not None:
            from dflash.train.fit.time_budget import TimeBudget

            self.budget = TimeBudget(cfg.time_budget_s, cfg.time_budget_probe, cfg.out, self.dist.is_main)
            self.total_steps = self.resolved["total_steps"] = self.budget.resume(self.total_steps)

        torch.manual_seed(cfg.seed)
        self.model = make_drafter(self.dcfg, attn_impl=self.attn)
        self.model.selector_loss_alpha = cfg.selector_loss_alpha  # (dflash2's objective; unused by dflash)
        self.model.reset_parameters(seed=cfg.seed)
        self.model.to(dev, self.param_dtype)
        emb, head = load_target_head(cfg.target)
        self.model.set_target_head(emb, head)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in self.params)
        self.grad_buf = torch.zeros(n, dtype=self.param_dtype, device=dev)
        self.grad_views, off = [], 0
        for p in self.params:
            self.grad_views.append(self.grad_buf[off:off + p.numel()].view_as(p))
            off += p.numel()
        self.lr_t = torch.tensor(cfg.lr, dtype=torch.float32, device=dev)
        self.opt = torch.optim.AdamW(self.params, lr=self.lr_t, betas=(cfg.beta1, cfg.beta2),
                                     weight_decay=cfg.weight_decay, fused=True)
        self.step = 0
        ck = latest_checkpoint(cfg.out)
        if ck:
            self._restore(ck)
        elif self.dist.is_main:  # a run killed before its first checkpoint starts over: forget what it logged
            drop_metrics_after(cfg.out, 0)
        self.fwd = self.model.forward_train
        self.artifacts, self.artifacts_note = None, ""
        self.first_call: dict[str, Any] | None = None  # the first compiled call: seconds, phases, caches
        if self.compiled:  # train/fit/compile_step.py: the scope, and the saved artifacts that spare a new process
            from dflash.train.fit.compile_step import CompileArtifacts, compile_step

            where = None if cfg.compile_cache == "off" else (cfg.compile_cache or os.path.join(cfg.out, "compile"))
            self.artifacts = CompileArtifacts(where, self.step_key(hidden_dtype=cache.hidden_dtype, T=T))
            self.artifacts_note = self.artifacts.load()
            print0(f"train: {self.artifacts_note}")
            self.fwd = compile_step(self.model, cfg.compile_scope, self.cuda)
        self.nparams = n
        self.flops = step_flops(self.dcfg, cfg.batch_rows * cfg.grad_accum, T, cfg.num_anchors)
        self.gen = torch.Generator(device=dev)
        self.check: dict[str, Any] | None = None
        self.peak = peak_flops(dev)  # None off CUDA or on a chip not in the table: no MFU then
        # the loop's state (train() starts each afresh): the window's metrics, its records, the last checkpoint
        # written, and the pinned batch whose copy to the device may still be in flight
        self.metrics = TrainMetrics.zeros(self.dcfg.block_size - 1, cfg.log_every * cfg.grad_accum, dev)
        self.history: list[dict] = []
        self.last_good: str | None = None
        self.pinned = None
        self.val_time = 0.0  # seconds of validation inside the current window (not step time)
        self.val_total = 0.0  # ... and in the whole process (not training time: the time budget's probe)

    def step_key(self, **more) -> dict[str, Any]:
        """What the compiled step's code depends on (the key of its saved artifacts)."""
        cfg = self.cfg
        return {"drafter": self.dcfg.to_dict(), "batch_rows": cfg.batch_rows, "num_anchors": cfg.num_anchors,
                "gamma": cfg.gamma, "attn": self.attn, "param_dtype": str(self.param_dtype),
                "scope": cfg.compile_scope, "device": self.dev.type, **more}

    def verify_compiled(self, x: dict, scores: torch.Tensor) -> None:
        """Check the compiled step against the eager one once; on disagreement train eagerly (compile_check.py)."""
        cfg = self.cfg
        args = (x["hidden"], x["input_ids"], x["loss_mask"], x["doc_ids"], scores, cfg.num_anchors, cfg.gamma,
                x.get("hidden_scales"))
        before = cache_counters()
        self.check, passed = check_and_report(self.fwd, self.model, self.params, args, self.cuda, self.dist)
        self.note_first_call(self.check["compiled_s"], self.check.get("compile_phases", {}), before)
        if not passed:
            self.compiled = False
            self.fwd = self.model.forward_train

    def note_first_call(self, seconds: float, phases: dict, before: dict[str, int]) -> None:
        """The first compiled call (forward + backward of one micro-batch, compilation included): how long, where
        the time went, and whether its graphs were built (fresh) or came from inductor's cache (warm)."""
        after = cache_counters()
        got = {k: after[k] - before.get(k, 0) for k in after}
        state = ("warm" if got["fx_graph_cache_hit"] and not got["fx_graph_cache_miss"] else
                 "fresh" if got["fx_graph_cache_miss"] and not got["fx_graph_cache_hit"] else
                 "partly warm" if got["fx_graph_cache_hit"] else "no inductor cache")
        self.first_call = {"seconds": round(seconds, 2), "caches": state, **got, "scope": self.cfg.compile_scope,
                           "artifacts": self.artifacts_note, "phases": phases}
        if self.check is None:  # the check's line says it otherwise
            print0(f"train: first compiled call {seconds:.0f} s ({state}: {got['fx_graph_cache_miss']} graphs built, "
                   f"{got['fx_graph_cache_hit']} from the cache; scope {self.cfg.compile_scope})")

    def _restore(self, ck: str) -> None:
        st = load_checkpoint(ck, self.model, self.opt, self.dev)
        for g in self.opt.param_groups:  # keep our lr tensor (the schedule writes into it)
            g["lr"] = self.lr_t
        self.step = int(st["step"])
        if self.budget is not None:  # the total in effect at this step (a --time-budget revised later is replayed)
            self.total_steps = self.resolved["total_steps"] = self.budget.total_at(self.step, self.total_steps)
        if self.follower is not None:
            self.follower.checkpoint_step = self.step
        if int(st.get("total_steps", self.total_steps)) != self.total_steps:
            print0(f"train: note: this run now has {self.total_steps} steps (the checkpoint was written in a run of "
                   f"{st['total_steps']}); the learning-rate schedule is stretched from step {self.step} on")
        if self.dist.is_main:  # drop records logged after the checkpoint we resume from
            drop_metrics_after(self.cfg.out, self.step)
        print0(f"train: resumed from {ck} at step {self.step}")

    # -- data ---------------------------------------------------------------------------------
    def micro_batches(self, start_micro: int):
        """Endless micro-batches from micro-step `start_micro` on, epoch after epoch: one reader whose
        threads and pinned buffers outlive epochs and which decodes ahead across their boundaries."""
        cfg, d = self.cfg, self.dist
        epoch, within = divmod(start_micro, self.spe)
        m = start_micro
        for b in self.cache.batches(cfg.batch_rows, rank=d.rank, world=d.world, epoch=epoch, seed=cfg.seed,
                                    start_step=within, epochs=None, prefetch=cfg.prefetch,
                                    threads=cfg.loader_threads, pin_memory=self.cuda, check=True,  # CRC every chunk
                                    quantized=True,  # fp8/fp4 caches: bytes + scales, dequantised in the step
                                    window_rows=cfg.shuffle_window, wait=self.follower):  # --follow: wait for shards
            yield m, b
            m += 1

    def anchor_scores(self, micro: int, rows: int, T: int) -> torch.Tensor:
        """This rank's anchor scores [rows, T] for micro-step `micro`: its slice of one draw per optimizer step,
        [grad_accum * world * rows, T] seeded by (seed, step), taken at global slot (a * world + rank) * rows
        for micro-batch a of the step. The reader gives rank r of micro-batch a the rows of that same slot
        (Cache.epoch_order), so a row's anchors depend on (seed, step, its slot in the step's global batch)
        only: two ranks with batch b, or accumulation 2 x batch b, draw the anchors of one process with batch
        2b (tests/test_ddp.py, tests/test_accum.py); a resumed run draws what an uninterrupted one draws. One
        process without accumulation draws what it always did (seed (seed * 1_000_003 + step) * 65_537)."""
        step, a = divmod(micro, self.cfg.grad_accum)
        world = self.dist.world
        self.gen.manual_seed((self.cfg.seed * 1_000_003 + step) * 65_537)
        scores = torch.rand(self.cfg.grad_accum * world * rows, T, generator=self.gen, device=self.dev)
        first = (a * world + self.dist.rank) * rows
        return scores[first:first + rows]

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg, dist = self.cfg, self.dist
        done = finished_run(cfg.out, self.step, self.total_steps)
        if done is not None:  # a rerun of a finished run: final/ and what was measured on it stay as they are
            print0(f"train: nothing to do: {cfg.out} finished its {self.total_steps} steps (final/ kept)")
            return done
        if self.budget is not None:  # a pending decision: the provisional total reaches past the probe
            self.total_steps = self.budget.start(self.step, self.total_steps)
        logger = init_wandb(cfg, self.resolved, dist.is_main)
        self.metrics.reset()
        self.history, self.last_good, self.pinned, self.val_time = [], None, None, 0.0
        data = self.micro_batches(self.step * cfg.grad_accum)
        bar = progress.bar(cfg.progress and dist.is_main, total=self.total_steps, initial=self.step, desc="train",
                           unit="step", warmup=3)  # the ETA's rate is timed after the compiled step's warm-up
        window = Window(time.perf_counter())
        t_start, steps_done = time.perf_counter(), 0
        self.t_loop = t_start  # trained_s: --time-budget's clock
        compiles_at_warm = None
        import torch._dynamo as dynamo

        try:
            while self.step < self.total_steps:
                lr = lr_at(self.step, self.total_steps, cfg)
                wait = self.train_step(data, lr)
                window.wait += wait
                window.wait_total += wait
                self.step += 1
                window.steps += 1
                steps_done += 1
                bar.update(1)
                if self.budget is not None:  # decided or revised before the end's log and checkpoint
                    decided = self.budget.after_step(self.step, self.trained_s, self.slowest)
                    if decided is not None:
                        self.total_steps = self.resolved["total_steps"] = bar.total = decided
                if self.compiled and self.step == min(3, self.total_steps):
                    compiles_at_warm = compile_count()
                    dynamo.config.error_on_recompile = True  # a recompile after warm-up fails loudly
                    if dist.is_main and self.artifacts is not None and not self.artifacts.loaded:
                        note = self.artifacts.save()  # every graph of the step is built by now
                        if note:
                            print0(f"train: {note}")
                is_log = self.step % cfg.log_every == 0 or self.step == self.total_steps
                is_save = self.step % cfg.save_every == 0 or self.step == self.total_steps
                if is_log or is_save:
                    val = self.validate() if is_save else None
                    self.log_window(window, lr, logger, bar, val)
                if is_save:
                    self.checkpoint()
        finally:
            bar.close()
            if self.pinned is not None:
                self.pinned[1].release()
            data.close()  # stops the reader's threads
            dynamo.config.error_on_recompile = False
        elapsed = time.perf_counter() - t_start
        recompiles = (compile_count() - compiles_at_warm) if compiles_at_warm is not None else 0
        if dist.is_main:
            self.save_final()
        barrier()
        logger.finish()
        out = {"steps": self.step, "history": self.history, "elapsed_s": elapsed, "steps_this_run": steps_done,
               "data_wait_frac": window.wait_total / elapsed if elapsed > 0 else 0.0,
               "recompiles_after_warmup": recompiles, "final": os.path.join(cfg.out, "final"), "params": self.nparams,
               "compiled": self.compiled, "compile_check": self.check, "first_compiled_call": self.first_call,
               "val": next((h for h in reversed(self.history) if "val_loss" in h), None),
               "time_budget": self.budget.record if self.budget is not None else None}
        if self.follower is not None:  # the rate of the last log window, for a run that waited only at its start
            last = next((h for h in reversed(self.history) if "ctx_tokens_per_s" in h), None)
            out["follow"] = self.follower.summary(last["ctx_tokens_per_s"] / self.cache.seq_len if last else None)
        if dist.is_main:
            atomic_json(os.path.join(cfg.out, "summary.json"), out)
        return out

    def train_step(self, data, lr: float) -> float:
        """One optimizer step on the device: grad_accum micro-batches (forward, backward, gradients copied or added
        into the flat buffer, metrics added to self.metrics), the all-reduce, the clip and AdamW at lr. Nothing is
        read back from the device; the host waits only for the previous micro-batch's copy to land (to hand its
        pinned buffer back to the reader), and, once, for the compiled-step check. Returns the seconds spent
        waiting for the reader."""
        cfg, dev = self.cfg, self.dev
        T = self.cache.seq_len
        waited = 0.0
        self.lr_t.fill_(lr)
        for a in range(cfg.grad_accum):
            t0 = time.perf_counter()
            micro, batch = next(data)
            waited += time.perf_counter() - t0
            x = {k: batch[k].to(dev, non_blocking=True)
                 for k in ("hidden", "hidden_scales", "input_ids", "loss_mask", "doc_ids") if k in batch}
            if self.cuda:
                ev = torch.cuda.current_stream(dev).record_event()
                if self.pinned is not None:
                    self.pinned[0].synchronize()
                    self.pinned[1].release()
                self.pinned = (ev, batch)
            scores = self.anchor_scores(micro, x["input_ids"].shape[0], T)
            if self.compiled and cfg.compile_check and self.check is None:
                self.verify_compiled(x, scores)
            timed = self.compiled and self.first_call is None  # unchecked: time the first compiled call here
            if timed:
                t0, before = self.synced_time(), cache_counters()
            if self.compiled and self.cuda:
                torch.compiler.cudagraph_mark_step_begin()
            loss, met = self.fwd(x["hidden"], x["input_ids"], x["loss_mask"], x["doc_ids"], scores,
                                 cfg.num_anchors, cfg.gamma, x.get("hidden_scales"))
            loss.backward()
            if timed:
                self.note_first_call(self.synced_time() - t0, {}, before)
            grads = [p.grad for p in self.params]
            if a == 0:
                torch._foreach_copy_(self.grad_views, grads)
            else:
                torch._foreach_add_(self.grad_views, grads)
            for p in self.params:
                p.grad = None
            self.metrics.add(met)
        if cfg.grad_accum > 1:
            self.grad_buf.mul_(1.0 / cfg.grad_accum)
        if self.dist.distributed:
            torch.distributed.all_reduce(self.grad_buf, op=torch.distributed.ReduceOp.AVG)
        for p, g in zip(self.params, self.grad_views):
            p.grad = g
        self.metrics.add_grad_norm(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip, foreach=True))
        self.opt.step()
        for p in self.params:
            p.grad = None
        return waited

    def trained_s(self) -> float:
        """This process's training time so far (device-synced): its loop's wall time less the first compiled call,
        the validations and the --follow waits (what dflash/recipes/compare.py's train_time counts at the end)."""
        return (self.synced_time() - self.t_loop - float((self.first_call or {}).get("seconds") or 0.0)
                - self.untrained_s())

    def untrained_s(self) -> float:
        """Seconds of this process so far that are not training time: validations and --follow waits for shards."""
        return self.val_total + (self.follower.waited_s if self.follower is not None else 0.0)

    def slowest(self, x: float) -> float:
        """The max of x over the ranks (x itself in one process)."""
        if not self.dist.distributed:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.dev)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t)

    def synced_time(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.dev)
        return time.perf_counter()

    def validate(self) -> dict | None:
        """The held-out metrics of --val-cache (train/fit/validate.py), on rank 0; every rank waits. Its time is not
        counted in the window's step time."""
        if self.validator is None:
            return None
        t = time.perf_counter()
        val = self.validator(self.model) if self.dist.is_main else None
        barrier()
        took = time.perf_counter() - t
        self.val_time += took
        self.val_total += took
        return val

    def log_window(self, window: Window, lr: float, logger, bar, val: dict | None = None) -> None:
        """The end of a logging window: the metrics over all ranks, read once (the host sync), checked finite
        (else NonFiniteLoss naming the first bad step and the last good checkpoint), one record appended to
        self.history, RUN/metrics.jsonl and wandb (rank 0), with the held-out metrics when given; then the window
        starts over."""
        cfg, dist = self.cfg, self.dist
        T = self.cache.seq_len
        if dist.distributed:  # the logged metrics are over all ranks' data, not rank 0's
            self.metrics.all_reduce()
        vals, h = self.metrics.read()  # the one host sync
        if not torch.isfinite(h).all() or not math.isfinite(float(vals["grad_norm"])):
            bad = int(torch.nonzero(~torch.isfinite(h))[0]) if not torch.isfinite(h).all() else 0
            first = self.step - window.steps + bad // cfg.grad_accum + 1
            raise NonFiniteLoss(
                f"non-finite loss or gradient at step {first} (of {self.total_steps}); "
                f"the last good checkpoint is {self.last_good or 'none (no checkpoint yet)'}")
        dt = time.perf_counter() - window.start - self.val_time
        self.val_time = 0.0
        nmicro = window.steps * cfg.grad_accum
        rows = nmicro * cfg.batch_rows * dist.world
        rec = {
            "step": self.step, "lr": lr,
            "loss": float(vals["loss"]) / nmicro,
            "tau_expected": float(vals["tau"]) / nmicro,
            "grad_norm": float(vals["grad_norm"]) / window.steps,
            "slot_acc": (vals["slot_hits"] / vals["slot_count"].clamp(min=1)).tolist(),
            "ctx_tokens_per_s": rows * T / dt,
            "block_tokens_per_s": rows * cfg.num_anchors * self.dcfg.block_size / dt,
            "step_ms": 1000 * dt / window.steps,
            "data_wait_frac": window.wait / dt,
            # per GPU: this rank's FLOPs over one chip's peak (every rank does the same work)
            "mfu": (self.flops * window.steps / dt / self.peak) if self.peak else None,
            "epoch": self.step * cfg.grad_accum / self.spe,
        } | (val or {})
        self.history.append(rec)
        if dist.is_main:
            bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau_expected']:.2f}",
                            tok_s=f"{rec['ctx_tokens_per_s']:,.0f}", refresh=False)
            if val:
                print0(f"train: step {self.step}: held-out loss {val['val_loss']:.4f}, decoding tau "
                       f"{val['val_tau_decode']:.2f}, expected tau {val['val_tau_expected']:.2f} ({val['val_rows']} "
                       f"rows of --val-cache; training rows: expected tau {rec['tau_expected']:.2f})")
            logger.log({k: v for k, v in rec.items() if k not in ("slot_acc", "val_slot_acc")} |
                       {f"slot_acc/{i + 1}": a for i, a in enumerate(rec["slot_acc"])}, step=self.step)
            path = os.path.join(cfg.out, "metrics.jsonl")
            with writing(path, latest_checkpoint(cfg.out)), open(path, "a") as f:  # disk full: one error line
                f.write(json.dumps(rec) + "\n")
        self.metrics.reset()
        window.restart()

    def checkpoint(self) -> None:
        """RUN/checkpoints/step_N (rank 0; only ever after a log window's finiteness check), then every rank waits."""
        if self.dist.is_main:
            self.last_good = save_checkpoint(self.cfg.out, self.step, self.model, self.opt,
                                             {"step": self.step, "total_steps": self.total_steps,
                                              "micro_step": self.step * self.cfg.grad_accum}, self.cfg.keep_checkpoints)
        if self.follower is not None:
            self.follower.checkpoint_step = self.step
        barrier()

    def save_final(self) -> str:
        return save_final(self.cfg.out, self.model, basis=self.cache.basis())  # composed on a cache's basis


def started_before_windows(cfg: TrainConfig) -> bool:
    """Whether --out holds a run begun before epoch 0 was read in windows (its run.json has no shuffle_window): it
    resumes with one permutation per epoch, the order it began with (unless --overwrite starts it over)."""
    try:
        with open(os.path.join(cfg.out, "run.json")) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return False
    conf = doc.get("config") if isinstance(doc, dict) and doc.get("dflash") == "train" else None
    return isinstance(conf, dict) and "shuffle_window" not in conf and not cfg.overwrite


def run_train(cfg: TrainConfig) -> dict[str, Any]:
    """The command; rank 0 of the job holds the lock of --out throughout (one writer per run directory)."""
    with output_lock(cfg.out, "train", int(os.environ.get("RANK", 0)) == 0, precheck=lambda _: check_out_path(cfg)):
        return _run_train(cfg)


def _run_train(cfg: TrainConfig) -> dict[str, Any]:
    tr = Trainer(cfg)
    print0(f"train: drafter {tr.dcfg.num_layers} layers x {tr.dcfg.hidden_size} ({tr.nparams / 1e6:.1f}M trainable), "
           f"block {tr.dcfg.block_size}, {cfg.num_anchors} anchors/row, mask token {tr.dcfg.mask_token_id}; "
           f"{len(tr.cache)} rows of {tr.cache.seq_len} -> {tr.total_steps} steps"
           f"{' (provisional: --time-budget decides)' if tr.budget is not None and tr.budget.pending else ''} of "
           f"{cfg.batch_rows} rows x "
           f"{cfg.grad_accum} accum x {tr.dist.world} ranks; {'compiled' if tr.compiled else 'eager'} on {tr.dev}, "
           f"{tr.param_dtype}, attention {tr.attn}")
    out = tr.train()
    if out["history"]:
        last = out["history"][-1]
        # the rate of the last logged window (a run mean over the windows after the first is what `dflash demo`
        # reports); the drafter's path as this command names it (a finished run's summary holds its first run's)
        since = out["history"][-2]["step"] if len(out["history"]) > 1 else (
            out["steps"] - out["steps_this_run"] if out["steps_this_run"] else None)  # None: a replayed single window
        window = f"last window, steps {since + 1}-{last['step']}" if since is not None else "last window"
        print0(f"train: step {out['steps']}: loss {last['loss']:.4f}, expected tau {last['tau_expected']:.2f}, "
               f"{last['ctx_tokens_per_s']:,.0f} ctx tok/s ({window}), data wait "
               f"{100 * out['data_wait_frac']:.1f}%, recompiles after warm-up {out['recompiles_after_warmup']}; "
               f"drafter -> {os.path.join(cfg.out, 'final')}")
        if out.get("follow"):
            from dflash.train.fit.follow import closing_line

            print0(closing_line(out["follow"], out["elapsed_s"]))
        if out["val"]:
            v = out["val"]
            print0(f"train: held-out (--val-cache, {v['val_rows']} rows, step {v['step']}): loss {v['val_loss']:.4f}, "
                   f"decoding tau {v['val_tau_decode']:.2f}, expected tau {v['val_tau_expected']:.2f}")
    if tr.dist.is_main and os.path.isdir(os.path.join(cfg.out, "final")):
        from dflash.train.serve.contract import verdict_line  # how SGLang, vLLM, TensorRT-LLM and speculators read final/

        print0(f"train: {verdict_line(os.path.join(cfg.out, 'final'))}")
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `dflash train`")
