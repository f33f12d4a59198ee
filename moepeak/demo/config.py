"""The demo model's configuration (MoEConfig) and its schedule switches: the moepeak
component each switch runs (component, available, resolve), the optimizer switch
(build_optimizer), and sizes that follow from a config (param_count, sco_arena_bytes).
The model itself is moepeak/demo/models.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..sco import KEEP_LAST_DEMO
from ..sco import sizes as sco_sizes

MOE_CHOICES = ("llep", "dense")
HEAD_CHOICES = ("ring_dtp", "plain")
CKPT_CHOICES = ("sco", "torch", "none")
OPTIM_CHOICES = ("stream", "torch")

# The public moepeak name behind each schedule switch (each imported from its subpackage's
# face when the switch is used).
COMPONENTS = {
    "moe": "PipelinedLLEPMoE",
    "head": "RingDTPLinearCrossEntropy",
    "checkpoint": "sco_checkpoint",
    "optimizer": "StreamAdamW",
}
_MOEPEAK_SETTING = {"moe": "llep", "head": "ring_dtp", "checkpoint": "sco", "optimizer": "stream"}
_PLAIN_SETTING = {"moe": "dense", "head": "plain", "checkpoint": "torch", "optimizer": "torch"}


def component(switch: str):
    """The moepeak object behind `switch`, or raise ImportError saying why not."""
    name = COMPONENTS[switch]
    try:
        if switch == "moe":
            from ..llep import PipelinedLLEPMoE as found
        elif switch == "head":
            from ..ring_dtp import RingDTPLinearCrossEntropy as found
        elif switch == "checkpoint":
            from ..sco import sco_checkpoint as found
        else:
            from ..stream_adamw import StreamAdamW as found
    except (ImportError, AttributeError) as e:
        raise ImportError(f"moepeak.{name} is not available in this build ({type(e).__name__}: {e})") from e
    return found


def available(switch: str) -> bool:
    try:
        component(switch)
        return True
    except ImportError:
        return False


@dataclass
class MoEConfig:
    vocab_size: int = 264          # 256 bytes + specials, padded to a multiple of 8
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    experts: int = 4
    top_k: int = 2
    intermediate: int = 64
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    moe: str = "llep"
    head: str = "ring_dtp"
    checkpoint: str = "sco"
    chunk_rows: Optional[int] = None       # PipelinedLLEP chunk budget C (None: its default)
    chunk_tokens: Optional[int] = None     # Ring-DTP workspace (None: its default)
    chunk_vocab: Optional[int] = None
    # Context parallelism over the model's group (only when it has > 1 rank):
    # each rank holds the contiguous slice [r*T/P, (r+1)*T/P) of one sequence
    # (see cp_slice), attention all-gathers K/V, the loss is the full sequence's.
    context_parallel: bool = False
    # Sequence-tiled blocks (moepeak.tiled): every block's position-wise parts run in tiles of
    # this many tokens, forward and backward; only attention holds full-length tensors
    # (None: whole blocks). Composes with every checkpoint setting.
    tile_tokens: Optional[int] = None
    # checkpoint "sco": the last n blocks keep their input on the GPU (SCOConfig.keep_last):
    # GPU memory traded for host RAM, which every GPU of a host shares.
    sco_keep_last: int = KEEP_LAST_DEMO  # every block offloaded: the demo's measured setting (moepeak.sco)
    # RMSNorms through moepeak.norms.rms_norm (the same forward, a backward without fp32 [T, H]
    # tensors): the final one with head "ring_dtp", the blocks' with checkpoint "sco";
    # False: autograd through the eager norms.
    lean_norm: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self, *, world_size: int = 1, seq_len: Optional[int] = None,
                 batch: int = 1, dtype: torch.dtype = torch.float32,
                 arena_limit_bytes: Optional[int] = None) -> "MoEConfig":
        """Raise ValueError with every problem found, before any work starts: the sizes first
        (nothing else can be checked without them), then the shape, the ranks, the switches
        and options, and the step's length."""
        bad = self._size_problems()
        if not bad:
            bad = (self._shape_problems() + self._rank_problems(world_size) + self._option_problems()
                   + self._length_problems(world_size, seq_len, batch, dtype, arena_limit_bytes))
        if bad:
            raise ValueError("moepeak: invalid model config: " + "; ".join(bad))
        return self

    def _size_problems(self) -> List[str]:
        return [f"{f} must be a positive integer, got {v!r}"
                for f in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "experts", "top_k", "intermediate")
                for v in (getattr(self, f),) if not isinstance(v, int) or isinstance(v, bool) or v < 1]

    def _shape_problems(self) -> List[str]:
        bad = []
        if self.hidden % self.heads:
            bad.append(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        elif self.head_dim % 2:
            bad.append(f"head_dim = hidden/heads = {self.head_dim} must be even (RoPE rotates pairs)")
        if self.heads % self.kv_heads:
            bad.append(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.top_k > self.experts:
            bad.append(f"top_k ({self.top_k}) must be <= experts ({self.experts})")
        if self.vocab_size < 259:
            bad.append(f"vocab_size ({self.vocab_size}) must be >= 259 (256 bytes + 3 specials)")
        return bad

    def _rank_problems(self, world_size: int) -> List[str]:
        bad = []
        if world_size > 1 and self.experts % world_size:
            bad.append(f"experts ({self.experts}) must be divisible by the number of ranks ({world_size})")
        if world_size > 1 and self.head == "ring_dtp" and self.vocab_size % world_size:
            bad.append(f"vocab_size ({self.vocab_size}) must be divisible by the number of ranks "
                       f"({world_size}) for the Ring-DTP vocab shards")
        return bad

    def _option_problems(self) -> List[str]:
        bad = [f"{sw} must be one of {choices}, got {getattr(self, sw)!r}"
               for sw, choices in (("moe", MOE_CHOICES), ("head", HEAD_CHOICES), ("checkpoint", CKPT_CHOICES))
               if getattr(self, sw) not in choices]
        for f in ("chunk_rows", "chunk_tokens", "chunk_vocab", "tile_tokens"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or v < 1):
                bad.append(f"{f} must be a positive integer or None, got {v!r}")
        keep = self.sco_keep_last
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            bad.append(f"sco_keep_last must be an integer >= 0, got {keep!r}")
        return bad

    def _length_problems(self, world_size: int, seq_len: Optional[int], batch: int, dtype: torch.dtype,
                         arena_limit_bytes: Optional[int]) -> List[str]:
        if seq_len is None:
            return []
        if seq_len < 2:
            return [f"seq_len must be >= 2, got {seq_len}"]
        split = self.context_parallel and world_size > 1
        if split and seq_len % world_size:
            return [f"seq_len ({seq_len}) must be divisible by the number of ranks ({world_size}) "
                    f"for context parallelism (each rank holds seq_len/ranks tokens)"]
        if self.checkpoint == "sco" and arena_limit_bytes is not None:
            need = sco_arena_bytes(self, seq_len // world_size if split else seq_len, batch, dtype)
            if need > arena_limit_bytes:
                return [f"seq_len {seq_len}: the SCO arena needs (layers - sco_keep_last)*batch*seq_len*hidden*bytes = "
                        f"{need / 2**30:.2f} GiB of pinned host memory, more than the "
                        f"{arena_limit_bytes / 2**30:.2f} GiB allowed; lower --seq-len or --layers"]
        return []

    def replace(self, **kw) -> "MoEConfig":
        return dataclasses.replace(self, **kw)

    def plain(self) -> "MoEConfig":
        """The same model in plain PyTorch (dense MoE, F.cross_entropy, torch checkpoint)."""
        return self.replace(moe="dense", head="plain", tile_tokens=None,
                            checkpoint="none" if self.checkpoint == "none" else "torch")


def sco_arena_bytes(cfg: MoEConfig, seq_len: int, batch: int, dtype: torch.dtype) -> int:
    """Pinned bytes SCO's arena takes: one slot of a boundary [B, T, H] per block but the last
    sco_keep_last (T: this rank's tokens; moepeak.sco.sizes.arena_bytes)."""
    boundary = sco_sizes.boundary_bytes(batch * seq_len, cfg.hidden, torch.empty((), dtype=dtype).element_size())
    return sco_sizes.arena_bytes(cfg.layers, cfg.sco_keep_last, boundary)


def param_count(cfg: MoEConfig) -> int:
    H, I, E, V, L = cfg.hidden, cfg.intermediate, cfg.experts, cfg.vocab_size, cfg.layers
    d = cfg.head_dim
    attn = H * cfg.heads * d * 2 + H * cfg.kv_heads * d * 2
    moe = E * H + E * 3 * H * I
    return 2 * V * H + H + L * (attn + moe + 2 * H)


def build_optimizer(params, kind: str = "stream", *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                    weight_decay=1e-2, bucket_mb: Optional[float] = None,
                    state_dtype: Optional[torch.dtype] = None, device_state_bytes: int = 0):
    """"stream": moepeak.StreamAdamW (state in host RAM; bucket_mb, state_dtype: its options,
    None: its defaults; device_state_bytes: the state of the leading parameters on the GPU,
    StreamAdamW.backward_tail); "torch": torch.optim.AdamW (fused where this torch supports
    it: StreamAdamW's bitwise target)."""
    params = list(params)
    if kind == "stream":
        kw = {k: v for k, v in (("bucket_mb", bucket_mb), ("state_dtype", state_dtype)) if v is not None}
        if device_state_bytes:
            kw["device_state"] = component("optimizer").backward_tail(params, device_state_bytes)
        return component("optimizer")(params, lr=lr, betas=betas, eps=eps,
                                      weight_decay=weight_decay, **kw)
    if kind != "torch":
        raise ValueError(f"moepeak: optimizer must be one of {OPTIM_CHOICES}, got {kind!r}")
    # FSDP2 DTensor params beside rank-local plain params (experts, vocab shard):
    # torch's fused/foreach kernels refuse a mix within one group, so split them.
    dt = [p for p in params if type(p.data).__name__ == "DTensor"]
    if dt and len(dt) != len(params):
        ids = {id(p) for p in dt}
        params = [{"params": dt}, {"params": [p for p in params if id(p) not in ids]}]
    try:
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def resolve(cfg: MoEConfig, optimizer: str, *, want_moepeak: Dict[str, bool]):
    """Turn per-schedule on/off wishes into settings; a schedule whose component
    is not in this build falls back to plain PyTorch, with a note saying so."""
    notes, settings = [], {}
    for sw in ("moe", "head", "checkpoint", "optimizer"):
        on = want_moepeak.get(sw, True)
        if on and not available(sw):
            notes.append(f"{sw}: moepeak.{COMPONENTS[sw]} is not available in this build; "
                         f"using plain PyTorch ({_PLAIN_SETTING[sw]})")
            on = False
        settings[sw] = _MOEPEAK_SETTING[sw] if on else _PLAIN_SETTING[sw]
    if cfg.checkpoint == "none":  # no checkpointing asked: neither SCO nor torch's
        settings["checkpoint"] = "none"
    opt = settings.pop("optimizer")
    return cfg.replace(**settings), opt, notes
