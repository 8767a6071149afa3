"""Every config dflash writes reads the same under transformers 4.5x and 5.x.

transformers 5 writes RoPE under `rope_parameters` only; 4.x (4.57 is the reference inference code's pin and many
serving images') reads the top-level `rope_theta` and `rope_scaling` and silently takes its default 10,000 when
rope_theta is absent: the reference then decodes with another model (tau 1.17 instead of 1.23 on 8 prompts). The
configs dflash writes: the drafter (RUN/final), the target the demo prepares from a GGUF (dflash/core/target.py
convert_gguf; the real SmolLM2 conversion is checked in tests/test_extract.py with `rope_readings`), and both
exports (`dflash export --format zlab|speculators`).

4.x's reading rule is emulated (installing transformers 4.57 beside 5.x is not practical): Qwen3Config and
LlamaConfig in 4.57 take `rope_theta` (default 10000.0) and `rope_scaling` (default None) as arguments and keep any
`rope_parameters` as an unread attribute. 5.x's reading is transformers 5's own (AutoConfig.for_model).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from transformers import AutoConfig

from dflash.cli import main as cli_main
from dflash.core.target import portable_rope
from dflash.train.drafter.checkpoint import save_drafter
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig
from tests.tiny import make_tiny_target

THETA = 500_000.0
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def read_as_transformers_4(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) as transformers 4.57's Qwen3Config / LlamaConfig read a config.json."""
    scaling = d.get("rope_scaling")
    return float(d.get("rope_theta", 10000.0)), ({k: v for k, v in scaling.items() if k != "type"} if scaling else None)


def read_as_transformers_5(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, the rest of rope_parameters unless default) as this transformers 5 reads it."""
    cfg = AutoConfig.for_model(**json.loads(json.dumps(d)))
    rope = dict(cfg.rope_parameters)
    theta = float(rope.pop("rope_theta"))
    return theta, (rope if rope.get("rope_type", "default") != "default" else None)


def rope_readings(d: dict) -> tuple[tuple, tuple]:
    return read_as_transformers_4(d), read_as_transformers_5(d)


def test_a_transformers_5_config_misreads_under_4x_and_portable_rope_fixes_it(tmp_path):
    path = make_tiny_target(tmp_path / "target")
    with open(f"{path}/config.json") as f:
        d = json.load(f)
    d.pop("rope_theta", None)  # as transformers 5 writes it: rope_parameters only
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": THETA}
    assert read_as_transformers_5(d) == (THETA, None)
    assert read_as_transformers_4(d) == (10000.0, None)  # the silent misread this guards against
    fixed = portable_rope(d)
    assert read_as_transformers_4(fixed) == read_as_transformers_5(fixed) == (THETA, None)
    # scaled RoPE (llama3) keeps its scaling under both layouts; a 4.x-layout config gains rope_parameters
    d["rope_parameters"] = {**LLAMA3, "rope_theta": THETA}
    fixed = portable_rope(d)
    assert read_as_transformers_4(fixed) == read_as_transformers_5(fixed) == (THETA, LLAMA3)
    old = portable_rope({k: v for k, v in d.items() if k != "rope_parameters"} | {"rope_theta": THETA})
    assert old["rope_parameters"] == {"rope_type": "default", "rope_theta": THETA}


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_every_config_dflash_writes_reads_the_same_under_both_layouts(tmp_path, scaling):
    cfg = DrafterConfig.named("tiny", rope_theta=THETA, rope_scaling=scaling, max_position_embeddings=65536)
    model = DFlashDrafter(cfg)
    final = tmp_path / "run" / "final"
    save_drafter(model, str(final))
    target = make_tiny_target(tmp_path / "target", num_layers=cfg.num_target_layers, hidden=cfg.hidden_size)
    configs = {"drafter": json.loads((final / "config.json").read_text())}
    for fmt in ("zlab", "speculators"):
        out = tmp_path / fmt
        r = CliRunner().invoke(cli_main, ["export", str(final), "--format", fmt, "--out", str(out), "--target", target])
        assert r.exit_code == 0, r.output
        d = json.loads((out / "config.json").read_text())
        configs[fmt] = d["transformer_layer_config"] if fmt == "speculators" else d
    for name, d in configs.items():
        four, five = rope_readings(d)
        assert four == five == (THETA, scaling), (name, four, five)
