"""apply_moepeak under sequence parallelism from an existing engine (issue 41), on gloo CPU ranks
against one process running stock transformers on the whole sequence.

The engine is DeepSpeed Ulysses (UlyssesSPAttentionHF: it replaces the attention function by
an all-to-all around the real core), without a DeepSpeed engine in the user-loop cases and
inside one (transformers Trainer + accelerate ParallelismConfig(sp_backend="deepspeed"),
ZeRO-1) in the Trainer case. Each rank holds T/P tokens of one 64-token sequence (position_ids
and the pre-shifted shift_labels with them); a tiny Qwen3-MoE (4 q / 2 kv heads, 8 experts
top-2, router aux loss on) runs with tiled layers (8-token tiles), SCO, the loss without
logits, and PipelinedLLEP with the experts split over the sequence's ranks (or all ranks).
The loss and every gradient (expert slices and vocab shards gathered) must equal one
process's within fp32 reordering error.

One launch per world size (2 and 4 ranks) runs several arms on the same processes: plain and
packed sequences (a document boundary inside a shard; on a shard boundary with ranks
without any valid label), untiled, a vocab-sharded head (Ring-DTP's weights and activations
rings), P = 4 (Ulysses replicates the 2 kv heads), data parallel 2 x sequence parallel 2 with
the experts over all ranks or over each sequence group (average_gradients'
expert_replica_group). The refusals: a forced head-group count under Ulysses, packed documents
with the "sdpa" core (which Ulysses runs as plain causal attention), a missing shift_labels,
each a ValueError on every rank. The transformers Trainer's own sequence-parallel loss formula
is checked to be off (it weighs each rank's aux loss by its label count), so the arms that
match can fail. One-process tests: moepeak_varlen_sdpa equals stock sdpa's packed mask,
sequence_aux_share equals load_balancing_loss_func, accelerate's context-parallel hook on
self_attn reaches the tiled layer's attention call. The README's command runs as written.
"""
import copy
import os
import re
import shlex
import subprocess
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported (here and in the ranks)

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
deepspeed = pytest.importorskip("deepspeed")

try:
    from tests.dist_utils import ROOT, run_ranks
    from tests.hf_tiny import tiny_qwen3_moe
except ImportError:  # rootdir not on sys.path
    from dist_utils import ROOT, run_ranks
    from hf_tiny import tiny_qwen3_moe

V, T = 97, 64
RTOL, ATOL = 1e-4, 1e-6  # fp32: the same sums in another order
TILE = 8


def tiny_model(attn="sdpa"):
    return tiny_qwen3_moe(V, 128, attn)


