"""apply_moepeak switches checkpointing on through transformers' supported entry point, picked by
feature: activation_checkpointing_enable where the model has it (transformers 5.24 and later
deprecate gradient_checkpointing_enable with a FutureWarning), else gradient_checkpointing_enable
(5.17). Either way every decoder layer runs SCO, and the supported pair switches it off and on
again with SCO kept."""
import warnings

import pytest

transformers = pytest.importorskip("transformers")

import moepeak  # noqa: E402
from moepeak.hf import apply_moepeak  # noqa: E402
from moepeak.hf.checkpoint import enable_checkpointing  # noqa: E402
from test_hf import build  # noqa: E402


def _layers(model):
    return [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]


def _sco_everywhere(model):
    layers = _layers(model)
    return all(m.gradient_checkpointing for m in layers) and \
        [m._gradient_checkpointing_func.func for m in layers] == [moepeak.sco_checkpoint] * len(layers)


def test_apply_moepeak_raises_no_deprecation_warning_and_the_supported_pair_keeps_sco():
    model = build("qwen3_moe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_moepeak(model, experts=False, loss=False)
    deprecated = [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    assert deprecated == [], deprecated
    assert _sco_everywhere(model)
    new_api = hasattr(model, "activation_checkpointing_enable")
    (model.activation_checkpointing_disable if new_api else model.gradient_checkpointing_disable)()
    assert not any(m.gradient_checkpointing for m in _layers(model))
    (model.activation_checkpointing_enable if new_api else model.gradient_checkpointing_enable)()
    assert _sco_everywhere(model)


class _Entry:
    """A model stand-in with only the entry points given: records which one ran."""

    def __init__(self, *names):
        self.called = []
        for name in names:
            setattr(self, name, lambda name=name: self.called.append(name))


@pytest.mark.parametrize("names, expected", [
    (("activation_checkpointing_enable", "gradient_checkpointing_enable"), "activation_checkpointing_enable"),
    (("gradient_checkpointing_enable",), "gradient_checkpointing_enable"),  # transformers 5.17
])
def test_entry_point_is_chosen_by_feature(names, expected):
    model = _Entry(*names)
    enable_checkpointing(model)
    assert model.called == [expected]
