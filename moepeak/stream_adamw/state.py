"""StreamAdamW's per-parameter state: where it lives, its dtypes, its creation (after a
host-room check that reads the one byte formula, sizes.state_bytes_per_param) and the
checks the kernel relies on. Mixed into StreamAdamW (moepeak/stream_adamw/optimizer.py).

Per param p (local tensor lp), in self.state[p]:
  step            fp32 0-d tensor, on the state's device
  exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad)
                  host params: options.state_dtype (fp32, or bf16 stored with stochastic
                  rounding), on the CPU; device_state params: fp32 on lp's device
  master_param    bf16/fp16 params only: the fp32 master, beside the moments
  rounding_seed   bf16 state only: an int, options.rounding_seed + p's index in the
                  optimizer (its place in param_groups, counted over all groups) when the
                  state is created, kept so that a resumed run rounds identically
An fp32 CUDA param's fp32 master is a host copy in self._gpu_master (always equal to the
param, rebuilt from it after a load); an fp32 CPU param is its own master.
"""
from __future__ import annotations

import torch

from ..core.host_memory import check_room
from .checks import check_state_tensors
from .options import SEED_LIMIT
from .sizes import state_bytes_per_param

HOST_ROOM_REMEDY = ("keep part of it on the GPU (device_state=StreamAdamW.backward_tail(params, max_bytes)), "
                    "use state_dtype=torch.bfloat16 (8 instead of 12 bytes per bf16 param), shard the params "
                    "over more ranks, or free host memory")


def moment_keys(group) -> tuple:
    """The state keys of a param group's moments: exp_avg, exp_avg_sq (+ max_exp_avg_sq)."""
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())


class ParamStateMixin:
    """The state of StreamAdamW's params (uses its options, state, _on_device, _devices,
    _gpu_master)."""

    def _piped(self, lp) -> bool:
        """Whether lp's update streams through a bucket plan (a CUDA param; a CPU param in
        the tests' host pipeline) rather than running in place on the CPU."""
        return lp.is_cuda or self.options.host_pipeline

    def _state_device(self, p, lp) -> torch.device:
        """Where p's state lives: its own device for device_state params, else the CPU."""
        return lp.device if p in self._on_device else torch.device("cpu")

    def _moment_dtype(self, p) -> torch.dtype:
        """The dtype of p's exp_avg / exp_avg_sq / max_exp_avg_sq."""
        return torch.float32 if p in self._on_device else self.options.state_dtype

    def _uses_rounding_seed(self, p) -> bool:
        return self._moment_dtype(p) != torch.float32

    def _host_state_bytes_to_create(self, entries) -> int:
        """Host bytes the state of entries [(group, p, lp, ...)] (host params) still needs:
        sizes.state_bytes_per_param of each, less what exists already."""
        need = 0
        for group, p, lp, *_ in entries:
            full = lp.numel() * state_bytes_per_param(lp.dtype, self.options.state_dtype,
                                                      amsgrad=bool(group["amsgrad"]), in_place=not self._piped(lp))
            have = sum(t.numel() * t.element_size() for t in self._state_tensors(group, p, lp).values()
                       if isinstance(t, torch.Tensor))
            need += max(0, full - have)
        return need

    def _state_tensors(self, group, p, lp) -> dict:
        """The tensors the kernel reads and writes for p, by name (None where missing)."""
        st = self.state[p]
        held = {k: st.get(k) for k in moment_keys(group)}
        if lp.dtype != torch.float32:
            held["master_param"] = st.get("master_param")
        elif self._piped(lp) and p not in self._on_device:
            held["the fp32 master copy"] = self._gpu_master.get(p)
        return held

    def _create_host_state(self, entries) -> None:
        """Create the missing state of host entries, after checking the host has room for it."""
        check_room(self._host_state_bytes_to_create(entries),
                   f"moepeak.StreamAdamW: the optimizer state of {len(entries)} params", HOST_ROOM_REMEDY,
                   pinned=False)
        index_of = self._param_indices() if any(self._uses_rounding_seed(p) and "rounding_seed" not in
                                                 self.state[p] for _, p, *_ in entries) else None
        for group, p, lp, *_ in entries:
            self._init_state(group, p, lp, index_of)

    def _init_state(self, group, p, lp, index_of=None) -> None:
        st = self.state[p]
        dev = self._state_device(p, lp)
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=dev)
        for k in moment_keys(group):
            if k not in st:
                st[k] = torch.zeros(lp.shape, dtype=self._moment_dtype(p), device=dev)
        if lp.dtype != torch.float32 and "master_param" not in st:
            st["master_param"] = lp.detach().to(dev, torch.float32, copy=True).contiguous()
        if self._uses_rounding_seed(p) and "rounding_seed" not in st:
            index = (index_of if index_of is not None else self._param_indices())[p]
            st["rounding_seed"] = (self.options.rounding_seed + index) % SEED_LIMIT
        if p not in self._on_device and lp.dtype == torch.float32 and self._piped(lp) and p not in self._gpu_master:
            self._gpu_master[p] = lp.detach().to("cpu", copy=True).contiguous()
        self._devices.setdefault(p, lp.device)

    def _param_indices(self) -> dict:
        """param -> its place among the optimizer's params, counted over all groups in order."""
        return {q: i for i, q in enumerate(q for g in self.param_groups for q in g["params"])}

    def _check_state(self, group, p, lp, name) -> None:
        """The state tensors the kernel will read and write must be contiguous, of their
        dtype (the moments options.state_dtype on the host, fp32 on a device; the masters
        fp32), on the state's device and of the param's numel (a param whose .data was
        replaced, a replaced exp_avg/exp_avg_sq, a loaded state of another size all end
        here); with bf16 state the rounding seed an int in [0, 2^63)."""
        moment = self._moment_dtype(p)
        held = [(k, t, moment if k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") else torch.float32)
                for k, t in self._state_tensors(group, p, lp).items()]
        if p in self._on_device:
            held.append(("step", self.state[p].get("step"), torch.float32))
        check_state_tensors(held, lp, name, self._state_device(p, lp), p in self._on_device)
        if self._uses_rounding_seed(p):
            seed = self.state[p].get("rounding_seed")
            if isinstance(seed, torch.Tensor) and seed.numel() == 1 and not seed.is_floating_point():
                seed = int(seed)  # a checkpoint format that keeps ints as tensors
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
                raise TypeError(f"moepeak.StreamAdamW: {name}: state 'rounding_seed' must be an int in [0, 2^63), "
                                f"got {seed!r}")

    def _master(self, p, lp):
        """The fp32 master the kernel updates: master_param, the host copy of an fp32 CUDA
        param, or the fp32 CPU param itself."""
        if lp.dtype != torch.float32:
            return self.state[p]["master_param"]
        if self._piped(lp) and p not in self._on_device:
            return self._gpu_master[p]
        return lp

    def _rounding_seed(self, p) -> int:
        """p's rounding seed for the kernel (0 for fp32 state: unused)."""
        if not self._uses_rounding_seed(p):
            return 0
        return int(self.state[p]["rounding_seed"])