def sequence(kind, seed=1):
    """input_ids, labels, position_ids [1, T]. "plain": one document; "packed": documents of 40
    and 24 tokens (the boundary inside a shard at P = 2 and 4); "edge": documents of 32 and 32
    (the boundary on a shard boundary) and no valid label after token 32 (rank 1 of 2, ranks
    2 and 3 of 4 hold none). Some labels ignored, unevenly over the shards."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, T), generator=g)
    labels = ids.clone()
    labels[0, 3:9] = -100
    labels[0, 50] = -100
    pos = torch.arange(T)
    if kind != "plain":
        cut = 40 if kind == "packed" else 32
        pos = torch.cat([torch.arange(cut), torch.arange(T - cut)])
        labels[0, cut] = -100  # a document's first token is not predicted from the previous document
    if kind == "edge":
        labels[0, T // 2 + 1:] = -100
    return ids, labels, pos.unsqueeze(0)


def shard(seq, r, P):
    """Rank r's shard of the sequence, as DeepSpeed's UlyssesSPDataLoaderAdapter hands it."""
    ids, labels, pos = seq
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    S = T // P
    return dict(input_ids=ids[:, r * S:(r + 1) * S], position_ids=pos[:, r * S:(r + 1) * S],
                shift_labels=shift[:, r * S:(r + 1) * S])


def reference(model, seqs):
    """One process, stock transformers (eager attention with the packed mask, the same math as
    sdpa's, which Ulysses has taken over in the ranks; use_cache=False: transformers builds the
    document mask from position_ids only without a cache): (loss of the first sequence,
    gradients of the mean of the sequences' losses)."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    losses = []
    for ids, labels, pos in seqs:
        loss = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss
        (loss / len(seqs)).backward()
        losses.append(loss.detach())
    return losses[0], {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- the ranks' side -------------------------------------------------------------------------

ORIGINAL_ATTENTION = {}


def init_deepspeed():
    """deepspeed.comm over the gloo group run_ranks made. DeepSpeed would also JIT-build its
    shared-memory all-reduce for CPU ranks (a minute of compiler time on a fresh machine),
    which nothing here uses: its compatible-ops table is set to say so."""
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def register_ulysses(base, P, cores=("sdpa", "moepeak_varlen_sdpa")):
    """DeepSpeed Ulysses over consecutive groups of P ranks, wrapping each attention
    implementation of `cores` (DeepSpeed keeps one set of sequence groups and wraps whatever is
    registered: a second call drops its groups and restores the unwrapped functions first);
    returns the rank's sequence group."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    for name in cores:
        ORIGINAL_ATTENTION.setdefault(name, ALL_ATTENTION_FUNCTIONS[name])
        ALL_ATTENTION_FUNCTIONS[name] = ORIGINAL_ATTENTION[name]
    for core in cores:
        parallel_state_sp._release_sequence_parallel_groups()
        model = copy.deepcopy(base)
        model.set_attn_implementation(core)
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation=core,
                                                              sequence_parallel_size=P, micro_batch_size=1,
                                                              seq_length_is_variable=True)
    return mpu.get_sequence_parallel_group()


def gathered(t, group):
    """The rank's tensors of the group concatenated on dim 0, in rank order (any sizes)."""
    import torch.distributed as dist
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, t.detach(), group=group)
    return torch.cat(parts)


def sp_step(model, batch, expert_group, expert_replica_group):
    """This rank's forward and backward through the patched model; (loss, {name: gradient}),
    expert slices gathered over expert_group, vocab shards over the head's mesh."""
    from moepeak.hf import average_gradients, expert_slices
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["shift_labels"],
                shift_labels=batch["shift_labels"], use_cache=False)
    out.loss.backward()
    average_gradients(model, expert_replica_group=expert_replica_group)
    slices = {id(p) for p in expert_slices(model).values()}
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if id(p) in slices:
            g = gathered(g, expert_group)
        elif hasattr(g, "to_local"):  # a vocab-sharded head: Shard(0) DTensor on the sequence group's mesh
            g = gathered(g.to_local(), p.device_mesh.get_group())
        grads[name] = g
    return out.loss.detach(), grads


def assert_close(tag, loss, grads, ref_loss, ref_grads):
    worst, at = 0.0, None
    for name, ref in ref_grads.items():
        err = ((grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        if err > worst:
            worst, at = err, name
    ok = torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL) and all(
        torch.allclose(grads[n], ref, rtol=RTOL, atol=ATOL) for n, ref in ref_grads.items())
    assert ok, (f"{tag}: loss {loss.item():.7f} vs {ref_loss.item():.7f}; worst gradient relative error "
                f"{worst:.2e} at {at}")


def arm(base, seqs, r, P, group, core, *, expert_group=None, replicas=None, expert_replicas=False,
        sharded_head=None, **options):
    """One arm: a fresh copy of `base` under apply_moepeak, this rank (r of the sequence group of
    P ranks) holding its shard of its replica's sequence (replicas: the group of the ranks at the
    same place in each sequence group; replica d trains seqs[d]); asserts the loss and every
    gradient equal one process's (reference(seqs)). expert_replicas: the experts are split over
    the sequence group, and their slices averaged over the replicas too."""
    import torch.distributed as dist

    from moepeak.hf import apply_moepeak
    ref_loss, ref_grads = reference(base, seqs)
    model = copy.deepcopy(base)
    model.set_attn_implementation(core)
    expert_group = group if expert_group is None else expert_group
    if sharded_head is not None:  # lm_head rows split over the sequence group (FSDP2's dim-0 layout)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = DeviceMesh.from_group(group, "cpu")
        model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]))
        options["ce_ring"] = sharded_head
    apply_moepeak(model, group=expert_group, sequence_group=group, **options)
    d = 0 if replicas is None else dist.get_rank(replicas)
    loss, grads = sp_step(model, shard(seqs[d], r, P), expert_group, replicas if expert_replicas else None)
    tag = f"P={P}, core {core}, {options}, experts over {dist.get_world_size(expert_group)} ranks"
    if d == 0:  # replica 0 trains sequence 0: its loss is that sequence's
        assert_close(tag, loss, grads, ref_loss, ref_grads)
    else:
        assert_close(tag, torch.zeros(()), grads, torch.zeros(()), ref_grads)


