"""Which SDPA backend the attention core runs on: the option (TiledBlockSpec.attention_backend,
apply_moepeak(attention_backend=...)), its check, and the context a core call runs inside.

Choices (ATTENTION_BACKENDS):
  "auto"     on a Hopper GPU (compute capability 9.x), for fp16/bf16 attention without an
             explicit mask, with cuDNN available: cuDNN first, then flash, efficient, math, each
             only where torch's global switch has it enabled (torch.backends.cuda.
             enable_cudnn_sdp(False), or an sdpa_kernel around the training step, still holds);
             anywhere else torch's own choice, untouched. Why cuDNN: on one H200 (torch 2.11,
             causal bf16, head_dim 128, 16 q heads in one call) it ran 555-575 TFLOP/s fwd+bwd
             against flash's 324-328 at 128k-256k tokens, with the same error against fp64
             (issue 38). Why not with a mask: cuDNN's backward returns NaN dq on H100/H200 for
             an attn_mask with T % 128 == 64 and a row's logsumexp below -88.7 (pytorch issue
             196678; causal without a mask is clean). Why not Blackwell: unmeasured here, and
             cuDNN SDPA has a silent-corruption report for GQA on sm_100 (pytorch issue 193893).
  "cudnn", "flash", "efficient", "math"
             that backend only (forced, as benchmarks and comparisons need it): torch raises when
             it cannot run the call's inputs, its warnings saying why.
  "torch", None
             torch's own choice: no context at all (the off switch).

The order goes to torch.nn.attention.sdpa_kernel(backends, set_priority=True) (torch 2.6 and
later, 2.11 and 2.13 included; without set_priority, torch's own order among the listed ones):
on CUDA torch runs the first backend of the list that accepts the call's inputs (dtype, head
size, mask, GQA, layout), so under "auto" a backend that cannot run them is passed over, never
an error. (torch's CPU path ignores the priority and tries flash before math.) The
backward runs the kernel the forward picked, so only forward calls need the context (the tiled
block's forward and its recompute). The order used is logged once per distinct (choice, device,
dtype, order) on the 'moepeak' logger.

TiledBlockSpec.attention_backend is entered around attn_core as an unmasked call; a core that
passes an explicit attn_mask sets the spec's to None and enters attention_backend_context(...,
masked=True) itself (moepeak.hf.tiled's core does, knowing the layer's mask).

Exactness: every backend computes the same softmax(q k^T * scale) v; they differ in blocking and
accumulation order only. tests/test_attention_backend.py checks the tiled block under "math"
against the untiled block on the CPU and, on CUDA, "auto" (cuDNN) against fp64 within 2x the
error of torch's default backend.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math", "torch")
DEFAULT_ATTENTION_BACKEND = "torch"  # TiledBlockSpec's and apply_moepeak's: "auto" is opt-in until measured in a step
OFF = "torch"  # torch's own choice; None means the same
FALLBACKS = ("flash", "efficient", "math")  # "auto"'s after cuDNN, in this order
AUTO_CAPABILITY_MAJOR = 9  # Hopper: where "auto" was measured
AUTO_DTYPES = (torch.float16, torch.bfloat16)
# moepeak's name -> (torch.nn.attention.SDPBackend member, torch.backends.cuda switch reader)
_TORCH_BACKENDS = {"cudnn": ("CUDNN_ATTENTION", "cudnn_sdp_enabled"),
                   "flash": ("FLASH_ATTENTION", "flash_sdp_enabled"),
                   "efficient": ("EFFICIENT_ATTENTION", "mem_efficient_sdp_enabled"),
                   "math": ("MATH", "math_sdp_enabled")}

# sdpa_kernel's priority keyword (torch >= 2.6), read once: without it the listed backends run in
# torch's own order
_PRIORITY = {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}
_LOG = logging.getLogger("moepeak")
_logged = set()  # (choice, device type, dtype, order) already logged


def check_attention_backend(value, argument: str = "attention_backend") -> str:
    """value as one of ATTENTION_BACKENDS (None -> "torch"); a ValueError naming `argument`
    and the choices otherwise."""
    if value is None:
        return OFF
    if not isinstance(value, str) or value not in ATTENTION_BACKENDS:
        raise ValueError(f"moepeak: {argument} must be one of {ATTENTION_BACKENDS} or None (torch's own choice), "
                         f"got {value!r}")
    return value


def auto_order(device_type: str, capability: Optional[Tuple[int, int]], dtype: torch.dtype,
               cudnn_available: bool, enabled: Sequence[str] = tuple(_TORCH_BACKENDS),
               masked: bool = False) -> Optional[Tuple[str, ...]]:
    """"auto"'s order for these facts (None: torch's own choice): cuDNN first on CUDA of
    compute capability AUTO_CAPABILITY_MAJOR.x for AUTO_DTYPES with cuDNN available and no
    explicit mask (masked: the call passes an attn_mask); `enabled`: the backends torch's
    global switches have on (the others are left out)."""
    if device_type != "cuda" or capability is None or capability[0] != AUTO_CAPABILITY_MAJOR \
            or dtype not in AUTO_DTYPES or not cudnn_available or masked:
        return None
    order = tuple(b for b in ("cudnn",) + FALLBACKS if b in enabled)
    return order if order and order[0] == "cudnn" else None


def backend_order(choice, device: torch.device, dtype: torch.dtype, masked: bool = False) -> Optional[Tuple[str, ...]]:
    """The backends, first choice first, that a call on `device` with `dtype` attention (with an
    explicit mask when `masked`) runs under for `choice` (None: torch's own choice, no context)."""
    choice = check_attention_backend(choice)
    if choice == OFF:
        return None
    if choice != "auto":
        return (choice,)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    enabled = [b for b, (_, switch) in _TORCH_BACKENDS.items() if getattr(torch.backends.cuda, switch)()]
    return auto_order("cuda", torch.cuda.get_device_capability(device), dtype,
                      torch.backends.cudnn.is_available(), enabled, masked)


def attention_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention on x's projections runs in: autocast's for x's device when on, else x's."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


@contextlib.contextmanager
def attention_backend_context(choice, device: torch.device, dtype: torch.dtype,
                              masked: bool = False) -> Iterator[Optional[Tuple[str, ...]]]:
    """Around an attention call: SDPA runs on `choice`'s order of backends (backend_order; masked:
    the call passes an explicit attn_mask); yields the order (None: torch's own choice, nothing
    changed)."""
    order = backend_order(choice, device, dtype, masked)
    key = (choice, torch.device(device).type, dtype, masked, order)
    if key not in _logged:
        _logged.add(key)
        what = " > ".join(order) if order else "torch's own choice"
        _LOG.info("moepeak: attention on SDPA backends %s (attention_backend=%r, %s, %s%s)", what, choice,
                  torch.device(device).type, str(dtype).replace("torch.", ""), ", masked" if masked else "")
    if order is None:
        yield None
        return
    backends = [getattr(SDPBackend, _TORCH_BACKENDS[b][0]) for b in order]
    with torch.nn.attention.sdpa_kernel(backends, **_PRIORITY):  # looked up at the call (tests spy on it)
        yield order


def describe_attention_backend(choice) -> str:
    """One line for a report: what `choice` runs."""
    choice = check_attention_backend(choice)
    if choice == OFF:
        return "torch's own SDPA backend choice (attention_backend=None)"
    if choice == "auto":
        return ("SDPA backends cudnn > flash > efficient > math on Hopper (sm90) for fp16/bf16 without a mask (else "
                "torch's own choice; attention_backend='auto', the order used is logged once on the 'moepeak' logger)")
    return f"SDPA backend {choice} only (attention_backend={choice!r})"
