"""The serving contract check: does each engine read a drafter with the semantics dflash trained it with?

`check_drafter(path)` reads a drafter directory (RUN/final, or an `dflash export` of it), takes what dflash trained
(the `dflash_trained` record an export writes; for a RUN/final, the drafter RUN/run.json records the run trained;
else the checkpoint's own config), replays each engine's reading (train/serve/engines.py) and compares field by field:

    target layers   the layers the engine would hook, in dflash's ids (output of layer i)
    block size      the block it drafts (an engine that takes it from a serving flag is a note, not a misread)
    mask token      the id in the block's slots 1..B-1
    layer i         causal or bidirectional within the block, and the context window (and where it is measured)
    architecture    DFlash or DFlash2 (an engine that serves DFlash only reads a DFlash2 drafter as DFlash, its
                    convolutions and selector unused); for DFlash2, the convolution and selector sizes
    weights         the tensors the engine loads by name (layers.N.*, fc, hidden_norm, norm, and DFlash2's
                    attention_conv, mlp_conv, candidate_selector): matched, missing, unexpected; and each tensor's
                    shape against the one config.json builds

A difference is a misread: the engine would serve another model than the one measured, silently. A z-lab layout
directory is read by SGLang, vLLM, TensorRT-LLM and speculators (through its DFlashConverter); a speculators-format
directory by speculators (DFlashDraftModel, or DFlash2DraftModel for speculators_model_type "dflash2"). A field of
the wrong kind (train/drafter/drafter_fields.py) is a DrafterError naming it, never read as another value. The CLI (`dflash
check`, `dflash export --check`) prints the table and exits 2 with one `error:` line naming each engine and field
that would misread (`dflash export` alone: one `warning:` line); `dflash train` prints `verdict_line` for final/.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from dflash.train.drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME, config_from_servable, not_a_checkpoint
from dflash.train.drafter.drafter_fields import field_problem
from dflash.train.serve.engines import DFLASH2_SIZES, ENGINES, SLIDING, Reading, read
from dflash.train.drafter.model import DrafterConfig, DrafterError
from dflash.train.serve.target_record import recorded_kinds, serving_note


class ContractError(DrafterError):
    """An engine would read the drafter with other semantics than trained (one `error:` line in the CLI)."""


@dataclass
class Trained:
    """What dflash trained: the semantics every engine must read back."""
    target_layer_ids: list[int]
    num_target_layers: int
    block_size: int
    mask_token_id: int
    layers: list[tuple[bool, int | None]]  # (causal within the block, context window): dflash's blocks are bidirectional
    num_layers: int
    chat_template_kwargs: dict | None = None
    arch: str = "dflash"
    dflash2: dict[str, int] | None = None  # DFlash2's convolution and selector sizes (arch "dflash2")
    source: str = "config.json"  # where it was read: the export's record, the run's run.json, or the config

    @classmethod
    def of(cls, cfg: DrafterConfig, chat_template_kwargs: dict | None = None, source: str = "config.json") -> "Trained":
        layers = [(False, cfg.sliding_window if t == SLIDING else None) for t in cfg.layer_types]
        sizes = {k: getattr(cfg, k) for k in DFLASH2_SIZES} if cfg.arch == "dflash2" else None
        return cls(list(cfg.target_layer_ids), cfg.num_target_layers, cfg.block_size, cfg.mask_token_id, layers,
                   cfg.num_layers, chat_template_kwargs, cfg.arch, sizes, source)

    def record(self, layer_types: list[str]) -> dict[str, Any]:
        """The `dflash_trained` block an export writes into its config.json."""
        return {"target_layer_ids": self.target_layer_ids, "layer_id_meaning": "output of target layer i "
                "(HF hidden_states[i + 1])", "num_target_layers": self.num_target_layers,
                "block_size": self.block_size, "mask_token_id": self.mask_token_id, "layer_types": layer_types,
                "sliding_window": next((w for _, w in self.layers if w), None), "block_attention": "bidirectional",
                "arch": self.arch, **(self.dflash2 or {}), "chat_template_kwargs": self.chat_template_kwargs}


@dataclass
class Verdict:
    path: str
    layout: str  # "zlab" | "speculators"
    trained: Trained
    readings: list[Reading]
    weights: dict[str, dict[str, list[str]]]  # engine -> matched / missing / unexpected tensor names
    misreads: list[str] = field(default_factory=list)  # "<engine>: <field>: <what>"

    @property
    def ok(self) -> bool:
        return not self.misreads


def _read_json(path: str, name: str) -> dict:
    try:
        with open(os.path.join(path, name), "rb") as f:
            d = json.loads(f.read())
    except FileNotFoundError:
        raise not_a_checkpoint(path, f"{name} is missing") from None
    except (OSError, ValueError) as e:
        raise DrafterError(f"{path}: {name} cannot be read as JSON ({e})") from None
    if not isinstance(d, dict):
        raise DrafterError(f"{path}: {name} holds a {type(d).__name__}, not a drafter config")
    return d


def run_drafter(path: str) -> DrafterConfig | None:
    """The drafter RUN/run.json records its run trained, when `path` is that run's final/ (else None): what
    final/config.json must say, whatever was edited there since."""
    run = os.path.dirname(os.path.abspath(path))
    if os.path.basename(os.path.abspath(path)) != "final":
        return None
    try:
        with open(os.path.join(run, "run.json")) as f:
            doc = json.load(f)
        drafter = doc["config"]["drafter"] if doc.get("dflash") == "train" else None
        return DrafterConfig.from_dict(drafter) if isinstance(drafter, dict) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def trained_of(path: str, config: dict) -> Trained:
    """What the drafter at `path` was trained with: the export's `dflash_trained` record, else the run's record
    (RUN/run.json beside a RUN/final), else its own config."""
    rec = config.get("dflash_trained")
    if isinstance(rec, dict):
        try:
            lt = list(rec["layer_types"])
            layers = [(False, rec.get("sliding_window") if t == SLIDING else None) for t in lt]
            arch = rec.get("arch", "dflash")
            sizes = {k: int(rec[k]) for k in DFLASH2_SIZES} if arch == "dflash2" else None
            return Trained([int(i) for i in rec["target_layer_ids"]], int(rec["num_target_layers"]),
                           int(rec["block_size"]), int(rec["mask_token_id"]), layers, len(lt),
                           rec.get("chat_template_kwargs"), arch, sizes, "the export's dflash_trained record")
        except (KeyError, TypeError, ValueError) as e:
            raise DrafterError(f"{path}: {CONFIG_NAME}'s dflash_trained record is damaged ({e})") from None
    recorded = run_drafter(path)
    if recorded is not None:
        return Trained.of(recorded, source="the run's run.json")
    if "num_target_layers" not in config:
        raise DrafterError(f"{path} is not a DFlash drafter: its {CONFIG_NAME} has neither num_target_layers nor a "
                           "dflash_trained record")
    try:
        return Trained.of(config_from_servable(config))
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterError(f"{path}: {CONFIG_NAME} cannot be read as a drafter config ({e})") from None


def expected_weights(num_layers: int, attention_bias: bool = False, arch: str = "dflash") -> list[str]:
    """The tensor names an engine loads for a drafter of `num_layers` layers (no embedding, no LM head); DFlash2
    adds each layer's convolutions and the candidate selector."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    if arch == "dflash2":
        names += [f"candidate_selector.{n}" for n in ("predecessor_codebook", "successor_codebook",
                                                      "hidden_projection.weight")]
        names += [f"layers.{i}.{c}.{n}" for i in range(num_layers) for c in ("attention_conv", "mlp_conv")
                  for n in ("base_kernel", "kernel_projection.weight")]
    for i in range(num_layers):
        p = f"layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"self_attn.{x}_proj.{w}" for x in "qkvo" for w in (("weight", "bias") if attention_bias
                                                                             else ("weight",))]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return sorted(names)


