"""RingDTPOptions (moepeak/ring_dtp/options.py): the one home of Ring-DTP's schedule defaults
and checks. Each bad field is refused by name, before any work, by the function and at the
module's construction; keywords and an options object combine (a keyword given wins); the
options of one call are that call's only (no process-wide switch); the integrations read
their names and defaults from it.
"""
import dataclasses

import pytest
import torch

import moepeak
from moepeak.ring_dtp import LABEL_CHECKS, MODES, RINGS, RingDTPOptions
from tests.ring_dtp_helpers import grads, make


def test_defaults_and_choices():
    o = RingDTPOptions()
    assert (o.mode, o.chunk_tokens, o.chunk_vocab, o.ring, o.transport, o.label_check) == (
        "auto", None, None, "auto", "auto", "deferred")
    assert (o.dw_finish, o.dx_finish, o.fused_colsum) == (True, True, True) and o.center_chunks == 8
    assert o.mode in MODES and o.ring in RINGS and o.label_check in LABEL_CHECKS
    assert o.op_args() == (MODES["auto"], 0, 0, True, True, 8, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.mode = "fused"


@pytest.mark.parametrize("field,value,error", [
    ("mode", "fast", ValueError), ("mode", None, ValueError), ("ring", "bogus", ValueError),
    ("label_check", "later", ValueError), ("transport", "mpi", ValueError),
    ("chunk_tokens", 0, ValueError), ("chunk_tokens", True, ValueError), ("chunk_vocab", 2.0, ValueError),
    ("center_chunks", -1, ValueError), ("center_chunks", 1.5, ValueError),
    ("dw_finish", 1, TypeError), ("dx_finish", "yes", TypeError), ("fused_colsum", None, TypeError)])
def test_bad_field_refused_by_name(field, value, error):
    """Every field is checked where the options are made: by RingDTPOptions, by
    linear_cross_entropy (its keyword, or an options object) and by the module's constructor."""
    with pytest.raises(error, match=field):
        RingDTPOptions(**{field: value})
    x, w, y, _ = make(4, 8, 30, torch.float32)
    if field in ("mode", "chunk_tokens", "chunk_vocab", "ring", "transport", "label_check") and value is not None:
        with pytest.raises(error, match=field):
            moepeak.linear_cross_entropy(x, w, y, **{field: value})
        with pytest.raises(error, match=field):
            moepeak.RingDTPLinearCrossEntropy(8, 30, **{field: value})


def test_module_checks_every_option_at_construction():
    """The module refuses a bad schedule or loss option when it is made, not at its first
    forward (mode, label_check, chunk sizes and reduction were checked only there)."""
    for kw, name in ((dict(mode="fast"), "mode"), (dict(label_check="later"), "label_check"),
                     (dict(chunk_vocab=-3), "chunk_vocab"), (dict(reduction="avg"), "reduction"),
                     (dict(label_smoothing=2.0), "label_smoothing")):
        with pytest.raises(ValueError, match=name):
            moepeak.RingDTPLinearCrossEntropy(8, 30, **kw)
    head = moepeak.RingDTPLinearCrossEntropy(8, 30, mode="vocab_outer", chunk_tokens=3)
    assert head.options == RingDTPOptions(mode="vocab_outer", chunk_tokens=3)


def test_bool_chunk_size_refused():
    """chunk_tokens=True is not a block size (it was taken as 1)."""
    x, w, y, _ = make(4, 8, 30, torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens must be None or a positive int, got True"):
        moepeak.linear_cross_entropy(x, w, y, chunk_tokens=True)


def test_keywords_and_options_combine():
    base = RingDTPOptions(mode="token_outer", chunk_tokens=5, dw_finish=False)
    assert RingDTPOptions.resolve(None) == RingDTPOptions()
    assert RingDTPOptions.resolve(base) is base
    assert RingDTPOptions.resolve(base, mode=None, chunk_vocab=None) is base          # None: the options' value
    assert RingDTPOptions.resolve(base, mode="fused", chunk_vocab=7) == dataclasses.replace(
        base, mode="fused", chunk_vocab=7)                                             # a keyword given wins
    with pytest.raises(TypeError, match="options must be a RingDTPOptions"):
        RingDTPOptions.resolve({"mode": "fused"})
    with pytest.raises(TypeError, match="dw_finish"):                                 # a field, not a keyword
        RingDTPOptions.resolve(None, dw_finish=False)
    # through the function: options + keyword equals the same options spelled out, bitwise
    x, w, y, b = make(21, 8, 37, torch.bfloat16, seed=3, bias=True)
    a = grads(moepeak.linear_cross_entropy, x, w, y, b, options=RingDTPOptions(chunk_tokens=4), mode="token_outer",
              chunk_vocab=16)
    c = grads(moepeak.linear_cross_entropy, x, w, y, b, options=RingDTPOptions(mode="token_outer", chunk_tokens=4,
                                                                               chunk_vocab=16))
    for u, v in zip(a, c):
        assert (u is None and v is None) or torch.equal(u, v)


def test_a_calls_options_stay_with_that_call():
    """The error-control switches are per call: a call with the dW finish off gives its own
    gradients, and the calls before and after it are bitwise those of the defaults."""
    x, w, y, _ = make(64, 16, 50, torch.bfloat16, seed=9)
    def run(**kw):
        return grads(moepeak.linear_cross_entropy, x, w, y, None, mode="fused_lowp", chunk_tokens=4, **kw)

    before = run()
    off = run(options=RingDTPOptions(dw_finish=False))
    after = run()
    assert not torch.equal(off[2], before[2])  # the switch reached the op (16 chunks of bf16 dW)
    for u, v in zip(before[:3], after[:3]):  # loss, dX, dW (no bias)
        assert torch.equal(u, v)
    head = moepeak.RingDTPLinearCrossEntropy(16, 50, mode="fused_lowp", chunk_tokens=4,
                                             options=RingDTPOptions(dw_finish=False), dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(w)
    head(x, y).backward()
    assert torch.equal(head.weight.grad, off[2])


def test_integrations_read_the_options():
    """moepeak.hf's ce_* options name RingDTPOptions fields and are checked at apply time by it;
    moepeak.titan's loss config takes its defaults from it."""
    from moepeak.hf.loss import LOSS_OPTIONS
    fields = {f.name for f in dataclasses.fields(RingDTPOptions)}
    assert set(LOSS_OPTIONS.values()) <= fields
    titan = pytest.importorskip("moepeak.titan.ring_dtp_loss", exc_type=ImportError)
    config = titan.RingDTPLoss.Config
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.name in fields}
    assert defaults == {n: getattr(RingDTPOptions(), n) for n in ("ring", "mode", "chunk_tokens", "chunk_vocab")}