def refused(base, seq, r, P, group, core, match, drop_shift_labels=False, **options):
    """The forward raises a ValueError matching `match` (on every rank: none is left waiting)."""
    from moepeak.hf import apply_moepeak
    model = copy.deepcopy(base)
    model.set_attn_implementation(core)
    apply_moepeak(model, group=group, sequence_group=group, **options)
    batch = shard(seq, r, P)
    shift = batch.pop("shift_labels")
    if not drop_shift_labels:
        batch["shift_labels"] = shift
    with pytest.raises(ValueError, match=match):
        model(**batch, labels=shift, use_cache=False)


def stock_trainer_formula_is_off(base, seq, r, P, group):
    """transformers' deepspeed_sp_compute_loss (a label-count-weighted mean of each rank's model
    loss) on the stock model under Ulysses: its gradient is not one process's, because each
    rank's loss holds the aux loss of its own tokens; the arms above can therefore fail."""
    import torch.distributed as dist
    ref_loss, ref_grads = reference(base, [seq])
    model = copy.deepcopy(base)
    batch = shard(seq, r, P)
    out = model(**batch, labels=batch["shift_labels"], use_cache=False)
    good = (batch["shift_labels"] != -100).sum()
    local = torch.where(good > 0, out.loss, torch.zeros_like(out.loss)) * good
    totals = torch.stack([local.detach(), good.float()])
    dist.all_reduce(totals, group=group)
    ((local + (totals[0] - local.detach())) / totals[1]).backward()
    worst = 0.0
    for name, p in model.named_parameters():  # DeepSpeed sums the gradients over the sequence group
        dist.all_reduce(p.grad, group=group)
        worst = max(worst, ((p.grad - ref_grads[name]).abs().max() / ref_grads[name].abs().max()).item())
    assert worst > 1e-2, f"the stock formula matched one process (worst gradient relative error {worst:.2e})"


def ranks_of_two(r, P):
    from moepeak.hf import register_varlen_sdpa
    init_deepspeed()
    register_varlen_sdpa()
    base = tiny_model()
    plain, packed, edge = sequence("plain"), sequence("packed"), sequence("edge")
    sp = register_ulysses(base, P)
    stock_trainer_formula_is_off(base, plain, r, P, sp)
    arm(base, [plain], r, P, sp, "sdpa", tile_tokens=TILE)
    arm(base, [packed], r, P, sp, "moepeak_varlen_sdpa", tile_tokens=TILE)
    arm(base, [edge], r, P, sp, "moepeak_varlen_sdpa", tile_tokens=TILE)
    arm(base, [packed], r, P, sp, "moepeak_varlen_sdpa", tile_tokens=None)
    arm(base, [packed], r, P, sp, "moepeak_varlen_sdpa", tile_tokens=TILE, sharded_head="weights")
    arm(base, [edge], r, P, sp, "moepeak_varlen_sdpa", tile_tokens=TILE, sharded_head="activations")
    refused(base, plain, r, P, sp, "sdpa", "attention_head_groups=2", tile_tokens=TILE, attention_head_groups=2)
    refused(base, packed, r, P, sp, "sdpa", "packs several documents.*'sdpa'", tile_tokens=TILE)
    refused(base, plain, r, P, sp, "sdpa", "needs shift_labels", drop_shift_labels=True, tile_tokens=TILE)


def ranks_of_four(r, W):
    import torch.distributed as dist

    from moepeak.hf import register_varlen_sdpa
    init_deepspeed()
    register_varlen_sdpa()
    base = tiny_model()
    packed, edge = sequence("packed"), sequence("edge")
    sp = register_ulysses(base, W)  # 4 ranks for 2 kv heads: Ulysses replicates them
    arm(base, [packed], r, W, sp, "moepeak_varlen_sdpa", tile_tokens=TILE)
    arm(base, [edge], r, W, sp, "moepeak_varlen_sdpa", tile_tokens=TILE)
    # data parallel 2 x sequence parallel 2: replica d trains sequence d (packed, edge)
    sp = register_ulysses(base, 2, cores=("moepeak_varlen_sdpa",))
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])][r % 2]
    seqs = [sequence("packed"), sequence("edge", seed=2)]
    arm(base, seqs, r % 2, 2, sp, "moepeak_varlen_sdpa", expert_group=dist.group.WORLD, replicas=replicas,
        tile_tokens=TILE)
    arm(base, seqs, r % 2, 2, sp, "moepeak_varlen_sdpa", replicas=replicas, expert_replicas=True, tile_tokens=TILE)


