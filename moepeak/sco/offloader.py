"""SCOOffloader: SCO's runtime, the one object that holds resources and statistics.

A config (SCOConfig) says how boundaries are placed and moved; an offloader does it: one
engine per device (made at first use: the pinned arena, the copy and load streams, the
events, the spill file and its staging slots), their counters and schedule logs, and
free(). apply_sco, sco_checkpoint (sco_offloader=), the Hugging Face drop-in
(MoepeakReport.sco) and the torchtitan override (SCOActivationCheckpointing.sco) hold one;
sco_checkpoint without one uses the process's default offloader (default_offloader()).
"""
from __future__ import annotations

import dataclasses
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

    config: an SCOConfig (None: the defaults); reconfigure() replaces it between steps.
    extension: moepeak._C (None), or a stand-in with its functions that the engines call
    instead (tests count the calls through one: moepeak.testing.sco_extension).
    num_blocks: how many blocks run under this offloader per forward (apply_sco and
    moepeak.hf set it; None: unknown). With it, the blocks passed sco_block_from_end= keep
    their input on the GPU by the current config's keep_last (keeps()), and the disk tier
    places the earliest boundaries on disk from the first step on (blocks_per_step)."""

    def __init__(self, config: Optional[SCOConfig] = None, *, extension=None):
        config = SCOConfig() if config is None else config
        if not isinstance(config, SCOConfig):
            raise TypeError(f"moepeak: SCOOffloader config must be a moepeak.SCOConfig, got {type(config).__name__}")
        self.config = config
        self.extension = _C if extension is None else extension
        self.num_blocks: Optional[int] = None
        self._engines: Dict[torch.device, SCOEngine] = {}

    def __repr__(self):
        return f"SCOOffloader({self.config!r}, devices={[str(d) for d in self._engines]})"

    @property
    def blocks_per_step(self) -> Optional[int]:
        """Boundaries one forward of num_blocks sends off the GPU (None: num_blocks unknown)."""
        if self.num_blocks is None:
            return None
        return self.num_blocks - min(self.config.keep_last, self.num_blocks)

    def keeps(self, from_end: int) -> bool:
        """Whether the block `from_end` places before the last (0: the last) keeps its input on
        the GPU under the current config: from_end < keep_last."""
        return from_end < self.config.keep_last

    def kept_blocks(self, blocks) -> list:
        """The blocks (in forward order) whose input stays on the GPU: the config's last keep_last."""
        return self.config.kept_blocks(blocks)

    @property
    def idle(self) -> bool:
        """No boundary is live on any engine (between steps): reconfigure() may run."""
        return not any(eng.live for eng in self._engines.values())

    def reconfigure(self, config: Optional[SCOConfig] = None, **fields) -> SCOConfig:
        """Replace the config between steps; returns the new one. Either a whole SCOConfig or
        some of its fields, e.g. reconfigure(keep_last=2), reconfigure(spill_dir="/nvme",
        host_budget_bytes=64 << 30), reconfigure(spill_dir=None, host_budget_bytes=None)
        (disk tier off); checked as SCOConfig checks them, before anything changes. The
        automatic placement (moepeak.plan) calls it when the step's tokens change.

        Takes effect at the next boundary: blocks run with sco_block_from_end= (apply_sco,
        moepeak.hf) follow the new keep_last; a change of max_in_flight, prefetch or keep_last
        only is free; any other field frees each engine's arena, staging slots and spill file
        (made again, to the new config, at their next use; the counters carry on). Raises
        RuntimeError while boundaries are live (between a forward and its backward). If an
        engine cannot make the new arena (MemoryError naming the field), every engine and the
        offloader go back to the previous config (SCOEngine.reconfigure); an engine that cannot
        get it back either is dropped and made anew at its next use."""
        if config is None:
            unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(SCOConfig)})
            if unknown:
                raise TypeError(f"moepeak: SCOOffloader.reconfigure: SCOConfig has no field {', '.join(unknown)}")
            config = dataclasses.replace(self.config, **fields)
        elif fields:
            raise TypeError("moepeak: SCOOffloader.reconfigure takes a config or fields, not both")
        if not isinstance(config, SCOConfig):
            raise TypeError(f"moepeak: SCOOffloader.reconfigure config must be a moepeak.SCOConfig, got "
                            f"{type(config).__name__}")
        busy = {str(d): len(eng.live) for d, eng in self._engines.items() if eng.live}
        if busy:
            raise RuntimeError(f"moepeak: SCOOffloader.reconfigure between steps only: boundaries are still live "
                               f"({busy}); call it before a forward or after its backward")
        previous, done = self.config, []
        self.config = config
        for device, eng in list(self._engines.items()):
            try:
                eng.reconfigure(config, self.blocks_per_step)
            except Exception:
                # all or nothing: eng put its previous config back itself; the engines already
                # moved go back too; an engine that could not (its unusable says why) is dropped,
                # to be made anew at its next use
                self.config = previous
                for _, e in done:
                    try:
                        e.reconfigure(previous, self.blocks_per_step)
                    except Exception:
                        pass  # e.unusable is set
                for d, e in [(device, eng)] + done:
                    if e.unusable:
                        del self._engines[d]
                raise
            done.append((device, eng))
        return config

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
