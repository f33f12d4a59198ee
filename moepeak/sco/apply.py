"""apply_sco: every decoder block of a model under sco_checkpoint, in place; offloader_of:
the SCOOffloader it gave them (for its stats() and free())."""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .checkpoint import sco_checkpoint
from .offloader import SCOOffloader
from .options import SCOConfig


def _blocks_of(model: torch.nn.Module, blocks) -> list:
    """blocks as a list of submodules of model (see apply_sco); raises naming the bad one."""
    single = isinstance(blocks, torch.nn.Module) and not isinstance(blocks, torch.nn.ModuleList)
    if isinstance(blocks, type):
        mods = [m for m in model.modules() if isinstance(m, blocks)]
    elif single:
        mods = [blocks]
    else:
        mods = list(blocks)
    if not mods:
        raise ValueError(f"moepeak: apply_sco found no blocks matching {blocks!r}")
    in_model = {id(m) for m in model.modules()}
    for i, m in enumerate(mods):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"moepeak: apply_sco blocks must be nn.Modules, got {type(m).__name__}")
        if id(m) not in in_model:  # wrapping it would leave every forward of model unchanged
            which = "blocks" if single else f"blocks[{i}]"
            raise ValueError(f"moepeak: apply_sco {which} ({type(m).__name__}) is not a submodule of model "
                             f"({type(model).__name__}): pass model's own blocks (e.g. model.layers)")
        if getattr(m, "_moepeak_sco", None) is not None:
            raise ValueError(f"moepeak: apply_sco already applied to block {type(m).__name__}")
    return mods


def _offloader(config, offloader) -> SCOOffloader:
    if offloader is not None:
        if not isinstance(offloader, SCOOffloader):
            raise TypeError(f"moepeak: apply_sco offloader must be a moepeak.SCOOffloader, got "
                            f"{type(offloader).__name__}")
        if config is not None and config != offloader.config:
            raise ValueError("moepeak: apply_sco got both config and an offloader with another config: pass one")
        return offloader
    if config is not None and not isinstance(config, SCOConfig):
        raise TypeError(f"moepeak: apply_sco config must be a moepeak.SCOConfig, got {type(config).__name__}")
    return SCOOffloader(config)


def apply_sco(model: torch.nn.Module, blocks, config: Optional[SCOConfig] = None, *,
              offloader: Optional[SCOOffloader] = None):
    """Checkpoint-and-offload each decoder block of `model` (in place).

    blocks: a list/tuple of submodules of model, an nn.ModuleList of them, or a
    module class (all submodules of that class, in registration order); a
    block that is not a submodule of model raises. Each block's forward is
    wrapped so that in training with grad enabled it runs under
    sco_checkpoint; in eval or under no_grad it runs as is (no offload). The
    last keep_last blocks keep their input on the GPU (the offloader's current
    config: SCOOffloader.reconfigure(keep_last=...) between steps moves the line). config: an
    SCOConfig (None: the defaults), run by a new SCOOffloader; or offloader: the
    SCOOffloader to run them (one shared with other calls). offloader_of(model)
    returns it. The module tree and state_dict keys are unchanged, so
    fully_shard (FSDP2) can be applied to the blocks before or after. Returns model.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"moepeak: apply_sco model must be an nn.Module, got {type(model).__name__}")
    mods = _blocks_of(model, blocks)
    runner = _offloader(config, offloader)
    runner.num_blocks = len(mods)  # keep_last counts from the last of them; the disk tier's forecast
    for i, m in enumerate(mods):
        orig = m.forward

        def forward(*a, _orig=orig, _from_end=len(mods) - 1 - i, _ref=weakref.ref(m), **k):
            mod = _ref()
            if mod is None or not mod.training or not torch.is_grad_enabled():
                return _orig(*a, **k)
            return sco_checkpoint(_orig, *a, sco_offloader=runner, sco_block_from_end=_from_end, **k)

        m.forward = forward
        m._moepeak_sco = runner
    return model


def offloader_of(module: torch.nn.Module) -> SCOOffloader:
    """The SCOOffloader apply_sco gave `module`'s blocks (module: a model or one block)."""
    found = {id(r): r for r in (getattr(m, "_moepeak_sco", None) for m in module.modules()) if r is not None}
    if len(found) != 1:
        what = "no block under apply_sco" if not found else f"blocks of {len(found)} offloaders"
        raise ValueError(f"moepeak: offloader_of({type(module).__name__}): it has {what}; pass a model (or "
                         "block) that apply_sco wrapped with one offloader")
    return next(iter(found.values()))
