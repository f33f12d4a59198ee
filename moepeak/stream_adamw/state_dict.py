"""StreamAdamW's state dict: torch.optim.AdamW's layout both ways (its state keys and
param-group keys; the state kept on the host in its own dtypes), FSDP2 (DTensor) params'
state as DTensors so that torch.distributed.checkpoint saves every rank's shard. Mixed into
StreamAdamW (moepeak/stream_adamw/optimizer.py), ahead of torch.optim.Optimizer.

Dtypes on load: master_param fp32; exp_avg, exp_avg_sq, max_exp_avg_sq the optimizer's
(state.py: options.state_dtype for host params, fp32 for device_state ones), whatever the
dict holds: fp32 moments (torch.optim.AdamW's, or an fp32 StreamAdamW's) loaded into
state_dtype=torch.bfloat16 are rounded to the nearest bf16 (ties to even, torch's .to());
bf16 moments loaded into fp32 state are widened exactly. rounding_seed (bf16 state) is
loaded as an int; a dict without it gets options.rounding_seed + the param's index at the
first step.
"""
from __future__ import annotations

import torch

from .checks import local_shard
from .options import SEED_LIMIT

# The per-param state tensors, each shaped like the local param (master_param: bf16/fp16 params).
STATE_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")
# The keys torch.optim.AdamW's groups carry beyond the hyper-parameters; fused=True: the
# kernel is bitwise torch's fused one, so a torch AdamW loaded from our state_dict runs it too.
TORCH_GROUP_KEYS = dict(foreach=None, capturable=False, differentiable=False, fused=True,
                        decoupled_weight_decay=True)


class StateDictMixin:
    """state_dict / load_state_dict for StreamAdamW (uses its _state_device, _moment_dtype,
    _gpu_master and _plan)."""

    def state_dict(self):
        """torch's layout. The state of an FSDP2 (DTensor) param lives in host RAM
        as a plain tensor of the *local shard's* shape; here it is returned as a
        DTensor with the param's mesh, placements, global shape and stride, so
        torch.distributed.checkpoint saves every rank's shard (a plain tensor
        would be taken for a replicated one and only one rank's copy kept).
        self.state is not changed (the per-param dicts are copied)."""
        sd = super().state_dict()
        idx_param = {}
        for g, sg in zip(self.param_groups, sd["param_groups"]):
            idx_param.update(zip(sg["params"], g["params"]))
        for idx, st in list(sd["state"].items()):
            p = idx_param.get(idx)
            if p is None or type(p).__name__ != "DTensor":
                continue
            from torch.distributed.tensor import DTensor
            lshape = tuple(local_shard(p).shape)
            st = dict(st)
            for k in STATE_TENSORS:
                v = st.get(k)
                if torch.is_tensor(v) and type(v).__name__ != "DTensor" and v.dim() > 0 \
                        and tuple(v.shape) == lshape:
                    st[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
            sd["state"][idx] = st
        return sd

    def load_state_dict(self, state_dict):
        """Accepts our own state dicts and torch.optim.AdamW's, with state
        tensors as DTensors (this rank's shard is taken) or plain local-shard
        tensors. The tensors are kept on the state's device in the state's dtypes
        (module docstring; torch's loader would cast them to the param's dtype and
        device). Every size and seed is checked before anything is loaded."""
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        id_map = _live_params_by_saved_id(saved_groups, self.param_groups)
        _check_sizes_and_seeds(saved_state, id_map)  # sizes first: nothing is loaded on a mismatch
        kept, light = {}, {}
        for pid, st in saved_state.items():
            kept[pid] = {k: st[k] for k in STATE_TENSORS if k in st}
            light[pid] = {k: v for k, v in st.items() if k not in STATE_TENSORS and k != "rounding_seed"}
        super().load_state_dict({"state": light, "param_groups": saved_groups})
        self._gpu_master.clear()
        self._plan = None
        for pid, tensors in kept.items():
            p = id_map.get(pid)
            if p is not None:
                self._load_param_state(p, pid, tensors, saved_state[pid])
        self._complete_group_keys()

    def _load_param_state(self, p, pid, tensors: dict, saved: dict) -> None:
        """self.state[p] (its light entries loaded by torch's loader) gets its own copies of the
        saved step, state tensors (this rank's shard, on the state's device in the state's dtypes,
        shaped like the local param) and rounding_seed."""
        st = self.state[p]
        lp = local_shard(p)
        dev = self._state_device(p, lp)
        if "step" in st:
            # a copy: the loaded dict's step tensor must not advance with this optimizer
            st["step"] = torch.as_tensor(st["step"]).detach().to(dev, torch.float32, copy=True).reshape(())
        for k, t in tensors.items():
            t = local_shard(t)
            if k == "master_param" and lp.dtype == torch.float32:
                continue  # an fp32 param is its own master
            dtype = torch.float32 if k == "master_param" else self._moment_dtype(p)
            st[k] = t.detach().to(dev, dtype, copy=True).reshape(lp.shape).contiguous()
        if "rounding_seed" in saved:
            st["rounding_seed"] = _seed(saved["rounding_seed"], pid)

    def _complete_group_keys(self) -> None:
        """Groups saved by torch carry their own keys; this optimizer's need amsgrad and maximize
        (defaulted) and TORCH_GROUP_KEYS (set: it always runs its own fused-equivalent kernel)."""
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            for k, v in TORCH_GROUP_KEYS.items():
                group[k] = v


def _live_params_by_saved_id(saved_groups, live_groups) -> dict:
    """The saved state's param ids -> this optimizer's params, matched group by group and
    position by position (torch's rule)."""
    id_map = {}
    for g, ng in zip(saved_groups, live_groups):
        for pid, p in zip(g["params"], ng["params"]):
            id_map[pid] = p
    return id_map


def _check_sizes_and_seeds(saved_state: dict, id_map: dict) -> None:
    """Raises before anything is loaded: a state tensor of a matched param whose element count
    is not the local param's (an fp32 param's master_param is ignored: it is its own master),
    or a rounding_seed that is not an int in [0, 2^63). States of unmatched ids are not checked."""
    for pid, st in saved_state.items():
        p = id_map.get(pid)
        if p is None:
            continue
        for k in STATE_TENSORS:
            _check_state_size(pid, k, local_shard(st.get(k)), local_shard(p))
        if "rounding_seed" in st:
            _seed(st["rounding_seed"], pid)


def _check_state_size(pid, k: str, t, lp: torch.Tensor) -> None:
    """Saved state tensor t ('k' of state pid; None or a non-tensor is not checked) must have
    the local param lp's element count, but for an fp32 param's master_param."""
    if torch.is_tensor(t) and t.numel() != lp.numel() and not (k == "master_param" and lp.dtype == torch.float32):
        raise RuntimeError(
            f"moepeak.StreamAdamW.load_state_dict: size mismatch for state {pid} ('{k}'): "
            f"{t.numel()} elements (shape {tuple(t.shape)}) but the param has {lp.numel()} "
            f"(shape {tuple(lp.shape)})")


def _seed(value, pid) -> int:
    """A saved rounding_seed as an int in [0, 2^63) (an integer 0-d tensor is accepted)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise TypeError(f"moepeak.StreamAdamW.load_state_dict: state {pid} 'rounding_seed' must be an int in "
                        f"[0, 2^63), got {value!r}")
    return value
