"""Sequence-tiled decoder block: only the attention core holds full-length tensors.

A pre-norm decoder block splits into three parts:

    pre_attn(x_t, start)    -> (q_t, k_t, v_t)   position-wise: norm, q/k/v projections, q/k norms, RoPE
    attn_core(q, k, v)      -> out               the only part that mixes positions
    post_attn(x_t, out_t)   -> y_t               position-wise: o_proj, residual, norm, router + MoE/MLP, residual

`tiled_block(x, spec, tile_tokens)` runs the two position-wise parts in sequence tiles
of `tile_tokens` tokens, in forward and in backward, and checkpoints the block itself:
between forward and backward it keeps only the block input x (through one tiny
autograd node, `_Boundary`, so that torch's non-reentrant checkpoint and
moepeak.sco_checkpoint, which replay the wrapped function only until every saved
tensor is back, replay nothing but that node: x is then the one tensor SCO offloads;
when x needs no gradient, a 0-element anchor that does puts the node in the graph all
the same), plus what the recompute must run under, as torch.utils.checkpoint keeps it:
the forward's autocast state (for the CPU and for x's device type) and the RNG state
(CPU and x's device) before each part call, one per tile and head group (~5 KiB of host
memory each for the CPU generator), restored around the same call's recompute.

Backward, given grad_y [.., T, ..]:
  1. pre_attn tiles under no_grad rebuild q, k, v (full length, one buffer per head group);
  2. attn_core re-runs under enable_grad on detached q, k, v, once per head group (its own
     saved state: out and lse per group);
  3. post_attn tiles, last tile first: recompute the tile under enable_grad and take
     torch.autograd.grad of y_t w.r.t. (x_t, out_t, weights); dx_t is written into the
     full-length dx, dout_t into the per-group dout buffers, weight grads are added into
     accumulators;
  4. the attention core's backward, one head group at a time: group g's q, k, v, out and
     dout are dropped as soon as its dq, dk, dv exist, so the full-length set shrinks;
  5. pre_attn tiles, last tile first, the same way; dx_t adds to dx.
Every recompute in steps 1, 2, 3 and 5 runs under the autocast state and the RNG state the
same call saw in the forward. Per-tile saved tensors live only during their tile's
autograd.grad call, so the position-wise working set is O(tile_tokens).

Full-length tensors at the backward peak: x, grad_y, dx, q, k, v, out, dout, lse and the first
head group's core backward, whose share scales as 1/head_groups (moepeak/tiled/sizes.py: the
table, 7.9 bf16 [T, H] units for the 2.0B model at 4 head groups, and the formula the
head-group choice of spec.head_group_budget reads, made at the forward and kept for backward).

Exactness: each tile runs the untiled block's ops on its rows, so every per-token value
(y, dx, q/k/v, their grads) is that of the untiled block up to the kernels' own
row-blocking (bitwise on the CPU for the fp32 blocks in tests/test_tiled.py). Weight
gradients are sums over tiles instead of one GEMM over all tokens: accumulated in fp32
(in the weight's dtype when that is wider), rounded once to the weight's dtype.

Side outputs (spec.extras = n): post_attn may also return n per-token tensors of the tile
(e.g. the router logits [B, t, E] that an auxiliary load-balancing loss reads over all
tokens). tiled_block then returns them at full length beside y, as outputs of the same
autograd node: their gradients enter step 3 with grad_y (each tile's autograd.grad takes
(y_t, e_t) with (grad_y_t, grad_e_t)), so a loss over all tokens' side outputs reaches the
weights and x through the same tiled recompute. Full-length bytes: n side outputs of
[T, E] beside the [T, H] list (router logits in bf16 at E = 16: 32 B/token per
block, 1/128 of one [T, H] bf16 unit).

Requirements on the block (checked where possible, else documented):
  - the position-wise parts are deterministic and token-local: each output row depends
    only on its own input row (token-choice top-k routing with no capacity limit; a loss
    over all tokens reads them through side outputs, never from inside a part; no dropout);
  - nothing outside the block reads tensors the parts create except through side outputs.

q, k, v buffers keep the memory order of pre_attn's tiles (q_t [B, h, t, d] viewing
[B, t, h, d] memory gives a [B, h, T, d] buffer viewing [B, T, h, d] memory), so a core
whose output follows q's layout (SDPA) and is then transposed back to [B, T, h, d] (the
Hugging Face attention interface) returns a view, not a second full-length copy.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch

from ..sco import DeferredPrefetch
from . import sizes
from .attention import DEFAULT_ATTENTION_BACKEND, attention_backend_context, check_attention_backend

__all__ = ["TiledBlockSpec", "tiled_block", "TiledBlock", "tile_ranges", "requires_grad_params"]


@dataclass(frozen=True)
class TiledBlockSpec:
    """How to run one block in sequence tiles (the block's "small description").

    pre_attn(x_t, start): x_t is tokens [start, start + t) of the block input (sequence
        at dim `seq_dim`); returns (q_t, k_t, v_t) with the sequence at dim `qkv_seq_dim`
        and the heads at dim `qkv_head_dim`, RoPE already applied at the tile's positions.
    attn_core(q, k, v): full-length attention; returns out (sequence at `out_seq_dim`,
        heads at `out_head_dim`).
    post_attn(x_t, out_t): the block output y_t for the tile (same layout as x_t).
    parameters(): the tensors requiring grad that pre_attn / post_attn use (evaluated
        at forward and again at backward, so FSDP2's unsharded parameters are the ones
        seen at each time). attn_core must not use parameters.
    head_groups: G > 1 declares the core head-separable in G groups: attn_core on
        q heads [g*nq/G, (g+1)*nq/G) and k/v heads [g*nkv/G, (g+1)*nkv/G) gives out heads
        [g*nq/G, (g+1)*nq/G) (true of GQA attention for any G dividing nkv). The tiled
        block then keeps q, k, v, out, dout as G separate buffers and runs the core's
        backward one group at a time, freeing each group's inputs as it goes.
    head_group_budget: None runs head_groups groups; bytes (an int) or "free" (a share of the
        device memory free at the forward, CUDA only) runs the fewest groups dividing head_groups
        whose full-length set fits (sizes.fewest_head_groups; attn_core takes any such grouping).
    attention_backend: the SDPA backends attn_core runs on (attention.py; None: torch's own).
    extras: n > 0 makes post_attn return (y_t, e_1, ..., e_n): per-token side outputs of
        the tile (floating point, tokens at dim `seq_dim`, e.g. router logits [B, t, E]);
        tiled_block then returns (y, E_1, ..., E_n), each E_i at full length, and the
        gradients reaching E_i flow back through the tiled recompute like y's.
    """

    pre_attn: Callable[[torch.Tensor, int], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attn_core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    post_attn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    parameters: Callable[[], Sequence[torch.Tensor]]
    seq_dim: int = 1
    qkv_seq_dim: int = 2
    out_seq_dim: int = 1
    head_groups: int = 1
    qkv_head_dim: int = 1
    out_head_dim: int = 2
    extras: int = 0
    head_group_budget: Optional[object] = None
    attention_backend: Optional[str] = DEFAULT_ATTENTION_BACKEND


def requires_grad_params(module: torch.nn.Module) -> Callable[[], List[torch.Tensor]]:
    """A TiledBlockSpec's `parameters` for a block module: its parameters that require grad,
    read at each call (the adapters of the demo, Hugging Face and torchtitan blocks use it)."""
    return lambda: [p for p in module.parameters() if p.requires_grad]


def tile_ranges(T: int, tile_tokens: int) -> List[Tuple[int, int]]:
    """[(start, length)] covering [0, T) in order; the last tile may be shorter."""
    return [(s, min(tile_tokens, T - s)) for s in range(0, T, tile_tokens)]


class _Boundary(torch.autograd.Function):
    """Identity that saves the block input x: the one tensor kept from forward to backward.

    It is the first op of the tiled block, so a checkpoint replay that stops once every
    saved tensor is back (torch non-reentrant checkpoint, sco_checkpoint) runs only this.
    anchor: None, or (when x needs no gradient: a frozen embedding's output) a 0-element
    tensor that requires grad, so that autograd records this node and it saves x all the same."""

    @staticmethod
    def forward(ctx, x, box, anchor):
        box.ctx = ctx
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.needs_input_grad[0] else None), None, None


class _Box:
    """Hands the _Boundary node's ctx (hence the saved x) to the _TiledBlock node."""

    __slots__ = ("ctx",)

    def __init__(self):
        self.ctx = None


class _CallStates:
    """What each part call of the forward ran under, so that backward recomputes the same call
    under the same (what torch.utils.checkpoint restores for its one replay, kept per call
    because backward calls the parts in another order): autocast for the CPU and for x's
    device type, and the RNG states of the CPU and of x's device just before the call.
    Keys: ("pre", tile start), ("core", head group), ("post", tile start)."""

    def __init__(self, device: torch.device):
        types = dict.fromkeys(("cpu", device.type))
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in types if torch.amp.is_autocast_available(d)]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        module = getattr(torch, device.type, None) if device.type != "cpu" else None  # torch.cuda, ...
        self.device_rng = module if hasattr(module, "get_rng_state") else None
        self.device = device if device.index is not None or self.device_rng is None else \
            torch.device(device.type, self.device_rng.current_device())
        self.rng: Dict[tuple, tuple] = {}

    def in_forward(self, key) -> ContextManager:
        """Around a part call of the forward: remembers the RNG states it starts from."""
        dev = self.device_rng.get_rng_state(self.device) if self.device_rng is not None else None
        self.rng[key] = (torch.get_rng_state(), dev)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def in_recompute(self, key):
        """Around the recompute of the call `key`: its forward's autocast and RNG states; the
        RNG states outside are left as they were."""
        cpu, dev = self.rng[key]
        devices = [self.device.index] if dev is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type), contextlib.ExitStack() as stack:
            torch.set_rng_state(cpu)
            if dev is not None:
                self.device_rng.set_rng_state(dev, self.device)
            for device_type, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            yield


def _untracked(key) -> ContextManager:
    """Around a part call of a forward without backward: nothing to remember."""
    return contextlib.nullcontext()


def _fp32_accumulator(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Zeros like the grad g (a DTensor grad, of a DTensor param, gives a DTensor of its
    placements), in p's dtype when that is fp32/fp64, else fp32."""
    dt = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.zeros_like(g, dtype=dt)


def _add_into(accs: List[Optional[torch.Tensor]], params, grads) -> None:
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        if accs[i] is None:
            accs[i] = _fp32_accumulator(p, g)
        accs[i].add_(g)


def _detached_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _tile_of(groups: List[torch.Tensor], seq_dim: int, head_dim: int, s: int, n: int) -> torch.Tensor:
    """Tokens [s, s + n) of the tensor whose heads are split over `groups` (a view when G = 1)."""
    if len(groups) == 1:
        return groups[0].narrow(seq_dim, s, n)
    return torch.cat([t.narrow(seq_dim, s, n) for t in groups], dim=head_dim)


def _scatter_tile(groups: List[torch.Tensor], tile: torch.Tensor, seq_dim: int, head_dim: int, s: int, n: int):
    """Write `tile` (all heads, tokens [s, s + n)) into the per-group buffers."""
    h0 = 0
    for buf in groups:
        h = buf.shape[head_dim]
        buf.narrow(seq_dim, s, n).copy_(tile.narrow(head_dim, h0, h))
        h0 += h


def _core(spec: TiledBlockSpec, q, k, v):
    """spec.attn_core(q, k, v) on the SDPA backends spec.attention_backend names."""
    with attention_backend_context(spec.attention_backend, q.device, q.dtype):
        return spec.attn_core(q, k, v)


def _run_forward(x, spec: TiledBlockSpec, tile_tokens: int, around: Callable[[tuple], ContextManager]):
    """(y or (y, *side outputs), the head groups run): the block, each part call made inside
    around(key)."""
    qkv = _pre_attn_groups(x, spec, tile_tokens, around)
    outs, G = [], len(qkv)
    for g, (q, k, v) in enumerate(qkv):
        with around(("core", g)):
            outs.append(_core(spec, q, k, v))
    del qkv
    sd, T = spec.seq_dim, x.shape[spec.seq_dim]
    y = torch.empty_like(x)
    extras = None  # the side outputs at full length: [e_i with dim sd of size T]
    for s, n in tile_ranges(T, tile_tokens):
        with around(("post", s)):
            result = spec.post_attn(x.narrow(sd, s, n), _tile_of(outs, spec.out_seq_dim, spec.out_head_dim, s, n))
        y_t, e_t = _split_post_attn(result, spec)
        y.narrow(sd, s, n).copy_(y_t)
        if extras is None:
            extras = [_full_length_like(e, sd, T) for e in e_t]
        for full, e in zip(extras, e_t):
            full.narrow(sd, s, n).copy_(e)
    return ((y, *extras) if spec.extras else y), G


class _TiledBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, box, spec: TiledBlockSpec, tile_tokens: int, *params):
        ctx.box, ctx.spec, ctx.tile_tokens = box, spec, tile_tokens
        ctx.n_params = len(params)
        ctx.x_requires_grad = x.requires_grad
        ctx.calls = _CallStates(x.device)
        if spec.extras:
            ctx.set_materialize_grads(False)  # an unused side output's gradient stays None
        result, ctx.head_groups = _run_forward(x, spec, tile_tokens, ctx.calls.in_forward)
        return result

    @staticmethod
    def backward(ctx, grad_y, *grad_extras):
        spec, tile, calls = ctx.spec, ctx.tile_tokens, ctx.calls
        # Under SCO, reading x reloads it and would start the previous block's prefetch
        # now; it is held back until the core's backward has freed more than that
        # boundary's bytes (step 4), so the prefetched boundary is not part of this peak.
        prefetch = DeferredPrefetch()
        with prefetch.collect():
            (x,) = ctx.box.ctx.saved_tensors
        ctx.box = None
        x = x.detach()
        if grad_y is None and all(g is None for g in grad_extras):
            prefetch.start()
            return (None,) * (4 + ctx.n_params)
        params = list(spec.parameters())
        if len(params) != ctx.n_params:
            raise RuntimeError(f"moepeak: tiled block's parameters() returned {len(params)} tensors in backward, "
                               f"{ctx.n_params} in forward")
        wanted = [p.requires_grad for p in params]
        grad_params = [p for p, w in zip(params, wanted) if w]
        accs: List[Optional[torch.Tensor]] = [None] * len(grad_params)
        sd, tiles = spec.seq_dim, tile_ranges(x.shape[spec.seq_dim], tile)
        osd, ohd = spec.out_seq_dim, spec.out_head_dim

        # 1-2. q, k, v again (no graph), then the attention core per head group with its graph
        with torch.no_grad():
            qkv = _pre_attn_groups(x, spec, tile, calls.in_recompute, ctx.head_groups)
        leaves = [[_detached_leaf(t) for t in group] for group in qkv]
        del qkv
        outs = []
        for g, group in enumerate(leaves):
            with torch.enable_grad(), calls.in_recompute(("core", g)):
                outs.append(_core(spec, *group))
        out_values = [o.detach() for o in outs]

        # 3. post-attention tiles: dx (residual path + norm), dout, weight grads
        dx = torch.empty_like(x)
        douts = [torch.empty_like(o) for o in out_values]
        for s, n in reversed(tiles):
            x_t = _detached_leaf(x.narrow(sd, s, n))
            o_t = _detached_leaf(_tile_of(out_values, osd, ohd, s, n))
            with torch.enable_grad(), calls.in_recompute(("post", s)):
                y_t, e_t = _split_post_attn(spec.post_attn(x_t, o_t), spec)
            # y_t and the side outputs that received a gradient, with their gradients' tiles
            pairs = [(y_t, grad_y)] + list(zip(e_t, grad_extras))
            pairs = [(t, g.narrow(sd, s, n)) for t, g in pairs if g is not None and t.requires_grad]
            g = torch.autograd.grad([t for t, _ in pairs], [x_t, o_t] + grad_params, [g for _, g in pairs],
                                    allow_unused=True) if pairs else [None] * (2 + len(grad_params))
            del y_t, e_t, pairs
            dx.narrow(sd, s, n).copy_(_zero_if_none(g[0], x_t))
            _scatter_tile(douts, _zero_if_none(g[1], o_t), osd, ohd, s, n)
            _add_into(accs, grad_params, g[2:])
            del g, x_t, o_t
        del out_values

        # 4. the attention core's backward, one head group at a time: each group's q, k, v,
        # out and dout die as its dq, dk, dv are born (the full-length set shrinks). The
        # peak is group 0's backward; after half the groups (all when G = 1) the set has
        # shrunk by the q and out halves, nh*d*b bytes per token (at least the one [T, H]
        # boundary the prefetch brings when nh*d >= H), so the held-back prefetch starts
        # there and overlaps the remaining groups.
        dqkv = []
        G = len(leaves)
        for i in range(G):
            group, out, dout = leaves[i], outs[i], douts[i]
            leaves[i] = outs[i] = douts[i] = None
            grads = torch.autograd.grad(out, group, dout, allow_unused=True)
            dqkv.append([_zero_if_none(gr, t) for gr, t in zip(grads, group)])
            del group, out, dout, grads
            if i + 1 == (G + 1) // 2:
                prefetch.start()

        # 5. pre-attention tiles. The post-attention part's dx (the residual path) enters
        # through an alias of x_t made after pre_attn's ops, so autograd runs it first and
        # adds x_t's gradient terms in the untiled block's order (residual path first).
        qsd, qhd = spec.qkv_seq_dim, spec.qkv_head_dim
        for s, n in reversed(tiles):
            x_t = _detached_leaf(x.narrow(sd, s, n))
            dx_t = dx.narrow(sd, s, n)
            with torch.enable_grad(), calls.in_recompute(("pre", s)):
                qkv_t = tuple(spec.pre_attn(x_t, s))
                residual_t = x_t.view_as(x_t)
            dqkv_t = tuple(_tile_of([grp[j] for grp in dqkv], qsd, qhd, s, n) for j in range(3))
            g = torch.autograd.grad(qkv_t + (residual_t,), [x_t] + grad_params, dqkv_t + (dx_t,),
                                    allow_unused=True)
            del qkv_t, residual_t, dqkv_t
            dx_t.copy_(g[0])
            _add_into(accs, grad_params, g[1:])
            del g, x_t, dx_t

        it = iter(accs)
        out_grads = []
        for p, w in zip(params, wanted):
            a = next(it) if w else None
            out_grads.append(None if a is None else a.to(p.dtype))
        return (dx if ctx.x_requires_grad else None, None, None, None, *out_grads)


def _zero_if_none(g, like):
    return torch.zeros_like(like) if g is None else g


def _split_post_attn(result, spec: TiledBlockSpec):
    """(y_t, [e_1 .. e_n]) from what post_attn returned (y_t alone when spec.extras == 0)."""
    if not spec.extras:
        return result, []
    if not isinstance(result, (tuple, list)) or len(result) != 1 + spec.extras:
        got = f"{len(result)} values" if isinstance(result, (tuple, list)) else type(result).__name__
        raise ValueError(f"moepeak: tiled block spec.extras = {spec.extras}: post_attn must return (y_t, "
                         f"{spec.extras} side outputs), got {got}")
    return result[0], list(result[1:])


def _full_length_like(e: torch.Tensor, seq_dim: int, T: int) -> torch.Tensor:
    """An empty side-output buffer: e's shape with T tokens at seq_dim."""
    if not e.is_floating_point():
        raise TypeError(f"moepeak: tiled block side outputs must be floating point, got {e.dtype}")
    shape = list(e.shape)
    shape[seq_dim] = T
    return torch.empty(shape, dtype=e.dtype, device=e.device)


def _empty_in_layout_of(t: torch.Tensor, shape) -> torch.Tensor:
    """An empty tensor of `shape` whose dims lie in memory in t's order (outermost = largest
    stride; ties keep the dim order): the full-length buffer of tiles shaped like t."""
    order = sorted(range(t.dim()), key=lambda i: t.stride(i), reverse=True)
    buf = torch.empty([shape[i] for i in order], dtype=t.dtype, device=t.device)
    return buf.permute(*[order.index(i) for i in range(t.dim())])


def _pre_attn_groups(x, spec: TiledBlockSpec, tile_tokens: int, around: Callable[[tuple], ContextManager],
                     head_groups: Optional[int] = None) -> List[List[torch.Tensor]]:
    """[[q_g, k_g, v_g] for each head group g]: q, k, v at full length, built tile by tile
    (the only full-length tensors pre_attn makes), each group its own buffer; each pre_attn
    call made inside around(("pre", tile start)). head_groups: the count to run (None: chosen
    here from the first tile's q, k, v, sizes.head_groups_to_run)."""
    T = x.shape[spec.seq_dim]
    G, d, hd = head_groups, spec.qkv_seq_dim, spec.qkv_head_dim
    groups = None
    for s, n in tile_ranges(T, tile_tokens):
        with around(("pre", s)):
            parts = spec.pre_attn(x.narrow(spec.seq_dim, s, n), s)
        if len(parts) != 3:
            raise ValueError(f"moepeak: tiled block pre_attn must return (q, k, v), got {len(parts)} tensors")
        if groups is None:
            for name, t in zip("qkv", parts):
                if t.shape[hd] % spec.head_groups:
                    raise ValueError(f"moepeak: tiled block head_groups ({spec.head_groups}) must divide the {name} "
                                     f"heads ({t.shape[hd]}, dim {hd} of shape {tuple(t.shape)})")
            G = G or sizes.head_groups_to_run(spec.head_groups, sizes.resolve_budget(spec.head_group_budget, x.device),
                                              x, *parts, head_dim=hd)
            groups = []
            for _ in range(G):
                bufs = []
                for t in parts:
                    shape = list(t.shape)
                    shape[d], shape[hd] = T, t.shape[hd] // G
                    bufs.append(_empty_in_layout_of(t, shape))
                groups.append(bufs)
        for j, t in enumerate(parts):
            _scatter_tile([grp[j] for grp in groups], t, d, hd, s, n)
        del parts
    return groups


def tiled_block(x: torch.Tensor, spec: TiledBlockSpec, tile_tokens: int):
    """y = block(x), its position-wise parts run in tiles of `tile_tokens` tokens;
    (y, E_1, ..., E_n) when spec.extras = n (the side outputs at full length).

    With grad enabled it is also the block's checkpoint: only x is kept for backward
    (wrap it in moepeak.sco_checkpoint to keep x in host memory instead). Under
    no_grad the tiles just run."""
    if not isinstance(spec, TiledBlockSpec):
        raise TypeError(f"moepeak: tiled_block spec must be a TiledBlockSpec, got {type(spec).__name__}")
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"moepeak: tile_tokens must be a positive integer, got {tile_tokens!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"moepeak: tiled_block x must be a floating-point tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if not -x.dim() <= spec.seq_dim < x.dim():
        raise ValueError(f"moepeak: spec.seq_dim {spec.seq_dim} is out of range for x of shape {tuple(x.shape)}")
    if isinstance(spec.head_groups, bool) or not isinstance(spec.head_groups, int) or spec.head_groups < 1:
        raise ValueError(f"moepeak: spec.head_groups must be a positive integer, got {spec.head_groups!r}")
    if isinstance(spec.extras, bool) or not isinstance(spec.extras, int) or spec.extras < 0:
        raise ValueError(f"moepeak: spec.extras must be a non-negative integer, got {spec.extras!r}")
    sizes.check_head_group_budget(spec.head_group_budget, "spec.head_group_budget")
    check_attention_backend(spec.attention_backend, "spec.attention_backend")
    if x.shape[spec.seq_dim] == 0:
        raise ValueError(f"moepeak: tiled_block x has no tokens (shape {tuple(x.shape)})")
    params = tuple(spec.parameters())
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        with torch.no_grad():
            return _run_forward(x, spec, tile_tokens, _untracked)[0]
    box = _Box()
    anchor = None if x.requires_grad else torch.empty(0, device=x.device, requires_grad=True)
    xb = _Boundary.apply(x, box, anchor)
    return _TiledBlock.apply(xb, box, spec, tile_tokens, *params)


class TiledBlock(torch.nn.Module):
    """Wraps a block module: forward(x, *a, **kw) = tiled_block(x, make_spec(block, x, *a, **kw), tile_tokens).

    The block stays a submodule (state_dict keys gain a `block.` prefix); make_spec is an
    adapter such as moepeak.demo.tiled.demo_block_spec or moepeak.hf.tiled.hf_moe_layer_spec."""

    def __init__(self, block: torch.nn.Module, tile_tokens: int, make_spec: Callable[..., TiledBlockSpec]):
        super().__init__()
        if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
            raise ValueError(f"moepeak: tile_tokens must be a positive integer, got {tile_tokens!r}")
        self.block, self.tile_tokens, self.make_spec = block, tile_tokens, make_spec

    def forward(self, x, *args, **kwargs):
        return tiled_block(x, self.make_spec(self.block, x, *args, **kwargs), self.tile_tokens)

