"""Quantised hidden states: the formats, their exact formulas, and the (de)quantisers (torch: any device).

Two formats besides plain bf16 (format.py says how they are stored). Both keep a scale per group of
channels of one token; a group never spans two captured layers, so every group sees one layer's statistics.

float8_e4m3fn (`--hidden-dtype fp8`): one e4m3 byte per value (1 sign, 4 exponent bits, bias 7,
    3 mantissa bits, no infinities, 0x7f/0xff = NaN, largest finite 448), one float32 scale per token
    and captured layer (group = H channels):
        scale = amax(|x| over the group) / 448          (0 for an all-zero group: padding stays exact 0)
        byte  = e4m3(round-to-nearest-even(x / scale))  (x / scale lies in [-448, 448])
        value = e4m3_value(byte) * scale
    Error bound (3 mantissa bits: half a unit in the last place is 2^-4 of the leading power of two; below
    e4m3's smallest normal 2^-6 the spacing is the subnormal step 2^-9):
        |value - x| <= 2^-4 * |x| + 2^-10 * scale    (plus float32 rounding, ~1e-7 relative)
    A token with activations 100x the others (an attention sink) gets its own scale: it survives.

fp4_e2m1 (`--hidden-dtype fp4`, experimental): 4-bit e2m1 values (1 sign, 2 exponent bits, 1 mantissa
    bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte (element 2i in the low nibble, 2i+1 in the
    high nibble), one float16 scale per 32 channels (MX-like groups, but not MX's power-of-two e8m0 scale):
        scale = float16(amax / 6)     (round to nearest; 0 for an all-zero group; at most 65504)
        code  = e2m1(round-to-nearest-even(clamp(x / scale, -6, 6)))
        value = e2m1_value(code) * scale
    Error bound (grid spacing 0.5 below 2, 1 below 4, 2 up to 6, and a clip of at most 2^-11 of amax where
    float16 rounded the scale down):  |value - x| <= max(|x|, scale) / 4 + 2^-11 * |x|. Groups whose amax
    exceeds 6 * 65504 clip, and groups below float16's range (amax < ~4e-7) read as 0.
    Why float16 and not e8m0 (bench/quant_error.py, SmolLM2-135M's real states): a power-of-two scale rounds
    amax / 6 up by up to 2x, wasting up to half of e2m1's grid; median per-token error 17% with e8m0 against
    11.4% with float16, for 1/32 byte more per value (at K=5, H=4096: 11,520 instead of 10,880 raw B/token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

BF16 = "bfloat16"
FP8 = "float8_e4m3fn"
FP4 = "fp4_e2m1"
HIDDEN_DTYPES = (BF16, FP8, FP4)
# names on the command line (and in presets) -> the names stored in the cache metadata
CLI_NAMES = {"bf16": BF16, "fp8": FP8, "fp4": FP4}

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_GROUP = 32
FP16_MAX = 65504.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def resolve(name: str) -> str:
    """A CLI name (bf16/fp8/fp4) or a stored name -> the stored name; ValueError for anything else."""
    if name in CLI_NAMES:
        return CLI_NAMES[name]
    if name in HIDDEN_DTYPES:
        return name
    raise ValueError(f"unknown hidden dtype {name!r} (one of {', '.join(CLI_NAMES)})")


def is_quantized(hidden_dtype: str) -> bool:
    return hidden_dtype != BF16


def stored_width(hidden_dtype: str, width: int) -> int:
    """Bytes (fp8/fp4) or uint16 words (bf16) per token of `hidden` for a row width K*H."""
    return width // 2 if hidden_dtype == FP4 else width


def scale_width(hidden_dtype: str, num_layers: int, width: int) -> int:
    """Scales per token (0 for bf16)."""
    return {BF16: 0, FP8: num_layers, FP4: width // FP4_GROUP}[hidden_dtype]


def stored_dtypes(hidden_dtype: str) -> tuple[str, str | None]:
    """(numpy dtype of `hidden`, numpy dtype of `hidden_scales`)."""
    return {BF16: ("uint16", None), FP8: ("uint8", "float32"), FP4: ("uint8", "float16")}[hidden_dtype]


def torch_dtypes(hidden_dtype: str) -> tuple["torch.dtype", "torch.dtype | None"]:
    """(torch dtype of `hidden`, of `hidden_scales` or None) as tensors hold them: bf16 values, fp8 as
    float8_e4m3fn (the same bytes), packed fp4 as uint8."""
    import torch

    return {BF16: (torch.bfloat16, None), FP8: (torch.float8_e4m3fn, torch.float32),
            FP4: (torch.uint8, torch.float16)}[hidden_dtype]


def scaling_metadata(hidden_dtype: str, hidden_size: int) -> dict | None:
    """What the root metadata says about the scaling: enough for a plain zarr client to rebuild the values."""
    if hidden_dtype == FP8:
        return {"scales_array": "hidden_scales", "scale_dtype": "float32", "group_size": hidden_size,
                "element": "float8_e4m3fn: sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; exponent 0 is "
                           "subnormal (m/8 * 2^-6); 0x7f and 0xff are NaN; no infinities",
                "formula": "value[r, t, j] = e4m3(hidden[r, t, j]) * hidden_scales[r, t, j // group_size]"}
    if hidden_dtype == FP4:
        return {"scales_array": "hidden_scales", "scale_dtype": "float16", "group_size": FP4_GROUP,
                "element": "e2m1: sign bit 3, magnitude code bits 2-0 -> [0, 0.5, 1, 1.5, 2, 3, 4, 6]; element 2i "
                           "in the low nibble of byte i, element 2i+1 in the high nibble",
                "formula": "value[r, t, j] = e2m1(nibble j % 2 of hidden[r, t, j // 2]) * "
                           "hidden_scales[r, t, j // group_size]"}
    return None


def check_shape(hidden_dtype: str, hidden_size: int) -> str | None:
    """Why a hidden size cannot be stored in this format (None: it can)."""
    if hidden_dtype == FP4 and hidden_size % FP4_GROUP:
        return f"hidden_size {hidden_size} is not a multiple of {FP4_GROUP} (the fp4 scale group)"
    return None


# -- torch (extraction quantises on the GPU; the training step dequantises inside its compiled graph) ----------


def quantize(x: "torch.Tensor", hidden_dtype: str, num_layers: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """x [..., K*H] (any float dtype, any device) -> (hidden, scales) as stored:
    fp8: float8_e4m3fn [..., K*H] and float32 [..., K]; fp4: uint8 [..., K*H/2] and float16 [..., K*H/32]."""
    import torch

    *lead, W = x.shape
    if hidden_dtype == FP8:
        g = x.float().reshape(*lead, num_layers, W // num_layers)
        scale = g.abs().amax(-1) / FP8_MAX
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = (g * inv[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.reshape(*lead, W), scale
    if hidden_dtype == FP4:
        g = x.float().reshape(*lead, W // FP4_GROUP, FP4_GROUP)
        scale = (g.abs().amax(-1) / FP4_MAX).clamp(max=FP16_MAX).to(torch.float16)
        s = scale.float()
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        y = (g * inv[..., None]).clamp(-FP4_MAX, FP4_MAX)
        a = y.abs()  # round to the e2m1 grid (steps 0.5 below 2, 1 below 4, 2 above; ties to the even code)
        q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
        mag = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4))  # grid value -> code 0..7
        code = mag.to(torch.uint8) | ((y < 0) & (mag > 0)).to(torch.uint8) << 3
        code = code.reshape(*lead, W // 2, 2)
        packed = code[..., 0] | (code[..., 1] << 4)
        return packed, scale
    raise ValueError(f"quantize: {hidden_dtype!r} is not a quantised hidden dtype")


def dequantize(hidden: "torch.Tensor", scales: "torch.Tensor", dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """The stored (hidden, scales) -> values [..., K*H] in `dtype` (default bfloat16). The format follows from
    the tensors: float8_e4m3fn hidden = fp8 (scales float32 [..., K]); uint8 hidden = fp4 (scales float16).
    Pure tensor ops with fixed shapes: it compiles into the training step's graph."""
    import torch

    dtype = dtype or torch.bfloat16
    *lead, n = hidden.shape
    if hidden.dtype == torch.float8_e4m3fn:
        K = scales.shape[-1]
        v = hidden.reshape(*lead, K, n // K).float() * scales.float()[..., None]
        return v.reshape(*lead, n).to(dtype)
    if hidden.dtype == torch.uint8:
        codes = torch.stack([hidden & 0xF, hidden >> 4], dim=-1)  # [..., n, 2]
        e, m = ((codes >> 1) & 3).float(), (codes & 1).float()  # arithmetic, no table: no host-to-device copy
        mag = torch.where(e == 0, m * 0.5, torch.exp2(e - 1) * (1 + m * 0.5))
        v = torch.where(codes >= 8, -mag, mag).reshape(*lead, scales.shape[-1], FP4_GROUP)
        return (v * scales.float()[..., None]).reshape(*lead, 2 * n).to(dtype)
    raise ValueError(f"dequantize: hidden of dtype {hidden.dtype} is not a quantised format (float8_e4m3fn or uint8)")


# -- numpy reference (what a plain zarr client does with the metadata's formula) ---------------------------------


def e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn byte (NaN for 0x7f, 0xff)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return (sign * mag).astype(np.float32)


def dequantize_numpy(hidden: np.ndarray, scales: np.ndarray, hidden_dtype: str) -> np.ndarray:
    """float32 values from stored uint8 bytes and scales, with numpy only."""
    if hidden_dtype == FP8:
        K = scales.shape[-1]
        v = e4m3_table()[hidden].reshape(*hidden.shape[:-1], K, -1) * scales[..., None]
        return v.reshape(hidden.shape).astype(np.float32)
    if hidden_dtype == FP4:
        lut = np.array([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)], dtype=np.float32)
        codes = np.stack([hidden & 0xF, hidden >> 4], axis=-1)
        v = lut[codes].reshape(*hidden.shape[:-1], scales.shape[-1], FP4_GROUP)
        v = v * scales.astype(np.float32)[..., None]
        return v.reshape(*hidden.shape[:-1], 2 * hidden.shape[-1])
    raise ValueError(f"dequantize_numpy: {hidden_dtype!r} is not a quantised hidden dtype")
