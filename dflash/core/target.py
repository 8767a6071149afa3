"""The frozen target, as both stages load it: Hugging Face directory or GGUF file, config, tokenizer, layers.

check_target looks at a target before anything loads (config.json a model config, weight files present and
whole, tokenizer files present); resolve_target/load_config/load_tokenizer/load_causal_lm load a target
(optionally cut after its first `num_layers` decoder layers, without the LM head); each failure is a
TargetError naming --target, the path and the file; decoder_layers finds a model's decoder stack and
LayerCapture hooks K of its layers so they write straight into one preallocated [..., K*H] buffer.
Layer id i is the output of decoder layer i, i.e. HF's `hidden_states[i + 1]` (for the model's very last
layer HF applies the final norm, and so do we). target_info and the fingerprints identify a target in a
cache's metadata; convert_gguf dequantises a GGUF model once into a save_pretrained folder whose config.json
reads the same under transformers 4.x and 5.x (portable_rope: rope_theta at the top level as well as under
rope_parameters; 4.x reads only the former and would take its default 10,000 for a 5.x-written config).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from dflash.core.errors import DflashError
from dflash.core.io import short_hash

log = logging.getLogger(__name__)


class TargetError(DflashError):
    """A target model that cannot be used, with the reason and the path."""


def resolve_target(path: str) -> tuple[str, str | None]:
    """(directory, gguf file name or None) for a model directory, a .gguf file or a dir holding one."""
    if not os.path.exists(path):
        raise TargetError(f"--target {path}: model not found, the path does not exist (a local HF model directory or a "
                          ".gguf file)")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise TargetError(f"--target {path} is a file but not a .gguf file")
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path, None
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return path, os.path.basename(ggufs[0])
    raise TargetError(f"--target {path} is not a model directory: no config.json"
                      + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else ""))


# Files one of which a Hugging Face tokenizer is loaded from (without any, transformers 5 builds an empty tokenizer
# of the model's class instead of failing: ids and chat template then come from nowhere).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def check_target(path: str) -> None:
    """What can be told of a target without loading it, so that a damaged one fails in the first second naming the
    file: a model directory's config.json is a JSON model config (it has a model_type), its weight files are there
    (every file of a sharded index) and whole (a safetensors file as long as its header says), and it has tokenizer
    files. A .gguf file holds all of these (its reader checks them as it loads)."""
    from dflash.core.weights import WeightsError, safetensors_extents, weight_files

    d, gguf = resolve_target(path)
    if gguf:
        return
    config = os.path.join(d, "config.json")
    try:
        with open(config, "rb") as f:
            doc = json.loads(f.read())
    except OSError as e:
        raise TargetError(f"--target {path}: cannot read {config}: {e.strerror or e}") from None
    except ValueError as e:
        raise TargetError(f"--target {path}: {config} is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise TargetError(f"--target {path}: {config} is not a model config (no model_type in it)")
    try:
        kind, files = weight_files(d)
        for file in files:
            if not os.path.isfile(file):
                raise TargetError(f"--target {path}: weight file {os.path.basename(file)} is missing (its index "
                                  "names it)")
            if kind == "safetensors":
                size = os.path.getsize(file)
                ends = [e.offset + e.size for e in safetensors_extents(file)]
                if max(ends, default=0) > size:
                    raise TargetError(f"--target {path}: {os.path.basename(file)} is cut short ({size:,} bytes, its "
                                      f"header describes {max(ends):,}): copy or download it again")
    except WeightsError as e:
        said = str(e).removeprefix(f"target {d} ")  # weight_files names the target itself
        raise TargetError(f"--target {path} {said}" if said != str(e) else f"--target {path}: {said}") from None
    check_tokenizer_files(path, d)


def check_tokenizer_files(path: str, directory: str) -> None:
    """A TargetError naming --target when a model directory has none of TOKENIZER_FILES."""
    if not any(os.path.exists(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        raise TargetError(f"--target {path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): copy them "
                          "from where the model came from")


_gguf_memo_active = False  # inside gguf_read_once(): an inner use shares the outer memo


@contextlib.contextmanager
def gguf_read_once():
    """Within: one gguf.GGUFReader per file and one gguf tensor-name map per (architecture, layers).

    transformers parses a GGUF file anew for the config, for the weights and for the tokenizer, and each parse
    reads every metadata field, the whole vocabulary and its merges included (~9 s for SmolLM2-135M on 2 cores);
    it also builds gguf's tensor-name map once per submodule of the model (~400 times, ~13 s). Both are pure
    functions of their arguments and only read afterwards, so they are memoised here for the duration (re-entrant:
    an inner use shares the outer memo). transformers imports both from `gguf` inside its functions, which is
    where they are swapped; a version that imports them elsewhere simply loads at the old speed."""
    global _gguf_memo_active
    try:
        import gguf
    except ImportError:
        yield
        return
    if _gguf_memo_active:
        yield
        return
    readers: dict = {}
    maps: dict = {}
    reader_cls, name_map_fn = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map_fn(arch, n_blocks)
        return maps[arch, n_blocks]

    _gguf_memo_active = True
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map_fn
        _gguf_memo_active = False


def load_config(path: str):
    from transformers import AutoConfig

    d, gguf = resolve_target(path)
    try:
        if gguf:
            with gguf_read_once():
                return AutoConfig.from_pretrained(d, gguf_file=gguf)
        return AutoConfig.from_pretrained(d)
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"--target {path}: cannot read its model config: {e}") from e


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    d, gguf = resolve_target(path)
    if not gguf:
        check_tokenizer_files(path, d)
    try:
        if gguf:
            with gguf_read_once():
                return AutoTokenizer.from_pretrained(d, gguf_file=gguf)
        return AutoTokenizer.from_pretrained(d)
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"--target {path}: cannot load its tokenizer: {e}") from e


def text_config(cfg):
    return getattr(cfg, "text_config", None) or cfg


def config_fingerprint(cfg) -> str:
    d = text_config(cfg).to_dict()
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation_autoset",
              "attn_implementation", "_attn_implementation"):
        d.pop(k, None)
    return short_hash(json.dumps(d, sort_keys=True, default=str))


def weights_fingerprint(path: str) -> str:
    """Cheap identity of the weight files: names and sizes. Not proof of the same weights (a fine-tune has the same
    names and sizes): the content fingerprint is dflash.core.weights, recorded in a cache as info.weights."""
    d, gguf = resolve_target(path)
    files = [gguf] if gguf else sorted(f for f in os.listdir(d) if f.endswith((".safetensors", ".bin", ".pt")))
    return short_hash(json.dumps([(f, os.path.getsize(os.path.join(d, f))) for f in files]))


def _truncated_config(cfg, num_layers: int):
    cfg = type(cfg).from_dict(cfg.to_dict())
    c = text_config(cfg)
    c.num_hidden_layers = num_layers
    if getattr(c, "layer_types", None):
        c.layer_types = list(c.layer_types)[:num_layers]
    return cfg


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_gguf_state(gguf_path: str, model) -> dict[str, torch.Tensor]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)
    return {k: torch.as_tensor(v) for k, v in out["tensors"].items()}


def load_causal_lm(path: str, *, device="cpu", dtype=torch.float32, attn_impl: str = "sdpa",
                   num_layers: int | None = None, with_head: bool = True):
    """An HF model from a directory or GGUF file, optionally cut after `num_layers` decoder layers.

    with_head=False returns the base model (no LM head). GGUF weights are dequantized in memory
    (slow for big models: convert once with `convert_gguf`).
    """
    _quiet_transformers()
    d, gguf = resolve_target(path)
    with gguf_read_once() if gguf else contextlib.nullcontext():  # one parse of a GGUF file for config and weights
        return _load_causal_lm(path, d, gguf, device, dtype, attn_impl, num_layers, with_head)


def causal_lm_class(cfg):
    """The causal-LM class transformers builds for `cfg`. For a multimodal checkpoint whose language model is the
    target (Qwen3.5/3.6's ForConditionalGeneration, config with a text_config) that is the text model's own
    ForCausalLM, which reads the language model's weights of such a checkpoint and leaves the vision tower on disk."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(cfg)]
    except (KeyError, AttributeError):
        return None


def attention_implementation(cfg, wanted: str) -> str:
    """`wanted` ("sdpa", "flex_attention") where the model's transformers class supports it; else SDPA (Qwen3.5's
    hybrid has no flex attention), else "eager" (gpt-oss refuses SDPA: its attention sinks). Eager takes the same
    masks as additive floats (dflash.core.hybrid.attention_masks)."""
    cls = causal_lm_class(cfg)
    if cls is None:
        return wanted
    if wanted == "flex_attention" and getattr(cls, "_supports_flex_attn", True) is False:
        wanted = "sdpa"
    if wanted == "sdpa" and getattr(cls, "_supports_sdpa", True) is False:
        return "eager"
    return wanted


def is_multimodal(cfg) -> bool:
    """A wrapper config (a vision tower beside the language model) rather than a text model's own."""
    return getattr(cfg, "text_config", None) is not None and getattr(cfg, "vision_config", None) is not None


def _load_causal_lm(path, d, gguf, device, dtype, attn_impl, num_layers, with_head):
    from transformers import AutoModel, AutoModelForCausalLM

    cfg = load_config(path)
    if num_layers is not None:
        cfg = _truncated_config(cfg, num_layers)
    attn_impl = attention_implementation(cfg, attn_impl)
    # a multimodal wrapper's language model is loaded through the causal LM (AutoModel would build the wrapper,
    # vision tower included): the head is dropped after loading
    cls = AutoModelForCausalLM if with_head or is_multimodal(cfg) else AutoModel
    try:
        if gguf is None:
            # use_kernels=False: transformers would otherwise fetch layers from its kernel hub at load time (a
            # network dependency and other numerics); the kernels of installed packages (flash-linear-attention)
            # are used either way
            model = cls.from_pretrained(d, config=cfg, dtype=dtype, attn_implementation=attn_impl, use_kernels=False)
            if not with_head and cls is AutoModelForCausalLM:
                model = model.model
        else:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn_impl)
            state = load_gguf_state(os.path.join(d, gguf), model)
            missing, _ = model.load_state_dict(state, strict=False)
            model.tie_weights()
            missing = [k for k in missing if not (k == "lm_head.weight" and text_config(cfg).tie_word_embeddings)]
            if missing:
                raise TargetError(f"--target {path}: GGUF {gguf} lacks weights {missing[:5]}")
            if not with_head:
                model = model.model
            model = model.to(dtype)
    except TargetError:
        raise
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"--target {path}: cannot load the model: {e}") from e
    return model.to(device).eval().requires_grad_(False)