def weight_shapes(path: str) -> dict[str, list[int]]:
    """name -> shape of every tensor in the drafter's weights file (its header only)."""
    from safetensors import SafetensorError, safe_open

    f = os.path.join(path, WEIGHTS_NAME)
    if not os.path.exists(f):
        raise DrafterError(f"{path} is not a complete drafter checkpoint: {WEIGHTS_NAME} is missing")
    try:
        with safe_open(f, "pt") as st:
            return {k: list(st.get_slice(k).get_shape()) for k in sorted(st.keys())}
    except (SafetensorError, OSError) as e:
        raise DrafterError(f"{path}: {WEIGHTS_NAME} cannot be read ({e}): cut short or damaged") from None


def weight_names(path: str) -> list[str]:
    return sorted(weight_shapes(path))


def built_shapes(cfg: DrafterConfig) -> dict[str, list[int]]:
    """name -> shape of each tensor the drafter of `cfg` holds (built on the meta device: no memory, no time)."""
    import torch

    from dflash.train.drafter.dflash2 import make_drafter

    with torch.device("meta"):
        model = make_drafter(cfg)
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def shape_misreads(path: str, config: dict, layout: str, shapes: dict[str, list[int]]) -> list[str]:
    """'weights: NAME is [..] in the file, [..] by config.json' for each tensor whose shape is not the one the config
    builds (an engine refuses the file or, worse, reads it otherwise); [] when the config cannot be built."""
    if layout == "speculators":
        return []  # its sizes are read in transformer_layer_config: speculators' loader checks them itself
    try:
        want = built_shapes(config_from_servable(config))
    except (KeyError, TypeError, ValueError, DrafterError):
        return []
    return [f"weights: {n} is {s} in {WEIGHTS_NAME}, {want[n]} by {CONFIG_NAME}" for n, s in shapes.items()
            if n in want and want[n] != s]


