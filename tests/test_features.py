"""Which features run together (jaxtron/parallel/features.py): every pair the table lists is
refused in one line naming both settings, and each feature alone, or with the others it does
compose with, passes."""

import itertools

import pytest
from helpers import tiny_config

from jaxtron.config import ConfigError
from jaxtron.parallel import features

# what turns each feature on, as config overrides and mesh sizes
ON = {"pipeline": ((), {"stage": 2}), "ticks": (("pipeline.schedule=1f1b",), {"stage": 2}),
      "context": ((), {"context": 2}),
      "experts": (("model.moe.num_experts=4",), {}), "mtp": (("model.mtp_depth=1",), {}),
      "fp8_delayed": (("model.fp8=delayed",), {}),
      "window": (("model.sliding_window=32",), {}),
      "mixed_windows": (("model.sliding_window=32", "model.global_every=2"), {}),
      "softcap": (("model.attn_softcap=50",), {})}
# the pairs that do not run today (a row removed from the table without the code to back it
# fails here)
REFUSED = [("context", "experts"), ("fp8_delayed", "pipeline"), ("ticks", "mtp"),
           ("context", "window"), ("pipeline", "mixed_windows"), ("context", "softcap")]
# pairs refused through a feature the second turns on too (layers that differ in their windows
# have a window; the 1F1B ticks run a pipeline)
IMPLIED = [("context", "mixed_windows"), ("fp8_delayed", "ticks"), ("mixed_windows", "ticks")]
SETTING = {"pipeline": "mesh.stage=2", "ticks": "pipeline.schedule=1f1b",
           "context": "mesh.context=2",
           "experts": "model.moe.num_experts=4", "mtp": "model.mtp_depth=1",
           "fp8_delayed": "model.fp8=delayed",
           "window": "model.sliding_window=32", "mixed_windows": "model.global_every=2",
           "softcap": "model.attn_softcap=50"}


def _run_with(*names: str):
    overrides = [o for name in names for o in ON[name][0]]
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}
    for name in names:
        sizes.update(ON[name][1])
    return tiny_config(*overrides), sizes


def test_every_feature_has_a_way_on():
    assert set(ON) == set(features.FEATURES)
    assert {name for pair in features.EXCLUSIONS for name in pair} <= set(features.FEATURES)


@pytest.mark.parametrize("pair", REFUSED, ids="+".join)
def test_a_pair_that_does_not_compose_is_refused_in_one_line(pair):
    cfg, sizes = _run_with(*pair)
    with pytest.raises(ConfigError) as refused:
        features.check(cfg, sizes)
    message = str(refused.value)
    assert "\n" not in message and all(SETTING[name] in message for name in pair), message


@pytest.mark.parametrize("pair", [p for p in itertools.combinations(sorted(ON), 2)
                                  if not {p, p[::-1]} & {*REFUSED, *IMPLIED}], ids="+".join)
def test_features_that_compose_pass(pair):
    features.check(*_run_with(*pair))


@pytest.mark.parametrize("pair", IMPLIED, ids="+".join)
def test_a_pair_refused_through_what_it_implies_is_refused(pair):
    with pytest.raises(ConfigError, match=SETTING[pair[0]]):
        features.check(*_run_with(*pair))
