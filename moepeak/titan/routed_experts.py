"""moepeak.titan.experts's component: torchtitan's RoutedExperts with dispatch + experts +
combine replaced by moepeak.llep_moe (PipelinedLLEP), expert parallel over the job's "ep"
mesh dimension (the contract and the weight layout: moepeak.titan's docstring)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

from ..llep import LLEPOptions, llep_moe


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (as torchtitan's GroupedExperts does), else t."""
    return t.to_local() if hasattr(t, "to_local") else t


class LLEPRoutedExperts(RoutedExperts):
    """torchtitan's RoutedExperts with dispatch + experts + combine replaced by
    moepeak.llep_moe. inner_experts (GroupedExperts) keeps the weights; the
    token dispatcher is built (no parameters) but not used."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        """llep_moe's options (moepeak.llep.LLEPOptions: fields, defaults and checks)."""
        chunk_rows: Optional[int] = LLEPOptions.chunk_rows
        """Rows per destination per chunk (None: llep_moe's default)."""
        alpha: float = LLEPOptions.alpha
        min_tokens_per_gemm: int = LLEPOptions.min_tokens_per_gemm
        imbalance_threshold: float = LLEPOptions.imbalance_threshold
        save_budget_mb: Optional[int] = LLEPOptions.save_budget_mb
        """Activation cache per MoE layer (MiB; None: llep_moe's default)."""
        grouped_mm: str = LLEPOptions.grouped_mm

    def __init__(self, config: Config):
        super().__init__(config)
        if type(self.inner_experts) is not GroupedExperts:
            raise ValueError(f"moepeak.titan.experts: inner_experts must be torchtitan's SwiGLU GroupedExperts, "
                             f"got {type(self.inner_experts).__name__}")
        self.llep_options = LLEPOptions(**{name: getattr(config, name) for name in LLEPOptions.names()})
        self.ep_group = None

    def parallelize(self, parallel_dims) -> None:
        if getattr(parallel_dims, "tp_enabled", False) or getattr(parallel_dims, "etp_enabled", False):
            raise NotImplementedError("moepeak.titan.experts: tensor parallelism of the experts (tp/etp > 1) is "
                                      "not supported; PipelinedLLEP splits whole experts over the 'ep' dimension")
        super().parallelize(parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        self.ep_group = ep_mesh.get_group() if ep_mesh is not None and ep_mesh.size() > 1 else None

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        del num_local_tokens_per_expert_E  # llep_moe plans from the ids themselves
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        dtype = x_BLD.dtype
        ie = self.inner_experts
        w1, w2, w3 = (_local(w).to(dtype) for w in (ie.w1_EFD, ie.w2_EDF, ie.w3_EFD))
        w_gate_up = (w1.transpose(1, 2), w3.transpose(1, 2))  # gate and up [E_local, D, F]: views, no copy
        w_down = w2.transpose(1, 2)  # [E_local, F, D]: a view
        y = llep_moe(x_BLD.reshape(B * L, D), topk_expert_ids_BLK.reshape(B * L, K),
                     topk_scores_BLK.reshape(B * L, K), w_gate_up, w_down, group=self.ep_group,
                     options=self.llep_options)
        return y.view(B, L, D)