def _fmt_layers(layers: list[tuple[bool, int | None]]) -> str:
    kinds = [("causal" if c else "bidir") + (f"/w{w}" if w else "") for c, w in layers]
    return ", ".join(kinds) if len(set(kinds)) > 1 else f"{len(kinds)}x {kinds[0]}" if kinds else "-"


def compare(trained: Trained, r: Reading) -> list[str]:
    """The fields on which the engine's reading differs from what was trained: '<engine>: <field>: <what>'."""
    out = []
    if r.arch != trained.arch:
        why = ""
        if trained.arch == "dflash2":
            why = ("; it serves DFlash only" if r.engine != "speculators" else
                   "; its DFlashConverter writes DFlash only (`dflash export --format speculators` writes DFlash2)")
        out.append(f"{r.engine}: architecture: would build {_arch_name(r.arch)} (trained {_arch_name(trained.arch)})"
                   + why)
    elif r.arch == "dflash2" and r.dflash2 != trained.dflash2:
        diff = [f"{k} {r.dflash2.get(k)} (trained {trained.dflash2.get(k)})" for k in DFLASH2_SIZES
                if (r.dflash2 or {}).get(k) != (trained.dflash2 or {}).get(k)]
        out.append(f"{r.engine}: DFlash2 sizes: would build {', '.join(diff)}")
    if r.target_layers != trained.target_layer_ids:
        out.append(f"{r.engine}: target layers: would hook {r.target_layers} (trained {trained.target_layer_ids})")
    if r.block_size is not None and int(r.block_size) != trained.block_size:
        out.append(f"{r.engine}: block size: would draft blocks of {r.block_size} (trained {trained.block_size})")
    if r.mask_token_id is None or int(r.mask_token_id) != trained.mask_token_id:
        got = r.mask_token_id if r.mask_token_id is not None else "a token looked up by name"
        out.append(f"{r.engine}: mask token: would use {got} (trained {trained.mask_token_id})")
    if len(r.layers) != len(trained.layers):
        out.append(f"{r.engine}: layers: would build {len(r.layers)} (trained {len(trained.layers)})")
    for i, ((c, w), (tc, tw)) in enumerate(zip(r.layers, trained.layers)):
        if c != tc:
            out.append(f"{r.engine}: layer {i} causality: would be {'causal' if c else 'bidirectional'} within the "
                       f"block (trained {'causal' if tc else 'bidirectional'})")
        if (w or None) != (tw or None):
            out.append(f"{r.engine}: layer {i} window: would see {f'{w} context positions' if w else 'all context'} "
                       f"(trained {f'{tw}' if tw else 'all context'})")
        elif w and r.window_from != "query":
            out.append(f"{r.engine}: layer {i} window: measured from the block's anchor (trained: from each query)")
    return out


def _arch_name(arch: str) -> str:
    return {"dflash": "DFlash", "dflash2": "DFlash2"}.get(arch, repr(arch))


