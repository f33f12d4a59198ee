"""moepeak.hf.apply_moepeak(group=...) on two gloo ranks against one process.

Every rank builds the same tiny Qwen3-MoE model (one seed) and an unpatched copy (eager
experts). Rank r keeps experts [r*E/2, (r+1)*E/2) of each layer and trains on sequence r
of the batch (both with as many target tokens). The documented recipes give every
parameter (expert slices and the rest) the gradient of the mean of the ranks' losses,
which is one process's gradient:
- without the router aux loss, one process's on the whole batch (the two sequences in one
  forward), with average_gradients(model) averaging the replicated parameters (Qwen3-MoE,
  and GPT-OSS, whose expert biases are sliced too);
- with the aux loss (a per-batch statistic, so a per-rank one under any data parallelism),
  one process's on the two sequences as two micro-batches of loss / 2, with the model
  wrapped in DistributedDataParallel; clip_grad_norm_ then clips as torch's
  clip_grad_norm_ does on that one process."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

try:
    from tests.dist_utils import run_ranks
except ImportError:  # rootdir not on sys.path
    from dist_utils import run_ranks

V, T = 97, 12
RTOL, ATOL = 1e-4, 1e-6  # fp32: the same sums in another order


def _model(aux, family="qwen3_moe"):
    import transformers
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=64, output_router_logits=aux, router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    if family == "gpt_oss":  # interleaved, biased, clamped experts: llep_moe's "gpt_oss" activation
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"]))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2))
    with torch.no_grad():  # transformers' zero router init ties every route
        for name, p in model.named_parameters():
            if ".gate.weight" in name or ".router.weight" in name:
                p.normal_(0, 1.0)
    return model


def _batch(world):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (world, T), generator=g)
    labels = ids.clone()
    labels[:, 2:4] = -100  # ignored positions, as many on every rank
    return ids, labels


def _assert_grads_equal(rank, world, model, ref_grads, what):
    from moepeak.hf import expert_slices
    from moepeak.hf.expert_parallel import EXPERT_PARAMS

    slices = expert_slices(model)
    endings = tuple(f"experts.{p}" for p in EXPERT_PARAMS)
    assert sorted(slices) == sorted(n for n in ref_grads if n.endswith(endings)), sorted(slices)
    for n, p in model.named_parameters():
        want = ref_grads[n]
        if n in slices:
            El = want.shape[0] // world
            want = want[rank * El:(rank + 1) * El]
            assert p.shape == want.shape, (n, p.shape)
        err = (p.grad - want).abs().max().item()
        assert torch.allclose(p.grad, want, rtol=RTOL, atol=ATOL), \
            f"{what}: rank {rank} {n}: max diff {err:.3g} (ratio {(p.grad.norm() / want.norm()).item():.4f})"


def _whole_batch_average_gradients(rank, world, family="qwen3_moe"):
    """No aux loss: one process on the whole batch; average_gradients for the replicated."""
    import torch.distributed as dist
    from moepeak.hf import apply_moepeak, average_gradients

    model = _model(aux=False, family=family)
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    ids, labels = _batch(world)
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    report = apply_moepeak(model, group=dist.group.WORLD, chunk_rows=16)
    assert len(report.experts_on_moepeak) == 2 and "split over 2 ranks" in str(report), str(report)
    model.train()
    out = model(input_ids=ids[rank:rank + 1], labels=labels[rank:rank + 1])
    assert out.logits is None
    out.loss.backward()
    average_gradients(model)
    mean_loss = out.loss.detach().clone()
    dist.all_reduce(mean_loss)
    torch.testing.assert_close(mean_loss / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads_equal(rank, world, model, ref_grads, f"{family}, whole batch, average_gradients")


def _aux_loss_ddp_and_clipping(rank, world):
    """Aux loss on: one process on the ranks' batches as micro-batches of loss / P; DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from moepeak.hf import apply_moepeak, clip_grad_norm_

    model = _model(aux=True)
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    ids, labels = _batch(world)
    ref_losses = [ref(input_ids=ids[r:r + 1], labels=labels[r:r + 1]).loss for r in range(world)]
    (torch.stack(ref_losses).sum() / world).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    apply_moepeak(model, group=dist.group.WORLD, chunk_rows=16)
    ddp = DistributedDataParallel(model)
    model.train()
    out = ddp(input_ids=ids[rank:rank + 1], labels=labels[rank:rank + 1])
    torch.testing.assert_close(out.loss.detach(), ref_losses[rank].detach(), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    _assert_grads_equal(rank, world, model, ref_grads, "aux loss, DDP")

    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))  # measures only
    max_norm = 0.5 * ref_norm.item()  # the clipping bites
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    total = clip_grad_norm_(model, max_norm)
    torch.testing.assert_close(total, ref_total.float(), rtol=1e-5, atol=0)
    _assert_grads_equal(rank, world, model, {n: p.grad for n, p in ref.named_parameters()}, "clipped")


def _all_cases(rank, world):
    _whole_batch_average_gradients(rank, world)
    _whole_batch_average_gradients(rank, world, "gpt_oss")  # the biases are slices too
    _aux_loss_ddp_and_clipping(rank, world)


def test_two_gloo_ranks_gradients_are_one_process_mean_loss():
    run_ranks(2, _all_cases, timeout=300)