def trainer_ranks(r, P, out_dir):
    """transformers Trainer + accelerate ParallelismConfig(sp_size=2, sp_backend="deepspeed") + a
    DeepSpeed ZeRO-1 engine on CPU, the model under apply_moepeak(sequence_group="engine",
    sequence_loss="sum") and the mixin: the logged loss and the gradient DeepSpeed hands its
    optimizer (read in its step) are one process's."""
    os.environ.update(RANK=str(r), WORLD_SIZE=str(P), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(P))
    init_deepspeed()
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from deepspeed.utils import safe_get_full_grad

    from moepeak.hf import SequenceParallelTrainerMixin, apply_moepeak
    base = tiny_model()
    seq = sequence("plain")
    ref_loss, ref_grads = reference(base, [seq])
    model = copy.deepcopy(base)
    apply_moepeak(model, tile_tokens=TILE, sequence_group="engine", sequence_loss="sum")
    ids, labels, pos = seq
    data = [dict(input_ids=ids[0], labels=labels[0], position_ids=pos[0])] * 2
    grads, losses = {}, []

    class MoepeakTrainer(SequenceParallelTrainerMixin, transformers.Trainer):
        pass

    class Capture(transformers.TrainerCallback):
        """The full gradients DeepSpeed's step sees, and the logged loss."""

        def on_step_begin(self, args, state, control, **kwargs):
            engine = trainer.model_wrapped
            if getattr(engine, "moepeak_test_wrapped", False):
                return
            step = engine.step

            def reading_step(*a, **k):
                for name, p in engine.module.named_parameters():
                    grads[name] = safe_get_full_grad(p).detach().clone()
                return step(*a, **k)
            engine.step, engine.moepeak_test_wrapped = reading_step, True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    zero1 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
             "steps_per_print": 1 << 30}
    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=1, max_steps=1, learning_rate=1.0,
        lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to=[], use_cpu=True,
        deepspeed=zero1, logging_steps=1, save_strategy="no",
        parallelism_config=ParallelismConfig(
            sp_size=P, sp_backend="deepspeed",
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")))
    trainer = MoepeakTrainer(model=model, args=args, train_dataset=data, callbacks=[Capture()],
                             optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None))
    trainer.train()
    assert_close("Trainer + DeepSpeed sequence parallelism + the mixin", torch.tensor(losses[0]), grads,
                 ref_loss, ref_grads)


def test_trainer_mixin_two_ranks(tmp_path):
    pytest.importorskip("accelerate")
    run_ranks(2, trainer_ranks, str(tmp_path), timeout=300)


def test_ulysses_two_ranks():
    run_ranks(2, ranks_of_two, timeout=300)


def test_ulysses_four_ranks():
    run_ranks(4, ranks_of_four, timeout=300)


# ---- one process ------------------------------------------------------------------------------

def test_varlen_sdpa_equals_stock_packed_mask():
    """moepeak_varlen_sdpa (documents from position_ids, causal SDPA per document) gives stock
    sdpa's loss and gradients with the packed mask transformers builds; two rows with their own
    boundaries, tiled and untiled."""
    from moepeak.hf import VARLEN_SDPA, apply_moepeak, register_varlen_sdpa
    register_varlen_sdpa()
    (ids0, labels0, pos0), (ids1, labels1, pos1) = sequence("packed"), sequence("edge", seed=3)
    ids, labels, pos = torch.cat([ids0, ids1]), torch.cat([labels0, labels1]), torch.cat([pos0, pos1])
    base = tiny_model()
    ref_loss, ref_grads = reference(base, [(ids, labels, pos)])
    for tile in (None, TILE):
        model = copy.deepcopy(base)
        model.set_attn_implementation(VARLEN_SDPA)
        if tile:
            apply_moepeak(model, tile_tokens=tile, checkpoint=False, experts=False)
        loss = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss
        loss.backward()
        assert_close(f"varlen, tile {tile}", loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                     ref_loss, ref_grads)


