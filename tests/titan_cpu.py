"""torchtitan's own trainer (torchtitan.train) on CPU, for the tests.

Run as a script under torchrun, this file is torchtitan's entry point
(torchtitan.train.main, reading the same command line) after these patches:

  use_cpu()        torchtitan 0.3 picks its device as
                   `torch._utils._get_available_device_type() or "cuda"` at import
                   (torchtitan.tools.utils) and copies it into several modules, so
                   on a CPU-only torch every trainer step targets "cuda". This
                   points those module globals at "cpu" and at a device module
                   that answers the few queries the trainer makes (set_device,
                   current_device, memory statistics for its log line).
  sum_only_fsdp_reductions()
                   torchtitan turns FSDP2's gradient division off
                   (set_gradient_divide_factor(1.0): the loss is already divided by
                   the global token count), and FSDP2 then reduce-scatters with
                   ReduceOp.PREMUL_SUM(1.0), which NCCL has and gloo does not. Each
                   FSDP module is also set to plain-sum reductions
                   (set_force_sum_reduction_for_comms, the switch torchtitan's own
                   enable_fsdp_symm_mem flips): the same sums, scaled by 1.0.
  moepeak.titan.compat.provide_missing_torch_names()
                   torchtitan 0.3.0 (built against a torch nightly) uses two
                   names torch 2.11 / 2.13 lack (fsdp.DataParallelMeshDims,
                   distributed.set_timeout); they are provided where missing,
                   before torchtitan is imported. Not CPU-specific.
  record_metrics() every logged step's global loss and gradient norm are appended
                   in full precision to $MOEPEAK_TITAN_METRICS (rank 0); the
                   console shows five decimals.

The job is a config_registry function of this module, run with
`--module tests.titan_cpu --config qwen3_moe_cpu` (torchtitan imports a
module given by its full path): torchtitan's qwen3_moe_debug cut to a size
a 2-core CPU trains in seconds. write_assets() makes the tokenizer and the
text dataset it reads, in the layout of torchtitan's tests/assets (which its
wheel does not ship). fp32_experts is a test-only override: the stock
GroupedExperts computed in fp32 (a plain loop over experts) instead of bf16
grouped GEMMs, the reference the tolerance rule measures both jobs against.
tests/test_titan_cli.py has the command lines.

torch 2.13 note: FSDP under torchtitan's default spmd_backend "spmd_types"
fails in fully_shard ("all parameters must be DTensors on the full SPMD
mesh"), so multi-rank runs pass --parallelism.spmd_backend partial_dtensor.
"""
from __future__ import annotations

import functools
import json
import os
import random
import sys
import types

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `tests.titan_cpu` and moepeak importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataclasses import dataclass  # noqa: E402

from moepeak.titan.compat import provide_missing_torch_names  # noqa: E402

provide_missing_torch_names()  # before torchtitan's first import

from torchtitan.config import derive, override  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

# Job shape: 2 layers, 8 routed experts of hidden size 64, top-2; sequences of 64 tokens.
N_LAYERS, N_EXPERTS, TOP_K, EXPERT_HIDDEN = 2, 8, 2, 64
SEQ_LEN, LOCAL_BATCH = 64, 2
WORDS = 400  # tokenizer vocabulary (plus 3 special tokens), inside the model's 2048


def _cpu_device_module() -> types.SimpleNamespace:
    """Stands in for torch.cuda on CPU: answers the queries torchtitan's trainer makes."""
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        synchronize=torch.cpu.synchronize,
        is_available=lambda: True,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=total_memory),
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
    )


def use_cpu() -> None:
    """Point torchtitan's device globals (in every torchtitan module already
    imported, and in torchtitan.tools.utils for those imported later) at CPU."""
    import torchtitan.tools.utils  # noqa: F401
    cpu = _cpu_device_module()
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu


