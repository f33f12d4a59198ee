"""Ring-DTP on gloo ranks: both ring variants and ring="gather" equal the single-device op.

Each rank r has its own tokens X_r (T_r differs per rank, one rank may have
ignored-only labels) and the dim-0 vocab shard W_r as FSDP2 cuts it
(ceil(V/P) rows, the last rank fewer: V % P != 0). Expected, per rank:
  loss_r, dX_r  == single-device linear_cross_entropy(X_r, W_full, y_r)
  dW_r          == rows of sum_j d loss_j / d W_full for this rank's shard
One spawn of 4 gloo ranks covers P = 2, 3 (subgroups) and 4, bad input, and
FSDP2 (fully_shard) with the module as lm_head.
"""
import pytest
import torch

from tests.dist_utils import run_ranks

V, H = 53, 12  # prime V: never divisible by P


def _data(P, dtype, v=V):
    g = torch.Generator().manual_seed(1234)
    w = (torch.randn(v, H, generator=g) * 0.4).to(dtype)
    xs, ys = [], []
    for r in range(P):
        T = 5 + 3 * r
        xs.append(torch.randn(T, H, generator=g).to(dtype))
        y = torch.randint(0, v, (T,), generator=g)
        y[1] = -100
        ys.append(y)
    return w, xs, ys


