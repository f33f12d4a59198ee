"""SCOOffloader: SCO's runtime, the one object that holds resources and statistics.

A config (SCOConfig) says how boundaries are placed and moved; an offloader does it: one
engine per device (made at first use: the pinned arena, the copy and load streams, the
events, the spill file and its staging slots), their counters and schedule logs, and
free(). apply_sco, sco_checkpoint (sco_offloader=), the Hugging Face drop-in
(MoepeakReport.sco) and the torchtitan override (SCOActivationCheckpointing.sco) hold one;
sco_checkpoint without one uses the process's default offloader (default_offloader()).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import _C
from .engine import SCOEngine
from .options import SCOConfig


def _canonical(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class SCOOffloader:
    """SCO's runtime for one config: engines per device, their statistics, free().

    config: an SCOConfig (None: the defaults). extension: moepeak._C (None), or a stand-in
    with its functions that the engines call instead (tests count the calls through one:
    moepeak.testing.sco_extension). blocks_per_step: how many boundaries one step sends off
    the device (apply_sco sets it from its blocks): with the disk tier on, the first step
    already places the earliest on disk (later steps count for themselves)."""

    def __init__(self, config: Optional[SCOConfig] = None, *, extension=None):
        config = SCOConfig() if config is None else config
        if not isinstance(config, SCOConfig):
            raise TypeError(f"moepeak: SCOOffloader config must be a moepeak.SCOConfig, got {type(config).__name__}")
        self.config = config
        self.extension = _C if extension is None else extension
        self.blocks_per_step: Optional[int] = None
        self._engines: Dict[torch.device, SCOEngine] = {}

    def __repr__(self):
        return f"SCOOffloader({self.config!r}, devices={[str(d) for d in self._engines]})"

    def kept_blocks(self, blocks) -> list:
        """The blocks (in forward order) whose input stays on the GPU: the config's last keep_last."""
        return self.config.kept_blocks(blocks)

    def engine(self, device) -> SCOEngine:
        """The engine of `device` (made at its first use)."""
        device = _canonical(device)
        eng = self._engines.get(device)
        if eng is None:
            eng = self._engines[device] = SCOEngine(self.config, device, self.extension, self.blocks_per_step)
        return eng

    def set_extension(self, ext) -> object:
        """Make every engine (and those made later) call ext in place of the extension it
        called; returns that one (moepeak.testing.sco_extension restores it)."""
        previous, self.extension = self.extension, ext
        for eng in self._engines.values():
            eng.set_extension(ext)
        return previous

    def stats(self, device=None) -> dict:
        """Counters, tiers and schedule log of the engine of `device` (SCOEngine.stats).
        device=None: the one engine this offloader has used (blocks moved by FSDP2 / .to()
        land on whatever device their inputs are on; None avoids guessing it)."""
        if device is None:
            if len(self._engines) > 1:
                raise ValueError(f"moepeak: SCOOffloader.stats(device=None) is ambiguous: engines on "
                                 f"{sorted(str(d) for d in self._engines)}; pass the device")
            if not self._engines:
                return SCOEngine.empty_stats()
            return next(iter(self._engines.values())).stats()
        eng = self._engines.get(_canonical(device))
        return eng.stats() if eng is not None else SCOEngine.empty_stats()

    def devices(self) -> list:
        """The devices this offloader has an engine on (one engine is made per device at first use)."""
        return list(self._engines)

    def free(self) -> None:
        """Free every engine's pinned arena, staging slots and spill file (raises if boundaries
        are still live). The offloader stays usable: a later step allocates again."""
        for eng in self._engines.values():
            eng.free()


_DEFAULT: Optional[SCOOffloader] = None


def default_offloader() -> SCOOffloader:
    """The offloader sco_checkpoint uses when given none (SCOConfig's defaults; made at first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = SCOOffloader()
    return _DEFAULT