def sum_only_fsdp_reductions() -> None:
    """FSDP2 reductions as plain sums wherever torchtitan sets a divide factor (gloo has no PREMUL_SUM)."""
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule
    disable_division = titan_fsdp.disable_fsdp_gradient_division

    @functools.wraps(disable_division)
    def disable_division_sum_only(model):
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_division_sum_only


def record_metrics(path: str) -> None:
    """Append {"step", "loss", "grad_norm"} per logged step to `path` (rank 0)."""
    from torchtitan.components.metrics import MetricsProcessor
    log = MetricsProcessor.log

    @functools.wraps(log)
    def log_and_record(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "loss": global_avg_loss, "grad_norm": grad_norm}) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    MetricsProcessor.log = log_and_record


def qwen3_moe_cpu():
    """torchtitan's qwen3_moe_debug job at CPU test size (a config_registry function).

    moepeak.titan.qwen3_moe_config keeps N_LAYERS blocks of N_EXPERTS experts,
    SDPA attention (torch's FlexAttention has no CPU backward) and full AC.
    Parameters and reductions stay fp32 under FSDP2 so that the only low
    precision in the stock job is its bf16 expert GEMMs; CUDA graphs are off;
    the seed is fixed, so every run starts from the same weights."""
    import moepeak.titan as mt
    cfg = mt.qwen3_moe_config(N_LAYERS, N_EXPERTS, TOP_K, EXPERT_HIDDEN)
    cfg.training.seq_len = SEQ_LEN
    cfg.training.local_batch_size = LOCAL_BATCH
    cfg.training.steps = 3
    cfg.training.disable_cuda_graphs = True
    cfg.training.mixed_precision_param = "float32"
    cfg.training.mixed_precision_reduce = "float32"
    cfg.metrics.log_freq = 1
    cfg.debug.seed = 0  # every run starts from the same weights
    return cfg


class FP32GroupedExperts(GroupedExperts):
    """GroupedExperts computed in fp32 by a loop over the local experts."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        out, start = [], 0
        for e, n in enumerate(num_tokens_per_expert_E.tolist()):
            x = x_RD[start:start + n].float()
            h = F.silu(x @ w1[e].float().T) * (x @ w3[e].float().T)
            out.append(h @ w2[e].float().T)
            start += n
        return torch.cat(out).type_as(x_RD)


@override(target=GroupedExperts.Config, exact=True, description="test reference: stock experts in fp32")
def fp32_experts(cfg: GroupedExperts.Config) -> FP32GroupedExperts.Config:
    return derive(cfg, FP32GroupedExperts.Config)


def write_assets(root: str, n_docs: int = 96, seed: int = 0) -> str:
    """root/tokenizer (tokenizer.json + tokenizer_config.json) and root/c4_test/data.json
    (jsonl, field "text"): n_docs documents of 20..90 words drawn from WORDS words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    special = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    words = [f"w{i}" for i in range(WORDS)]
    vocab = {tok: i for i, tok in enumerate(special + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special)
    os.makedirs(os.path.join(root, "tokenizer"), exist_ok=True)
    tok.save(os.path.join(root, "tokenizer", "tokenizer.json"))
    with open(os.path.join(root, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": special[1], "eos_token": special[2], "add_bos_token": False,
                   "add_eos_token": False}, f)
    rng = random.Random(seed)
    os.makedirs(os.path.join(root, "c4_test"), exist_ok=True)
    with open(os.path.join(root, "c4_test", "data.json"), "w") as f:
        for _ in range(n_docs):
            # a skewed word distribution, so the model has something to learn
            text = " ".join(words[min(int(rng.expovariate(0.05)), WORDS - 1)] for _ in range(rng.randint(20, 90)))
            f.write(json.dumps({"text": text}) + "\n")
    return root


def main() -> None:
    use_cpu()
    sum_only_fsdp_reductions()
    if os.environ.get("MOEPEAK_TITAN_METRICS"):
        record_metrics(os.environ["MOEPEAK_TITAN_METRICS"])
    from torchtitan.train import main as torchtitan_main
    torchtitan_main()


if __name__ == "__main__":
    main()