def check_drafter(path: str) -> Verdict:
    config = _read_json(path, CONFIG_NAME)
    problem = field_problem(config)
    if problem:
        raise DrafterError(f"{path}: {CONFIG_NAME}: {problem}")
    dc = config.get("dflash_config")
    rank = dc.get("basis_rank") if isinstance(dc, dict) else 0
    if rank:  # a training checkpoint on a cache's basis: no engine gives its fc the features it reads
        raise DrafterError(f"{path}: its fc reads features on a cache's basis (dflash_config.basis_rank {rank} in its "
                           f"{CONFIG_NAME}), which no engine gives it: check the run's final/ (the composed fc)")
    trained = trained_of(path, config)
    layout = "speculators" if config.get("speculators_model_type") else "zlab"
    engines = ("speculators",) if layout == "speculators" else ENGINES
    readings = [read(e, config, trained.num_target_layers) for e in engines]
    tl = config.get("transformer_layer_config") if layout == "speculators" else config
    bias = bool((tl or {}).get("attention_bias", False))
    shapes = weight_shapes(path)
    names = sorted(shapes)
    weights = {}
    for r in readings:  # each engine loads the tensors of the drafter it builds (DFlash or DFlash2)
        expected = expected_weights(trained.num_layers, bias, r.arch)
        weights[r.engine] = {"matched": [n for n in names if n in expected],
                             "missing": [n for n in expected if n not in names],
                             "unexpected": [n for n in names if n not in expected]}
    v = Verdict(path, layout, trained, readings, weights)
    v.misreads += shape_misreads(path, config, layout, shapes)
    for r in readings:
        v.misreads += compare(trained, r)
        w = weights[r.engine]
        if w["missing"]:
            v.misreads.append(f"{r.engine}: weights: missing {w['missing'][:3]}")
        if w["unexpected"]:
            v.misreads.append(f"{r.engine}: weights: unexpected {w['unexpected'][:3]}"
                              + (" (unused)" if r.arch != trained.arch else ""))
    return v


def format_table(v: Verdict) -> str:
    t = v.trained
    bias = any(n.endswith("_proj.bias") for w in v.weights.values() for n in w["matched"] + w["unexpected"])
    rows = [("trained (dflash)", _arch_name(t.arch), str(t.target_layer_ids), str(t.block_size), str(t.mask_token_id),
             _fmt_layers(t.layers), f"{len(expected_weights(t.num_layers, bias, t.arch))} expected")]
    for r in v.readings:
        w = v.weights[r.engine]
        rows.append((r.engine, _arch_name(r.arch), str(r.target_layers), str(r.block_size or "flag"),
                     str(r.mask_token_id), _fmt_layers(r.layers), f"{len(w['matched'])} matched, "
                     f"{len(w['missing'])} missing, {len(w['unexpected'])} unexpected"))
    head = ("reader", "builds", "target layers (output of layer i)", "block", "mask", "layers in the block", "weights")
    widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    lines = [f"check: {v.path} ({v.layout} layout; target of {t.num_target_layers} layers"
             + (f"; chat template kwargs {json.dumps(t.chat_template_kwargs)}" if t.chat_template_kwargs else "")
             + f"; trained: {t.source})"]
    lines += ["  " + "  ".join(x.ljust(widths[i]) for i, x in enumerate(row)).rstrip() for row in [head] + rows]
    notes = [f"{r.engine}: {n}" for r in v.readings for n in r.notes]
    if t.arch == "dflash2":
        dflash_only = [r.engine for r in v.readings if r.engine != "speculators"]
        if dflash_only:
            notes.append(f"{', '.join(dflash_only)} serve DFlash only (a DFlash2 drafter is read as DFlash, its "
                         "convolutions and selector unused); speculators' DFlash2DraftModel serves it from "
                         "`dflash export --format speculators`")
    target_note = serving_note(recorded_kinds(v.path))
    if target_note:
        notes.append(target_note)
    lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)


def summary(v: Verdict) -> str:
    """One line: every engine reads it as trained, or which engine misreads which field."""
    names = ", ".join(r.engine for r in v.readings)
    if v.ok:
        return f"{names} read {v.path} as trained (target layers, block, mask token, attention, weights)"
    return f"{v.path}: " + "; ".join(v.misreads)


def verdict_line(path: str) -> str:
    """`dflash train`'s closing line on final/: never raises (a check that cannot run says why)."""
    try:
        v = check_drafter(path)
    except DrafterError as e:
        return f"serving check: could not run ({e})"
    if v.ok:
        return f"serving check: {', '.join(r.engine for r in v.readings)} read final/ as trained"
    return (f"serving check: {len(v.misreads)} misread(s), first: {v.misreads[0]} (`dflash check {path}`; "
            "`dflash export` writes a checkpoint each engine reads as trained)")
