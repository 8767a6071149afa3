"""dflash/core/decode_attention.py's Triton kernel (the static decoder's batched one-token steps reading each row's
own columns), run by Triton's interpreter on CPU tensors, against the decoder's plain attention, the spanned step
and single-sequence decoding through regenerate's slot engine.
Skipped where Triton is not installed (a CPU-only torch ships none); tests/test_gpu.py runs the compiled kernel
on a GPU (bf16 and fp16, which the interpreter does not model: bf16 it computes wrong)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (interpreter)")

# Run in a process of its own: TRITON_INTERPRET must be set before Triton is imported.
CHECKS = r"""
import random, torch
from dflash.core import decode_attention as da
from dflash.core.static_decode import _attend

torch.manual_seed(0)
# the kernel against the plain attention: one split or several (few rows), G of 3 and 7, head dims 16-128, float32
# and float16, rows of one column and of the whole span
for n, hk, G, D, C, span, dt in [(5, 2, 3, 16, 97, 96, torch.float32), (600, 1, 3, 32, 40, 40, torch.float32),
                                 (4, 3, 3, 64, 1100, 1024, torch.float32), (9, 2, 7, 128, 700, 640, torch.float32),
                                 (4, 3, 3, 64, 300, 300, torch.float16)]:
    q = torch.randn(n, hk, G, D, dtype=dt)
    k, v = torch.randn(n + 2, hk, C, D, dtype=dt), torch.randn(n + 2, hk, C, D, dtype=dt)
    used = torch.randint(1, span + 1, (n,))
    used[0], used[-1] = 1, span
    mask = (torch.arange(span)[None] < used[:, None])[:, None, None].expand(n, 1, G, span)
    want = _attend(q, k[:n, :, :span], v[:n, :, :span], mask, 0.3, 1).view(n, hk, G, D)
    got = da.attend(q, k, v, used.to(torch.int32), span, 0.3)
    tol = 1e-5 if dt == torch.float32 else 3e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    print("kernel", n, hk, G, D, "splits", da.splits_for(n * hk, span), flush=True)

# the decoder's steps through it: the spanned step's and the HF forward's logits and hidden states
from dflash.core import static_decode
from dflash.core.target import load_causal_lm
from tests.test_slot_engine import decodes_single_sequences, mixed_prompts
from tests.test_static_decode import varlen_steps_equal_the_spanned_ones
from tests.tiny import make_tiny_target
import tempfile
m = load_causal_lm(make_tiny_target(tempfile.mkdtemp() + "/t", arch="llama")).eval()
assert da.supported(m.config.hidden_size // m.config.num_attention_heads, 2) is None
varlen_steps_equal_the_spanned_ones(m, "triton")
print("decoder ok", flush=True)

# regenerate's engine with it: every row's text a single sequence's
static_decode.varlen_kernel = lambda *a: "triton"
eng = decodes_single_sequences(m, mixed_prompts(m, random.Random(4)))
assert eng.dec.varlen_kernel == "triton" and eng.varlen_steps > 0
print("engine ok", flush=True)
"""


def test_the_triton_decode_kernel_equals_the_plain_attention():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-c", CHECKS], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("kernel") for line in lines) == 5 and "decoder ok" in lines and "engine ok" in lines
    assert any(line.startswith("kernel") and not line.endswith("splits 1") for line in lines)  # splits were run
