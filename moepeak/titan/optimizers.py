"""moepeak.titan.stream_adamw's component: torchtitan's optimizer container with every AdamW
param group on moepeak.StreamAdamW, its state dict interchangeable with the stock AdamW
container's (the contract: moepeak.titan's docstring)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchtitan.components.optimizer import OptimizersContainer

from ..stream_adamw import StreamAdamW, StreamAdamWOptions
from .autoplace import STREAM_ADAMW_MARK

_TORCH_IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


class StreamAdamWOptimizers(OptimizersContainer):
    """torchtitan's optimizer container with every AdamW param group on
    moepeak.StreamAdamW (same hyperparameters, same state-dict keys)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        bucket_mb: float = StreamAdamWOptions.bucket_mb
        threads: Optional[int] = None
        device_state_mb: float = 0
        """GPU memory (MiB per model part and rank) for the optimizer state of the leading
        parameters in the model's order, whose gradients are final last in backward
        (StreamAdamW.backward_tail): updated on the GPU, not on the host after backward."""

    def __init__(self, config: Config, *, model_parts):
        if config.implementation == "fused_opt_states_bf16":
            raise ValueError("moepeak.titan.stream_adamw keeps fp32 optimizer state in host RAM; "
                             "implementation='fused_opt_states_bf16' does not apply")
        budget = config.device_state_mb
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
            raise ValueError(f"moepeak.titan.stream_adamw: device_state_mb must be a number >= 0, got {budget!r}")
        self._device_state_bytes = int(budget * (1 << 20))
        self._stream_kwargs = dict(bucket_mb=config.bucket_mb, threads=config.threads)
        # Group keys torch.optim.AdamW has and StreamAdamW lacks, with the values
        # the stock container would give them: written into state_dict() so a
        # stock job finds every key it expects when it loads our checkpoint.
        self._adamw_group_keys = dict(fused=config.implementation == "fused",
                                      foreach=config.implementation == "foreach", capturable=False,
                                      differentiable=False, decoupled_weight_decay=True)
        super().__init__(config, model_parts=model_parts)
        for part in model_parts:  # read by moepeak.titan.sco's automatic placement: the state's device tail
            setattr(part, STREAM_ADAMW_MARK, self._device_state_bytes)

    def state_dict(self) -> dict:
        """torchtitan's flat FQN-keyed layout, interchangeable with the stock
        AdamW container's (same state keys, same param_group keys)."""
        sd = super().state_dict()
        for key in [k for k in sd if k.startswith("param_groups.") and k.endswith(".lr")]:
            prefix = key[:-len("lr")]
            for name, value in self._adamw_group_keys.items():
                sd.setdefault(prefix + name, value)
        return sd

    def _build_impl_kwargs(self, config) -> dict:
        return {}  # StreamAdamW has one implementation

    def _resolve_optimizer_factory(self, name: str):
        if name != "AdamW":
            raise NotImplementedError(f"moepeak.titan.stream_adamw replaces AdamW param groups; got optimizer {name!r}")
        stream_kwargs, container = self._stream_kwargs, self

        def build(param_groups, **factory_kwargs):
            groups = [{k: v for k, v in g.items() if k not in _TORCH_IMPL_KEYS} for g in param_groups]
            device_state = None
            if container._device_state_bytes:
                mine = {id(p) for g in groups for p in g["params"]}
                ordered = [p for m in container.model_parts for p in m.parameters() if id(p) in mine]
                device_state = StreamAdamW.backward_tail(ordered, container._device_state_bytes)
            return StreamAdamW(groups, device_state=device_state, **stream_kwargs, **factory_kwargs)

        return build
