"""Which target layers a drafter reads: DFlash's default rule (K ids spread uniformly from layer 1 to L-3).

Layer id i means the output of decoder layer i (`hidden_states[i + 1]` in Hugging Face terms). Extraction
picks these ids when --layers is not given; the drafter records them in its config (dflash_config).
"""

from __future__ import annotations

from dflash.core.errors import DflashError


class LayerIdError(DflashError, ValueError):
    """A target too shallow for the default layer rule (pass layer ids instead)."""


def default_layer_ids(num_target_layers: int, k: int = 5) -> list[int]:
    """K target layer ids spread uniformly from 1 to L-3 (36 layers, K=5 -> [1, 9, 17, 25, 33]).

    A target too shallow for K distinct ids in that range gets every layer of the range instead."""
    if k == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise LayerIdError(f"a target with {num_target_layers} layers is too shallow for the default layer rule; pass layer ids")
    k = min(k, end - start + 1)
    if k == 1:
        return [start]
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]
