"""apply_moepeak's automatic placement under several ranks (moepeak.plan.integration's rule) on
two gloo ranks, with each rank's machine stood in for by its own numbers (autoplace.measure
monkeypatched in the rank): under expert parallelism each rank's keep_last and arena are what
moepeak.plan.place says for that rank's share (half the experts, its own tokens, half the
host's RAM) and the placed step's loss and gradients are the unplaced step's; a step that
fits only in tiles raises TilesNeeded naming tile_tokens before it allocates anything (under
expert and under sequence parallelism); without LOCAL_WORLD_SIZE every rank is assumed on
this host and the note says so."""
import os

import pytest
import torch

pytest.importorskip("transformers")

try:
    from tests.autoplace_helpers import tiles_only_gpu
    from tests.dist_utils import run_ranks
except ImportError:  # rootdir not on sys.path
    from autoplace_helpers import tiles_only_gpu
    from dist_utils import run_ranks

V, T, LAYERS = 97, 12, 4
G = 2 ** 30


def _model():
    import transformers
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=64, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2))
    with torch.no_grad():  # transformers' zero router init ties every route
        for name, p in model.named_parameters():
            if ".gate.weight" in name:
                p.normal_(0, 1.0)
    return model


def _expert_share(world, **fields):
    """The Setup of one rank of `world` under expert parallelism alone, written out: the experts
    over the world, the other weights whole (ddp), one rank per sequence."""
    from moepeak import plan as P
    return P.Setup(gpus=world, impl="hf", act_bytes=4, sp="ring", sp_size=1, shard="ddp", ep_size=world, **fields)


def _host_for_keep(m, s, tokens, per_host, keep_more, keep_fewer):
    """Host bytes (before the margin) whose per-rank share holds the step with keep_more blocks'
    inputs on the GPU but not with keep_fewer."""
    import dataclasses

    from moepeak import plan as P
    lo = P.host_bytes(m, dataclasses.replace(s, sco_keep_last=keep_more), tokens, sized_arena=True)["total"]
    hi = P.host_bytes(m, dataclasses.replace(s, sco_keep_last=keep_fewer), tokens, sized_arena=True)["total"]
    M = P.Margins()
    return ((lo + hi) / 2 * per_host + M.host_bytes) / (1 - M.host_fraction)


def _step_both(model, ref, rank, tokens, device):
    """One training step of the placed model and of the unplaced one on this rank's tokens (the
    replicated gradients averaged over the group); {"placed": loss, "unplaced": loss}."""
    from moepeak.hf import average_gradients
    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, V, (1, tokens), generator=g).to(device)
    losses = {}
    for name, m in (("placed", model), ("unplaced", ref)):
        m.train()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        average_gradients(m)
        losses[name] = loss.detach()
    return losses


def _expert_parallel_ranks(rank, world):
    import torch.distributed as dist

    from moepeak import plan as P
    from moepeak.hf import apply_moepeak, autoplace, place_model
    from moepeak.sco import sizes as SCO

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    model, ref = _model(), _model()
    full_count = sum(p.numel() for p in model.parameters())
    report = apply_moepeak(model, group=dist.group.WORLD, chunk_rows=16)
    apply_moepeak(ref, group=dist.group.WORLD, chunk_rows=16, auto_placement=False)
    m = autoplace.model_shape(model, world)
    assert m.params() == full_count  # the expert slices counted on every rank of the group
    s = _expert_share(world)
    # rank 0's host share holds the step only with 3 blocks' inputs kept on the GPU; rank 1's has room
    host = _host_for_keep(m, s, T, world, 3, 2) if rank == 0 else 500 * G
    autoplace.measure = lambda target: (100 * G, host)
    losses = _step_both(model, ref, rank, T, torch.device("cpu"))
    p = report.placement.placement
    expect = P.place(m, s, T, gpu_bytes=100 * G, host_bytes=host, ranks_per_host=world)
    assert p.keep_last == expect.keep_last == (3 if rank == 0 else SCO.KEEP_LAST), (rank, p.keep_last)
    assert report.sco.config.keep_last == p.keep_last
    assert report.sco.config.arena_bytes == expect.sco_options()["arena_bytes"]
    # the rank's share of the optimizer state: the non-expert weights whole, half the experts
    experts = sum(q.numel() for n, q in ref.named_parameters() if ".experts." in n)  # this rank's half
    local = full_count - world * experts + experts
    assert p.tiers["optimizer_state"]["host"] == 12 * local  # fp32 params: 8 B of moments + 4 of master
    assert "one rank of 2, 2 on this host: LOCAL_WORLD_SIZE" in report.placement.note
    assert torch.equal(losses["placed"], losses["unplaced"]), (rank, losses)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), (rank, n)

    # a longer step that fits only in tiles: refused before it allocates, the tile named
    gpu, tile = tiles_only_gpu(m, s, 1 << 15)
    autoplace.measure = lambda target: (gpu, 500 * G)
    longer = _model()
    report = apply_moepeak(longer, group=dist.group.WORLD, chunk_rows=16)
    longer.train()
    want = (rf"the plan wants tiles of {tile} tokens, a choice the 2 ranks must share .* give "
            rf"apply_moepeak\(\.\.\., tile_tokens={tile}\) on every rank")
    with pytest.raises(P.TilesNeeded, match=want):
        longer(input_ids=torch.zeros(1, 1 << 15, dtype=torch.long), labels=torch.zeros(1, 1 << 15, dtype=torch.long))
    assert report.sco.stats()["offloads"] == 0 and report.placement.placement is None
    # given, the tiling is the ranks' own choice and the plan keeps it
    given = _model()
    apply_moepeak(given, group=dist.group.WORLD, chunk_rows=16, tile_tokens=tile)
    assert place_model(given, 1 << 15).tile_tokens == tile