def test_varlen_sdpa_refuses_a_mask():
    from moepeak.hf.attention import varlen_sdpa_attention
    q = torch.randn(1, 4, 8, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="takes no attention_mask"):
        varlen_sdpa_attention(module, q, q, q, torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="position_ids"):
        varlen_sdpa_attention(module, q, q, q, None, position_ids=torch.arange(7)[None])


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "qwen3_next", "mixtral", "olmoe", "gpt_oss"])
def test_sequence_aux_share_is_load_balancing_loss(family):
    """sequence_aux_share without a group is transformers' load_balancing_loss_func of each
    family (no attention mask), value and gradient; its share over two halves of the rows sums
    to it (the counts taken over both)."""
    import importlib

    from moepeak.hf import sequence_aux_share
    stock = importlib.import_module(f"transformers.models.{family}.modeling_{family}").load_balancing_loss_func
    torch.manual_seed(0)
    E, K = 8, 2
    logits = [torch.randn(24, E, requires_grad=True) for _ in range(3)]
    expected = stock(tuple(logits), E, K)
    ref_grads = torch.autograd.grad(expected, logits)
    share, value = sequence_aux_share(logits, E, K, None)
    grads = torch.autograd.grad(share, logits)
    torch.testing.assert_close(share, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(value, expected.detach(), rtol=1e-6, atol=1e-7)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-8)


def test_accelerate_context_parallel_hook_reaches_the_tiled_attention(monkeypatch):
    """accelerate's context-parallel pre-hook on self_attn (mask dropped, is_causal=True) applies
    to the tiled layer's attention call, as to the stock layer's; the shard's position_ids are
    head-tail ([0, 16) and [48, 64): rank 0 of 2 under torch's load balancer), from which
    transformers would build a 4D "packed" mask."""
    big_modeling = pytest.importorskip("accelerate.big_modeling")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from moepeak.hf import apply_moepeak
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    seen = []

    def spy(module, q, k, v, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get("is_causal")))
        return sdpa(module, q, k, v, attention_mask, **kwargs)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spy)
    ids = torch.randint(0, V, (1, 32), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(16), torch.arange(48, 64)])[None]
    for tiled in (False, True):
        model = tiny_model()
        big_modeling._attach_context_parallel_hooks(model)
        if tiled:
            apply_moepeak(model, tile_tokens=TILE, checkpoint=False, loss=False, experts=False)
        seen.clear()
        model(input_ids=ids, position_ids=pos, use_cache=False).logits.sum().backward()
        assert seen and all(mask is None and causal is True for mask, causal in seen), (tiled, seen)


def test_options_are_checked():
    import torch.distributed as dist

    from moepeak.hf import apply_moepeak
    with pytest.raises(ValueError, match="sequence_loss must be one of"):
        apply_moepeak(tiny_model(), sequence_group="engine", sequence_loss="avg")
    with pytest.raises(ValueError, match="needs sequence_group"):
        apply_moepeak(tiny_model(), sequence_loss="sum")
    with pytest.raises(TypeError, match="sequence_group must be None, 'engine' or"):
        apply_moepeak(tiny_model(), sequence_group=dist)
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        apply_moepeak(tiny_model(), tile_tokens=TILE, attention_head_groups=3)
    with pytest.raises(ValueError, match="needs tile_tokens"):
        apply_moepeak(tiny_model(), attention_head_groups=1)
    model = tiny_model()
    apply_moepeak(model, sequence_group="engine")  # no engine sequence parallelism here: one process, stock loss
    ids, labels, _ = sequence("plain")
    ref_loss, _ = reference(tiny_model(), [sequence("plain")])
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)


def _readme_command():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Across GPUs with sequence parallelism", 1)[1].split("\n## ", 1)[0]
    commands = [c for block in re.findall(r"```bash\n(.*?)```", section, re.S)
                for c in block.replace("\\\n", " ").splitlines() if c.startswith("DS_ACCELERATOR=cpu torchrun")]
    assert len(commands) == 1, commands
    return shlex.split(commands[0])


def test_readme_sequence_parallel_command_runs():
    """The README's CPU command runs as written (torchrun through this interpreter) and its --check
    finds every step's loss equal to one stock process's."""
    command = _readme_command()
    assert command[0] == "DS_ACCELERATOR=cpu" and command[1] == "torchrun" and "--check" in command
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[2:]], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "(exact within fp32 rounding)" in p.stdout, p.stdout[-3000:]
