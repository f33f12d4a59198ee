"""apply_moepeak under torch's context parallelism (the engine behind accelerate's cp_size), on
2 GPUs against one process running stock transformers on the whole sequence.

torch's context_parallel turns scaled_dot_product_attention into ring attention over the mesh
(flash, efficient and cuDNN kernels only: no CPU path, hence CUDA-only) and shards the buffers
head-tail (rank r holds chunks r and 2P-1-r of the sequence); accelerate puts a forward
pre-hook on every self_attn that drops the mask and sets is_causal=True
(_attach_context_parallel_hooks, applied here as accelerate applies it). The tiled layers keep
num_key_value_heads head groups (one ring pass each) and run that hook; the loss is the rank's
share of the sequence's, times P ("mean": the gradients are averaged over the ranks here, as
DDP or FSDP2 would). Two arms: experts local, and split over the context-parallel ranks
(PipelinedLLEP). fp32 without TF32: the loss and every gradient (slices gathered) within 1e-3
of the largest reference entry (the sums in another order on the GPU; the CPU tests of the same
code under DeepSpeed Ulysses hold 1e-4, tests/test_hf_sequence_parallel.py).
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

try:
    from tests.dist_utils import run_ranks
    from tests.hf_tiny import tiny_qwen3_moe
except ImportError:  # rootdir not on sys.path
    from dist_utils import run_ranks
    from hf_tiny import tiny_qwen3_moe

pytestmark = pytest.mark.cuda

V, T, TILE = 97, 256, 32
REL = 1e-3


def tiny_model():
    return tiny_qwen3_moe(V, 512)


def _gathered(t, group):
    import torch.distributed as dist
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, t.detach().cpu(), group=group)
    return torch.cat(parts)


def context_parallel_ranks(r, P):
    import torch.distributed as dist
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from moepeak.hf import apply_moepeak, expert_slices
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", r)
    mesh = init_device_mesh("cuda", (P,), mesh_dim_names=("cp",))
    cp = mesh.get_group()
    base = tiny_model().to(dev)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (1, T), generator=g)
    labels = ids.clone()
    labels[0, 5:11] = -100
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    ids, labels, shift, pos = ids.to(dev), labels.to(dev), shift.to(dev), torch.arange(T, device=dev)[None]

    ref = copy.deepcopy(base)
    ref_loss = ref(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().cpu() for n, p in ref.named_parameters()}

    failures = []
    for expert_group in (None, cp):
        model = copy.deepcopy(base)
        _attach_context_parallel_hooks(model)
        apply_moepeak(model, group=expert_group, sequence_group=cp, tile_tokens=TILE)
        buffers = [ids.clone(), pos.clone(), shift.clone()]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            local_ids, local_pos, local_shift = buffers  # this rank's head-tail shard of each
            out = model(input_ids=local_ids, position_ids=local_pos, labels=local_shift, shift_labels=local_shift,
                        use_cache=False)
            out.loss.backward()
        slices = {id(p) for p in expert_slices(model).values()}
        worst, at = 0.0, None
        for name, p in model.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if id(p) in slices:
                grad = _gathered(grad, cp)
            else:  # the "mean" convention: the engine averages the replicated gradients over the ranks
                grad = grad.clone()
                dist.all_reduce(grad, group=cp)
                grad = (grad / P).cpu()
            ref_grad = ref_grads[name]
            err = ((grad - ref_grad).abs().max() / ref_grad.abs().max().clamp_min(1e-30)).item()
            if err > worst:
                worst, at = err, name
        loss_err = abs(out.loss.item() - ref_loss.item()) / abs(ref_loss.item())
        tag = "experts split over the ranks" if expert_group is not None else "experts local"
        if worst > REL or loss_err > 1e-4:
            failures.append(f"{tag}: loss {out.loss.item():.7f} vs {ref_loss.item():.7f}; worst gradient relative "
                            f"error {worst:.2e} at {at}")
    assert not failures, "\n".join(failures)


def test_torch_context_parallel_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(2, context_parallel_ranks, timeout=300, backend="nccl")