def _sequence_parallel_ranks(rank, world):
    import torch.distributed as dist

    from moepeak import plan as P
    from moepeak.hf import apply_moepeak, autoplace, place_model

    os.environ.pop("LOCAL_WORLD_SIZE", None)
    model = _model()
    apply_moepeak(model, sequence_group=dist.group.WORLD)
    m = autoplace.model_shape(model)
    s = P.Setup(gpus=world, impl="hf", act_bytes=4, sp="ring", sp_size=world, shard="ddp", ep_size=1)
    autoplace.measure = lambda target: (100 * G, 500 * G)
    p = place_model(model, T)  # this rank's T tokens of a sequence of world x T
    expect = P.place(m, s, world * T, gpu_bytes=100 * G, host_bytes=500 * G, ranks_per_host=world)
    assert (p.context, p.tokens, p.keep_last) == (world * T, T, expect.keep_last)
    assert p.used == expect.used
    assert "one rank of 2, 2 on this host: assumed: LOCAL_WORLD_SIZE is not set" in model._moepeak_placement.note
    gpu, tile = tiles_only_gpu(m, s, world << 15, ranks_per_host=world)
    autoplace.measure = lambda target: (gpu, 500 * G)
    with pytest.raises(P.TilesNeeded) as e:
        place_model(model, 1 << 15)
    assert e.value.tile_tokens == tile and f"tile_tokens={tile}" in str(e.value)


def test_expert_parallel_ranks_place_their_own_share():
    run_ranks(2, _expert_parallel_ranks)


def test_sequence_parallel_ranks_place_their_share_and_refuse_tiles():
    run_ranks(2, _sequence_parallel_ranks)


def _cuda_ranks(rank, world):
    """Two GPUs, expert parallelism: each rank measures its own GPU and the host, places its
    share, and the placed step's loss and gradients equal the unplaced step's."""
    import torch.distributed as dist

    from moepeak.hf import apply_moepeak

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    device = torch.device("cuda", rank)
    model, ref = _model().to(device), _model().to(device)
    report = apply_moepeak(model, group=dist.group.WORLD, chunk_rows=16)
    apply_moepeak(ref, group=dist.group.WORLD, chunk_rows=16, auto_placement=False)
    losses = _step_both(model, ref, rank, 4096, device)
    p = report.placement.placement
    assert p is not None and report.sco.config.keep_last == p.keep_last, report.placement.note
    assert "(measured) (one rank of 2, 2 on this host: LOCAL_WORLD_SIZE)" in report.placement.note
    print(f"rank {rank}: {report.placement.note}", flush=True)
    # fp32 defaults: the GPU's atomics may sum in another order between two runs
    torch.testing.assert_close(losses["placed"], losses["unplaced"])
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m, n=n: f"rank {rank} {n}: {m}")


@pytest.mark.cuda
def test_cuda_expert_parallel_ranks_measure_and_place_their_share():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(2, _cuda_ranks, backend="nccl")
