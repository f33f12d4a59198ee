"""moepeak.titan over 2 gloo ranks (CPU), each against the same job in one process.

Expert parallelism: torchtitan's qwen3 MoE debug job (tests/test_titan.py's
small_job) with the experts override, sharding configs set the way torchtitan's
trainer sets them (set_qwen3_sharding_config, enable_ep) and parallelized by
Module.parallelize over a ParallelDims(dp_shard=2, ep=2) mesh: the expert
weights become DTensors Shard(0) on the "ep" mesh and PipelinedLLEP dispatches
over its group. Rank r trains on sequence r; the reference is one process
running both sequences with the same weights (experts override, no EP).
Everything is fp32 on both sides, so the comparison is fp32 rounding only.

The sharded head: an lm_head sharded by FSDP2 (fully_shard, weight DTensor
Shard(0) on a 1-D mesh) runs RingDTPLoss's vocab-sharded ring; loss, dX and
the dW shard equal plain cross-entropy on the whole head (dW summed over both
ranks' tokens).

torchtitan's device mesh type comes from torchtitan.tools.utils.device_type,
which is "cuda" on a machine without an accelerator; the ranks set it to "cpu".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from tests.titan_utils import require_torchtitan
except ImportError:  # rootdir not on sys.path
    from titan_utils import require_torchtitan

require_torchtitan()

try:
    from tests.dist_utils import run_ranks
except ImportError:  # rootdir not on sys.path
    from dist_utils import run_ranks

WORLD = 2
TOL = dict(rtol=1e-4, atol=1e-6)


def _sequences():
    from tests.test_titan import L, V
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (WORLD, L), generator=g), torch.randint(0, V, (WORLD, L), generator=g)


def _build(parallel_dims=None):
    """The experts-override job's model; with parallel_dims, sharded for EP."""
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    from tests.test_titan import small_job
    cfg = small_job()
    apply_overrides(OverrideConfig(imports=["moepeak.titan.experts"]), cfg)
    if parallel_dims is not None:
        set_qwen3_sharding_config(cfg.model_spec.model, enable_sp=False, enable_ep=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    if parallel_dims is not None:
        model.parallelize(parallel_dims)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _loss(model, tokens, labels):
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, positions=pos)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def _ep_rank(rank, world):
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.distributed.parallel_dims import ParallelDims

    parallel_dims_module.device_type = "cpu"
    pd = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world,
                      spmd_backend="partial_dtensor")
    pd.build_mesh()
    model = _build(pd)
    experts = model.layers["0"].moe.routed_experts
    assert experts.ep_group is not None
    w1 = experts.inner_experts.w1_EFD
    assert isinstance(w1, DTensor) and tuple(w1.placements) == (Shard(0),)
    assert w1.device_mesh.mesh_dim_names == ("ep",)

    # the reference: the same weights, one process, both sequences
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    ref = _build()
    ref.load_state_dict(full)
    tokens, labels = _sequences()
    ref_loss = _loss(ref, tokens, labels)
    ref_loss.backward()
    ref_seq_loss = [_loss(ref, tokens[r:r + 1], labels[r:r + 1]).detach() for r in range(world)]

    loss = _loss(model, tokens[rank:rank + 1], labels[rank:rank + 1])
    torch.testing.assert_close(loss.detach(), ref_seq_loss[rank], **TOL)
    loss.backward()
    ref_grads = dict(ref.named_parameters())
    n_expert, n_dense = 0, 0
    for name, p in model.named_parameters():
        want = ref_grads[name].grad
        if isinstance(p.grad, DTensor) and tuple(p.grad.placements) == (Shard(0),):
            rows = want.shape[0] // world  # this rank's experts; their grads hold both ranks' tokens
            got, want = p.grad.to_local(), want[rank * rows:(rank + 1) * rows]
            n_expert += 1
        else:  # replicated: this rank's sequence only, summed over ranks as data parallelism would
            got = (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            dist.all_reduce(got)
            n_dense += 1
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item(),
                                   msg=lambda m: f"rank {rank} grad {name}: {m}")
    assert n_expert == 2 * 3 and n_dense > 0  # w1, w2, w3 of 2 layers


def test_expert_parallel_equals_single_process():
    run_ranks(WORLD, _ep_rank, timeout=150)


def _ring_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.loss import CrossEntropyLoss
    import moepeak.titan as mt

    V, D, T = 96, 16, 24
    g = torch.Generator().manual_seed(3)
    w_full = torch.randn(V, D, generator=g) * 0.3
    xs = torch.randn(world, 1, T, D, generator=g)
    ys = torch.randint(0, V, (world, 1, T), generator=g)
    ys[0, 0, :3] = -100  # ignored positions
    valid = torch.tensor(float((ys != -100).sum()))

    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(w_full)
    fully_shard(head, mesh=init_device_mesh("cpu", (world,)))
    loss_fn = mt.RingDTPLoss.Config(loss_fn=CrossEntropyLoss.Config(), ring="weights").build()
    loss_fn.set_lm_head(head)
    _, _, group = loss_fn.head_weight()
    assert group is not None

    x = xs[rank].clone().requires_grad_()
    loss, _ = loss_fn(x, ys[rank], valid)
    loss.backward()

    xr = xs.clone().requires_grad_()
    wr = w_full.clone().requires_grad_()
    per_rank = [F.cross_entropy((xr[r] @ wr.T).flatten(0, 1), ys[r].flatten(), reduction="sum") / valid
                for r in range(world)]
    sum(per_rank).backward()
    rows = V // world
    torch.testing.assert_close(loss.detach(), per_rank[rank].detach(), **TOL)
    torch.testing.assert_close(x.grad, xr.grad[rank], **TOL)
    torch.testing.assert_close(head.weight.grad.to_local(), wr.grad[rank * rows:(rank + 1) * rows], **TOL)


def test_fsdp_sharded_head_ring_equals_whole_head():
    run_ranks(WORLD, _ring_rank, timeout=120)
