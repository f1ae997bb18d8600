"""The model: what each layer computes, in Flax NNX with logical axis names only. The decoder
(decoder.py), its mixture-of-experts MLP (moe.py), the shared pieces (layers.py), the settings'
checks and remat policies (settings.py) and generation over a KV cache (generate.py); how each
operation runs on the mesh is jaxtron/ops/."""

from jaxtron.model.decoder import (  # noqa: F401  the model's public names
    Transformer,
    count_params,
    in_compute_dtype,
    init_cache,
    rope_frequencies,
)
from jaxtron.model.families import abstract_model, build, family_of, head_sizes  # noqa: F401
from jaxtron.model.settings import OFFLOADING, REMAT_POLICIES, check, check_remat  # noqa: F401