def portable_rope(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict whose RoPE reads the same under transformers 4.x (top-level rope_theta and rope_scaling) and
    5.x (rope_parameters): the fields one layout lacks are filled from the other; nested text_config likewise."""
    out = dict(d)
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        out.setdefault("rope_theta", rope["rope_theta"])
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default" and not out.get("rope_scaling"):
            out["rope_scaling"] = scaling
    elif "rope_theta" in out and not isinstance(rope, dict):
        out["rope_parameters"] = {"rope_type": "default", **(out.get("rope_scaling") or {}),
                                  "rope_theta": out["rope_theta"]}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = portable_rope(out["text_config"])
    return out


def convert_gguf(gguf_path: str, out_dir: str, dtype=torch.bfloat16) -> str:
    """Dequantize a GGUF model once into a plain `save_pretrained` folder (later loads take ~1 s)."""
    if os.path.exists(os.path.join(out_dir, "config.json")) and os.path.exists(os.path.join(out_dir, "tokenizer_config.json")):
        return out_dir
    tmp = out_dir.rstrip("/") + ".partial"
    with gguf_read_once():  # the file is parsed once for config, weights and tokenizer
        model = load_causal_lm(gguf_path, dtype=dtype)
        tok = load_tokenizer(gguf_path)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "config.json")) as f:
        config = portable_rope(json.load(f))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if os.path.exists(out_dir):
        import shutil

        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def decoder_layers(model) -> torch.nn.ModuleList:
    base = getattr(model, "model", model)
    for attr in ("layers", "h", "decoder.layers", "language_model.layers"):
        obj = base
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise TargetError(f"cannot find the decoder layers of {type(model).__name__}")


def validate_layer_ids(layer_ids: list[int], num_layers: int, name: str = "target") -> list[int]:
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise TargetError("--layers: no layer ids given")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise TargetError(f"--layers: layer id {bad[0]} is out of range for {name} with {num_layers} layers (valid 0..{num_layers - 1})")
    if len(set(ids)) != len(ids):
        raise TargetError(f"--layers: duplicate layer ids in {ids}")
    return ids


def decode_sdpa():
    """A context in which SDPA uses every kernel but cuDNN's, for decoding (regenerate's engine, eval).

    cuDNN's attention builds an execution plan on the host for every new sequence length, and a decode step has
    a new key length every time: on the H200 a bf16 draft step took 42.9 ms with it against 2.2 ms in float32
    (which never uses it), 40.4 ms of that in two cuDNN attention calls (bench/spec_step.py --draft-only). The
    memory-efficient kernel takes boolean masks directly."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class LayerCapture:
    """Forward hooks that copy the K chosen layers' outputs into out[..., k*H:(k+1)*H]."""

    def __init__(self, model, layer_ids: list[int], final_norm_for: int | None = None):
        self.layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        self.out: torch.Tensor | None = None
        self.norm = getattr(getattr(model, "model", model), "norm", None) if final_norm_for is not None else None
        self.final_norm_for = final_norm_for
        self._handles: list = []
        self._register(outside_graph=False)

    def hooks_outside_graph(self, on: bool = True) -> None:
        """Re-registers the hooks behind `torch.compiler.disable` (on) or plain (off). On is for a model compiled
        with a graph break in every layer (extract/compiled.py's split attention): there each hook is a frame of
        its own to dynamo, specialised on its layer index k and its buffer's dtype, and the K hooks ran into
        dynamo's recompile limit (8) for that one code object; eager, a hook is one copy_ either way. Off keeps
        them inside a whole-model graph."""
        self.remove()
        self._register(outside_graph=on)

    def _register(self, outside_graph: bool) -> None:
        self._handles = []
        for k, i in enumerate(self.layer_ids):
            fn = self._hook(k, i)
            self._handles.append(self.layers[i].register_forward_hook(torch.compiler.disable(fn) if outside_graph
                                                                      else fn))

    def _hook(self, k: int, layer_id: int):
        def fn(module, args, output):
            if self.out is None:
                return
            h = output[0] if isinstance(output, (tuple, list)) else output
            if layer_id == self.final_norm_for and self.norm is not None:
                h = self.norm(h)
            H = h.shape[-1]
            self.out[..., k * H:(k + 1) * H].copy_(h.reshape(self.out.shape[:-1] + (H,)))
        return fn

    def remove(self):
        for h in self._handles:
            h.remove()


@dataclass
class TargetInfo:
    name_or_path: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    config_hash: str
    weights_hash: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def target_info(path: str, cfg=None) -> TargetInfo:
    cfg = cfg or load_config(path)
    c = text_config(cfg)
    return TargetInfo(os.path.abspath(path), c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size,
                      config_fingerprint(cfg), weights_fingerprint(path))
