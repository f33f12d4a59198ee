"""moepeak.ring_dtp: Ring-DTP, the vocabulary projection + cross-entropy that never holds the
logits.

    loss = linear_cross_entropy(hidden, weight, labels)   # == F.cross_entropy(F.linear(h, w).float(), y)

Only a logits *block* exists at a time; forward keeps lse: [T] x fp32. The
arithmetic torch lacks (online log-sum-exp fold with target pick, padded-vocab
masking, softcap; the softmax-gradient epilogue with label smoothing, z-loss,
ignore_index, and 1 - p_y from a sum that never cancels) is C (csrc/ce.c) and
CUDA C (cuda/ce_*.cu), reached through moepeak/ring_dtp/blocks.py; every GEMM is torch's.

Modules:
  options  RingDTPOptions: the schedule's options (mode, chunk sizes, ring, transport,
           label_check, the error-control steps), their defaults and checks; where the loss
           definition ends and the schedule begins
  loss     the public function linear_cross_entropy and the module
           RingDTPLinearCrossEntropy (argument checks, autocast, which path runs)
  ops      the ops moepeak::ring_dtp_ce and moepeak::ring_dtp_ce_backward (custom_op,
           register_fake, register_autograd): the single-device loss
  sched    the single-device schedules ("mode": fused, fused_lowp, vocab_outer,
           vocab_outer_lowp, token_outer, auto), how auto picks, and their error
           bounds ("Error growth")
  ring     the multi-rank schedules (`group`: the weights and activations rings, and
           ring="gather"); group: the transport on the group and its one exchange per call
  blocks   one block's arithmetic; gemm: torch's GEMMs in the forms the schedules use;
           sizes: the block sizes and byte formulas
  labels   out-of-range labels (ValueError on CPU; on CUDA deferred)

Definitions: every label ignored (or T = 0) with reduction="mean" gives what
F.cross_entropy gives: loss NaN (0 / 0) and zero gradients, also for a non-finite
upstream gradient (an ignored token's gradient is 0 whatever flows in; transformers'
sum / num_items_in_batch with num_items_in_batch = 0 sends inf). Labels outside [0, V) that
are not ignore_index: on CPU a ValueError before any work; on CUDA (checking
would need a host sync) those tokens' losses are NaN (so a mean loss is NaN),
their gradients 0, and a ValueError is raised at the next call or by
check_labels() (labels.py: no sync, no device-side assert). With `group`, on
any device, a ValueError on every rank of the group from its exchange (group.py).
z-loss adds z_loss * lse^2 per token; return_lse returns lse: [...] x fp32
(not differentiable: use z_loss to put a gradient on it).

Public face (exported here): for users, linear_cross_entropy, RingDTPLinearCrossEntropy,
RingDTPOptions and check_labels (also moepeak.linear_cross_entropy, ...), and the choices their
arguments take: MODES (mode), REDUCTIONS (reduction), RINGS (ring), LABEL_CHECKS (label_check);
and the module moepeak.ring_dtp.sizes,
public by design (moepeak.plan reads the block sizes from it). Everything else is internal to
moepeak.ring_dtp.
"""
from .labels import check_labels
from .loss import RingDTPLinearCrossEntropy, linear_cross_entropy
from .options import LABEL_CHECKS, MODES, RINGS, RingDTPOptions
from .sched import REDUCTIONS

__all__ = ["linear_cross_entropy", "RingDTPLinearCrossEntropy", "RingDTPOptions", "check_labels", "MODES",
           "REDUCTIONS", "RINGS", "LABEL_CHECKS"]
