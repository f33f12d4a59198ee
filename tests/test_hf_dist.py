"""moepeak.hf.apply_moepeak(group=...) on two gloo ranks against one rank.

Every rank builds the same tiny Qwen3-MoE model (one seed) and an unpatched
copy (eager experts). Rank r keeps experts [r*E/2, (r+1)*E/2) of each layer
and trains on sequence r of the batch; the unpatched copy runs both sequences
one at a time, as one rank would. Each rank's loss equals the reference's on
its sequence; its expert slices' gradients equal the reference's gradient of
the summed loss on that slice (PipelinedLLEP brings every token's share
home); the other parameters' gradients, summed over the ranks, equal the
reference's."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

try:
    from tests.dist_utils import run_ranks
except ImportError:  # rootdir not on sys.path
    from dist_utils import run_ranks

V, T = 97, 12


def _model():
    import transformers
    cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                      intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                      num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".gate.weight" in name:
                p.normal_(0, 1.0)
    return model


def _two_ranks(rank, world):
    import torch.distributed as dist
    from moepeak.hf import apply_moepeak

    model = _model()
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (world, T), generator=g)
    ref_losses = [ref(input_ids=ids[r:r + 1], labels=ids[r:r + 1]).loss for r in range(world)]
    torch.stack(ref_losses).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    report = apply_moepeak(model, group=dist.group.WORLD, chunk_rows=16)
    assert len(report.experts_on_moepeak) == 2 and "split over 2 ranks" in str(report), str(report)
    E = model.config.num_experts
    El = E // world
    model.train()
    out = model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1])
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_losses[rank].detach(), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    for n, p in model.named_parameters():
        want = ref_grads[n]
        if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj"):
            assert p.shape[0] == El, (n, p.shape)
            want = want[rank * El:(rank + 1) * El]
            got = p.grad
        else:
            got = p.grad.clone()
            dist.all_reduce(got)
        err = (got - want).abs().max().item()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), f"rank {rank} {n}: max diff {err:.3g}"


def test_two_gloo_ranks_equal_one_rank():
    run_ranks(2, _two_ranks, timeout=300)
