"""apply_moepeak's checkpoint part: SCO (moepeak.sco_checkpoint) as the gradient-checkpointing
function of every GradientCheckpointingLayer of the model, enabled at once and reinstalled
by a later activation_checkpointing_enable() or gradient_checkpointing_enable() (both reach
the instance's _set_gradient_checkpointing, which is replaced).
"""
from __future__ import annotations

import functools
import types


def patch_checkpoint(model, options, report):
    from transformers.modeling_layers import GradientCheckpointingLayer
    from ..sco import SCOConfig, SCOOffloader, sco_checkpoint

    if not getattr(model, "supports_gradient_checkpointing", False) or not any(
            isinstance(m, GradientCheckpointingLayer) for m in model.modules()):
        report.left_alone.append(f"checkpoint: {type(model).__name__} has no GradientCheckpointingLayer")
        return
    cfg = options.get("sco_config") or SCOConfig()
    if not isinstance(cfg, SCOConfig):
        raise TypeError(f"moepeak.hf: sco_config must be a moepeak.SCOConfig, got {type(cfg).__name__}")
    sco = SCOOffloader(cfg)  # the runtime: arena, streams, spill file, stats (report.sco)
    class_set = type(model)._set_gradient_checkpointing

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None, every_n_layers=1):
        if not enable:
            return class_set(self, enable=False)
        class_set(self, enable=True, gradient_checkpointing_func=functools.partial(sco_checkpoint, sco_offloader=sco),
                  every_n_layers=every_n_layers)
        layers = [m for m in self.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        sco.num_blocks = len(layers)
        for i, layer in enumerate(layers):
            # the last sco.config.keep_last layers (their backward runs first) keep their input on the
            # device; sco.reconfigure(keep_last=...) between steps moves that line
            layer._gradient_checkpointing_func = functools.partial(sco_checkpoint, sco_offloader=sco,
                                                                   sco_block_from_end=len(layers) - 1 - i)

    model._set_gradient_checkpointing = types.MethodType(_set_gradient_checkpointing, model)
    enable_checkpointing(model)
    report.sco_config, report.sco = cfg, sco
    report.patched.append("checkpoint: SCO (moepeak.sco_checkpoint) is the gradient-checkpointing function of "
                          "every GradientCheckpointingLayer, enabled; a later activation_checkpointing_enable() (or "
                          "gradient_checkpointing_enable()) reinstalls it")


def enable_checkpointing(model):
    """Switch checkpointing on through transformers' supported entry point, chosen by feature, not
    version: activation_checkpointing_enable where the model has it (transformers 5.24 and later deprecate
    gradient_checkpointing_enable in its favour), else gradient_checkpointing_enable (5.17)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