def _shard_rows(P, v=V):
    per = -(-v // P)
    return [(min(v, r * per), min(v, (r + 1) * per)) for r in range(P)]


def _rank_fn(rank, P, variants, dtype, opts, group, v=V):
    import moepeak

    w, xs, ys = _data(P, dtype, v)
    # single-device expectations
    dw_sum = torch.zeros(v, H, dtype=torch.float64)
    exp = None
    for j in range(P):
        xj = xs[j].clone().requires_grad_()
        wj = w.clone().requires_grad_()
        lj = moepeak.linear_cross_entropy(xj, wj, ys[j], mode="vocab_outer", **opts)
        lj.backward()
        dw_sum += wj.grad.double()
        if j == rank:
            exp = (lj.detach(), xj.grad)
    a, b = _shard_rows(P, v)[rank]
    for variant in variants:
        x = xs[rank].clone().requires_grad_()
        ws = w[a:b].clone().requires_grad_()
        loss = moepeak.linear_cross_entropy(x, ws, ys[rank], group=group, ring=variant,
                                            chunk_tokens=4, chunk_vocab=5, **opts)
        loss.backward()
        tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(loss, exp[0], **tol, msg=lambda m: f"{variant} loss rank {rank}: {m}")
        torch.testing.assert_close(x.grad, exp[1], **tol, msg=lambda m: f"{variant} dX rank {rank}: {m}")
        torch.testing.assert_close(ws.grad.double(), dw_sum[a:b], **tol,
                                   msg=lambda m: f"{variant} dW shard rank {rank}: {m}")


def _rank_fn_all(rank, world):
    """One spawn of 4 ranks runs P = 2, 3 (subgroups of ranks 0..P-1) and 4 (WORLD):
    spawning is the slow part on a small CI machine, and subgroups test that the
    ring uses ranks within the group."""
    import torch.distributed as dist

    opts = dict(label_smoothing=0.1, z_loss=1e-3, softcap=4.0, reduction="mean")
    for P in (2, 3, 4):
        group = dist.new_group(list(range(P))) if P < world else dist.group.WORLD  # collective on all ranks
        if rank < P:
            _rank_fn(rank, P, ("weights", "activations", "auto", "gather"), torch.float32, opts, group)
            if P == 2:
                _rank_fn(rank, P, ("weights", "activations", "gather"), torch.float32, dict(reduction="sum"),
                         group)
                _bad_fn(rank, P, group)
                _transport_fn(rank, P, group)
        dist.barrier()
    # V = 5 over 4 ranks: FSDP2's ceil split gives shards of 2, 2, 1 and 0 rows; the rank with
    # none takes part like the others (it used to raise alone and leave the others waiting)
    _rank_fn(rank, world, ("weights", "activations", "gather"), torch.float32, opts, dist.group.WORLD, v=5)
    for ring in ("weights", "gather"):
        _dtensor_lm_fn(rank, world, ring)


def _dtensor_lm_fn(rank, P, ring):
    """FSDP2: a tiny LM under fully_shard whose lm_head is RingDTPLinearCrossEntropy
    (weight sharded dim-0, left to the op via ignored_params; `ring` a ring variant or
    "gather") trains like the
    unsharded model with lm_head + F.cross_entropy (3 SGD steps, same data on
    every rank, so FSDP's gradient average equals the one-process gradient)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import moepeak

    class LM(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.emb = torch.nn.Embedding(V, H)
            self.mlp = torch.nn.Linear(H, H)
            self.head = head

        def forward(self, tok, tgt):
            h = torch.tanh(self.mlp(self.emb(tok)))
            if isinstance(self.head, torch.nn.Linear):
                return torch.nn.functional.cross_entropy(self.head(h).reshape(-1, V), tgt.reshape(-1))
            return self.head(h, tgt)

    torch.manual_seed(0)
    ref = LM(torch.nn.Linear(H, V, bias=False))
    lm = LM(moepeak.RingDTPLinearCrossEntropy(H, V, ring=ring))
    lm.load_state_dict(ref.state_dict())  # the checkpoint of an lm_head model loads as is
    mesh = init_device_mesh("cpu", (P,))
    lm.head.shard_(mesh)
    fully_shard(lm, mesh=mesh, ignored_params={lm.head.weight})
    assert lm.head.weight.to_local().shape[0] == -(-V // P) or rank == P - 1
    opt = torch.optim.SGD(lm.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        tok = torch.randint(0, V, (2, 9), generator=g)
        inp, tgt = tok[:, :-1], tok[:, 1:]
        loss = lm(inp, tgt)
        rl = ref(inp, tgt)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss.backward()
        rl.backward()
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(loss, rl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lm.head.weight.full_tensor(), ref.head.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lm.mlp.weight.full_tensor(), ref.mlp.weight, rtol=1e-5, atol=1e-6)


def test_ring_variants_equal_single_device_P234_and_fsdp2():
    run_ranks(4, _rank_fn_all, timeout=400)


def _bad_fn(rank, P, group):
    import moepeak

    w, xs, ys = _data(P, torch.float32)
    a, b = _shard_rows(P)[rank]
    y = ys[rank].clone()
    y[0] = V  # out of range for the global vocab
    with pytest.raises(ValueError, match="labels must be in"):
        moepeak.linear_cross_entropy(xs[rank], w[a:b], y, group=group)
    with pytest.raises(ValueError, match="ring must be"):
        moepeak.linear_cross_entropy(xs[rank], w[a:b], ys[rank], group=group, ring="tokens")
    for ring in ("gather", "weights", "activations"):
        y = ys[rank].clone()
        y[0] = V
        with pytest.raises(ValueError, match="labels must be in"):
            moepeak.linear_cross_entropy(xs[rank], w[a:b], y, group=group, ring=ring)
        # a bad label on one rank only: every rank raises (none is left waiting in an exchange)
        y = ys[rank].clone()
        if rank == 0:
            y[2] = -7
        with pytest.raises(ValueError, match=r"labels must be in .*\(rank, min, max\).*\(0, -7, "):
            moepeak.linear_cross_entropy(xs[rank], w[a:b], y, group=group, ring=ring)
        with pytest.raises(ValueError, match="bias is not supported with group"):
            moepeak.linear_cross_entropy(xs[rank], w[a:b], ys[rank], group=group, ring=ring,
                                         bias=torch.zeros(b - a))
        # one hidden size on every rank: a rank with another raises on every rank, nothing hangs
        H2 = H + 1 if rank == 0 else H
        x2, w2 = torch.randn(3, H2), torch.randn(b - a, H2)
        with pytest.raises(ValueError, match="one hidden size and dtype"):
            moepeak.linear_cross_entropy(x2, w2, ys[rank][:3], group=group, ring=ring)
        with pytest.raises(ValueError, match="vocab shards of the group are all empty"):
            moepeak.linear_cross_entropy(xs[rank], w[:0], ys[rank], group=group, ring=ring)


def _transport_fn(rank, P, group):
    """The `transport` argument: "torch" and a Transport instance give the default's
    results (the instance is the one used: it counts the ring's exchanges); a bad
    choice, "nccl" on CPU tensors and an instance of another size fail clearly."""
    import moepeak
    from moepeak.core import Transport, TorchDistTransport

    class Counting(Transport):
        def __init__(self, inner):
            self.inner, self.rank, self.world_size, self.calls = inner, inner.rank, inner.world_size, 0

        def send_recv(self, send, dst, recv, src):
            self.calls += 1
            return self.inner.send_recv(send, dst, recv, src)

        def all_gather(self, out, inp):
            return self.inner.all_gather(out, inp)

        def all_reduce_(self, t, op="sum"):
            return self.inner.all_reduce_(t, op)

    w, xs, ys = _data(P, torch.float32)
    a, b = _shard_rows(P)[rank]

    def run(**kw):
        x = xs[rank].clone().requires_grad_()
        ws = w[a:b].clone().requires_grad_()
        loss = moepeak.linear_cross_entropy(x, ws, ys[rank], group=group, ring="weights", chunk_tokens=4,
                                            chunk_vocab=5, **kw)
        loss.backward()
        return loss.detach(), x.grad, ws.grad

    ref = run()
    counting = Counting(TorchDistTransport(group))
    for kw in (dict(transport="torch"), dict(transport=counting)):
        got = run(**kw)
        for g, r in zip(got, ref):
            assert torch.equal(g, r), kw
    assert counting.calls > 0, "the given transport was not used"
    with pytest.raises(ValueError, match="transport must be one of"):
        run(transport="gloo")
    with pytest.raises(ValueError, match="CUDA tensors only"):
        run(transport="nccl")
    wrong = Counting(TorchDistTransport(group))
    wrong.world_size = P + 1
    with pytest.raises(ValueError, match="transport instance is rank"):
        run(transport=wrong)
