"""The private C bindings (moepeak._C) never trust their arguments.

The bindings take tensors as raw (pointer, size) ints; moepeak/*.py checks the
tensors first, but a binding must still reject any argument that would make
its kernel touch memory outside the extents the arguments describe, overflow
an int64 address computation, or compute with a NaN that no caller means:
negative sizes and counts, size products that overflow, null pointers for
non-empty buffers, non-finite floats, and table contents (labels, indices,
loads) that would turn into out-of-bounds addresses.

Each reproducer runs in a fresh interpreter that loads only the extension
(no torch), because without the check it crashes (negative memset, wild
write, SIGSEGV) or trips the sanitizers of the CI job (.ci/sanitize.sh). It
must end in a ValueError whose message names the offending argument.
"""
import re
import subprocess
import sys
import textwrap

import pytest

import moepeak._C as _C

EXT_PATH = _C.__file__

# Loaded in the child: the extension, small ctypes buffers, and one valid
# argument set per binding (the dicts) that a case overrides one field of.
PRELUDE = textwrap.dedent(
    """
    import ctypes, importlib.util, math, sys
    spec = importlib.util.spec_from_file_location("moepeak._C", sys.argv[1])
    C = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(C)
    I64_MAX, I64_MIN = 2**63 - 1, -2**63
    NAN, INF = float("nan"), float("inf")
    _keep = []

    def _buf(ctype, vals, n):
        n = max(n if n is not None else len(vals), len(vals), 1)
        a = (ctype * n)(*vals)
        _keep.append(a)
        return ctypes.addressof(a)

    def i64(*vals, n=None): return _buf(ctypes.c_int64, vals, n)
    def f32(*vals, n=None): return _buf(ctypes.c_float, vals, n)

    def binding(name, order, **defaults):
        def call(**over):
            args = dict(defaults, **over)
            return getattr(C, name)(*[args[k] for k in order.split()])
        return call

    llep_plan = binding("llep_plan", "load P E alpha m lam Q A S",
                        load=i64(5, 1, 0, 9), P=2, E=2, alpha=1.0, m=1, lam=1.3,
                        Q=i64(n=4), A=i64(n=8), S=i64(n=4))
    llep_num_chunks = binding("llep_num_chunks", "S P C", S=i64(3, 1, 0, 7), P=2, C=4)
    # a consistent one-expert, one-rank plan with 3 rows in one chunk
    llep_chunk_layout = binding("llep_chunk_layout", "A S P E r n j ss sl rl perm cap ec",
                                A=i64(3), S=i64(3), P=1, E=1, r=0, n=1, j=0, ss=i64(n=1), sl=i64(n=1),
                                rl=i64(n=1), perm=i64(n=3), cap=3, ec=i64(n=1))
    llep_count = binding("llep_count", "ids n E cnt cuda stream",
                         ids=i64(0, 1, 1, 7), n=4, E=2, cnt=i64(n=3), cuda=False, stream=0)
    llep_route_cpu = binding("llep_route_cpu", "ids n E P Ar cum blk out",
                             ids=i64(0, 1, 0), n=3, E=2, P=1, Ar=i64(2, 1), cum=i64(0, 0), blk=i64(0, 2),
                             out=i64(n=3))
    llep_gather = binding("llep_gather", "src idx rows div row_bytes out cuda stream",
                          src=f32(1, 2, 3, 4), idx=i64(1, 0), rows=2, div=1, row_bytes=8, out=f32(n=4),
                          cuda=False, stream=0)
    llep_combine = binding("llep_combine", "acc y dtype idx w rows div H cuda stream",
                           acc=f32(n=4), y=f32(1, 2, 3, 4), dtype=0, idx=i64(1, 0), w=0, rows=2, div=1, H=2,
                           cuda=False, stream=0)
    llep_down_bwd = binding("llep_down_bwd", "D a dtype w wp dwr rows I cuda stream",
                            D=f32(1, 2, 3, 4), a=f32(1, 1, 1, 1), dtype=0, w=f32(1, 1), wp=f32(1, 1),
                            dwr=f32(n=2), rows=2, I=2, cuda=False, stream=0)
    ce_fold = binding("ce_fold", "z z_dtype ldz t v v0 v_valid labels ignore softcap m s zy zsum sx cuda stream",
                      z=f32(1, 2, 3, 4, 5, 6, 7, 8), z_dtype=0, ldz=4, t=2, v=4, v0=0, v_valid=4,
                      labels=i64(1, -100), ignore=-100, softcap=0.0, m=f32(-INF, -INF), s=f32(n=2),
                      zy=f32(n=2), zsum=f32(n=2), sx=f32(n=2), cuda=False, stream=0)
    ce_grad = binding("ce_grad", "z z_dtype ldz t v v0 v_valid labels ignore softcap m ls q g g_stride eps "
                      "n_classes zloss out ldo out_dtype cuda stream",
                      z=f32(1, 2, 3, 4, 5, 6, 7, 8), z_dtype=0, ldz=4, t=2, v=4, v0=0, v_valid=4,
                      labels=i64(1, 3), ignore=-100, softcap=0.0, m=f32(4, 8), ls=f32(0.5, 0.5),
                      q=f32(0.9, 0.1), g=f32(1), g_stride=0, eps=0.0, n_classes=4, zloss=0.0, out=None,
                      ldo=4, out_dtype=0, cuda=False, stream=0)
    def ce_grad_inplace(**over):
        z = over.pop("z", None) or f32(1, 2, 3, 4, 5, 6, 7, 8)
        return ce_grad(z=z, out=z, **over)
    ce_scale = binding("ce_scale", "t dtype n g cuda stream", t=f32(1, 2, 3), dtype=0, n=3, g=f32(2),
                       cuda=False, stream=0)
    ce_dw_finish = binding("ce_dw_finish", "dw dtype ldw v0 nv x ldx h sy perm tcs t cs mu flags cuda stream",
                           dw=f32(n=4), dtype=0, ldw=2, v0=0, nv=2, x=f32(1, 2, 3, 4), ldx=2, h=2,
                           sy=i64(0, 1), perm=i64(1, 0), tcs=f32(1, 1), t=2, cs=0, mu=0, flags=0, cuda=False,
                           stream=0)
    ce_sub_row = binding("ce_sub_row", "out ldo x ldx mu n h dtype cuda stream",
                         out=f32(n=4), ldo=2, x=f32(1, 2, 3, 4), ldx=2, mu=f32(1, 1), n=2, h=2, dtype=0,
                         cuda=False, stream=0)
    ce_dx_finish = binding("ce_dx_finish", "dx dtype ldx w ldw v0 nv h labels tc t cuda stream",
                           dx=f32(n=4), dtype=0, ldx=2, w=f32(1, 2, 3, 4), ldw=2, v0=0, nv=2, h=2,
                           labels=i64(1, -100), tc=f32(1, 1), t=2, cuda=False, stream=0)
    """
)

BIG = 2**40  # a size whose product with another BIG-ish size overflows int64

# (case id, call in the child, a word the ValueError must contain: the argument's name)
CASES = [
    # llep_count: E < 0 was a negative-size memset; null / overflowing buffers
    ("count_E_negative", "llep_count(E=-1)", "E"),
    ("count_n_negative", "llep_count(n=-5)", "n"),
    ("count_cnt_null", "llep_count(cnt=0)", "cnt"),
    ("count_ids_null", "llep_count(ids=0)", "ids"),
    ("count_n_overflows_bytes", "llep_count(n=2**61 + 1)", "n"),
    # llep_plan: NaN/inf floats (alpha = NaN cast to int64), loads whose sum overflows, table extents
    ("plan_alpha_nan", "llep_plan(alpha=NAN)", "alpha"),
    ("plan_alpha_negative", "llep_plan(alpha=-1.0)", "alpha"),
    ("plan_lam_nan", "llep_plan(lam=NAN)", "lam"),
    ("plan_min_tokens_negative", "llep_plan(m=-1)", "min_tokens"),
    ("plan_load_sum_overflows", "llep_plan(load=i64(2**62, 2**62, 2**62, 2**62))", "load"),
    ("plan_tables_overflow", "llep_plan(P=2**15, E=2**30)", "overflows"),
    ("plan_Q_null", "llep_plan(Q=0)", "Q"),
    ("plan_load_null", "llep_plan(load=0)", "load"),
    # llep_num_chunks: S near INT64_MAX overflowed the ceiling division; negative rows; null
    ("num_chunks_S_huge", "llep_num_chunks(S=i64(I64_MAX, 0, 0, 0))", "S"),
    ("num_chunks_S_negative", "llep_num_chunks(S=i64(-9, 0, 0, 0))", "S"),
    ("num_chunks_S_null", "llep_num_chunks(S=0)", "S"),
    ("num_chunks_P_huge", "llep_num_chunks(P=2**31 - 1, C=2**40)", "overflows"),
    # llep_chunk_layout: S * n overflowed in the slice; inconsistent A/S; extents; null
    ("layout_S_times_n_overflows", "llep_chunk_layout(A=i64(2**62), S=i64(2**62), n=4, j=3)", "S"),
    ("layout_A_negative", "llep_chunk_layout(A=i64(-3))", "A"),
    ("layout_A_disagrees_with_S", "llep_chunk_layout(A=i64(5))", "A"),
    ("layout_tables_overflow", "llep_chunk_layout(P=2**20, E=2**30)", "overflows"),
    ("layout_E_zero", "llep_chunk_layout(E=0)", "E"),
    # llep_route_cpu: E < 0 (calloc of SIZE_MAX); tables that would write outside out [n]
    ("route_E_negative", "llep_route_cpu(E=-1)", "E"),
    ("route_P_zero", "llep_route_cpu(P=0)", "P"),
    ("route_n_negative", "llep_route_cpu(n=-1)", "n"),
    ("route_Ar_too_small", "llep_route_cpu(Ar=i64(1, 1))", "Ar"),
    ("route_blk_outside_out", "llep_route_cpu(blk=i64(0, 7))", "blk"),
    ("route_cum_wrong", "llep_route_cpu(cum=i64(1, 0))", "cum"),
    ("route_out_null", "llep_route_cpu(out=0)", "out"),
    # llep_gather: negative index (read before src), overflowing extents, null
    ("gather_idx_negative", "llep_gather(idx=i64(-4, 0), div=1)", "idx"),
    ("gather_extent_overflows", f"llep_gather(rows={BIG}, row_bytes={BIG})", "overflows"),
    ("gather_idx_row_overflows", "llep_gather(idx=i64(2**62, 0))", "idx"),
    ("gather_src_null", "llep_gather(src=0)", "src"),
    ("gather_out_null", "llep_gather(out=0)", "out"),
    # llep_combine: negative index (write before acc), overflowing extents, null
    ("combine_idx_negative", "llep_combine(idx=i64(-2, 0))", "idx"),
    ("combine_extent_overflows", f"llep_combine(rows={BIG}, H={BIG})", "overflows"),
    ("combine_acc_null", "llep_combine(acc=0)", "acc"),
    ("combine_y_null", "llep_combine(y=0)", "y"),
    # llep_down_bwd
    ("down_bwd_extent_overflows", f"llep_down_bwd(rows={BIG}, I={BIG})", "overflows"),
    ("down_bwd_wp_null", "llep_down_bwd(wp=0)", "wp"),
    # ce_fold: non-finite softcap; v0 < 0 (v_valid - v0 overflowed); extents; null
    ("fold_softcap_nan", "ce_fold(softcap=NAN)", "softcap"),
    ("fold_softcap_inf", "ce_fold(softcap=INF)", "softcap"),
    ("fold_softcap_negative", "ce_fold(softcap=-1.0)", "softcap"),
    ("fold_v0_negative", "ce_fold(v0=-2, v_valid=I64_MAX)", "v0"),
    ("fold_v0_plus_v_overflows", "ce_fold(v0=I64_MAX - 1)", "v0"),
    ("fold_v_valid_negative", "ce_fold(v_valid=-1)", "v_valid"),
    ("fold_extent_overflows", f"ce_fold(t={BIG}, ldz={BIG}, v=4)", "overflows"),
    ("fold_label_negative", "ce_fold(labels=i64(I64_MIN, 1))", "labels"),
    ("fold_labels_null", "ce_fold(labels=0)", "labels"),
    ("fold_m_null", "ce_fold(m=0)", "m"),
    # ce_grad: a label far below v0 overflowed y - v0; non-finite eps / zloss / softcap
    ("grad_label_overflows", "ce_grad_inplace(labels=i64(I64_MIN, 1), v0=1, v_valid=5)", "labels"),
    ("grad_eps_nan", "ce_grad_inplace(eps=NAN)", "eps"),
    ("grad_zloss_inf", "ce_grad_inplace(zloss=INF)", "zloss"),
    ("grad_zloss_nan", "ce_grad_inplace(zloss=NAN)", "zloss"),
    ("grad_softcap_nan", "ce_grad_inplace(softcap=NAN)", "softcap"),
    ("grad_g_null", "ce_grad_inplace(g=0)", "g"),
    ("grad_extent_overflows", f"ce_grad_inplace(t={BIG}, ldz={BIG}, ldo={BIG})", "overflows"),
    # ce_scale: a null g was dereferenced on CPU; n overflowing the byte extent
    ("scale_g_null", "ce_scale(g=0)", "g"),
    ("scale_t_null", "ce_scale(t=0)", "t"),
    ("scale_n_overflows_bytes", "ce_scale(n=2**62 + 1)", "n"),
    # ce_dw_finish: perm outside [0, t) (read past x); v0 + nv overflowed the label search
    ("dw_finish_perm_outside", "ce_dw_finish(perm=i64(9, 0))", "perm"),
    ("dw_finish_v0_overflows", "ce_dw_finish(v0=I64_MAX)", "v0"),
    ("dw_finish_v0_negative", "ce_dw_finish(v0=-1)", "v0"),
    ("dw_finish_extent_overflows", f"ce_dw_finish(nv={BIG}, ldw={BIG})", "overflows"),
    ("dw_finish_sy_null", "ce_dw_finish(sy=0)", "sy"),
    # ce_sub_row
    ("sub_row_extent_overflows", f"ce_sub_row(n={BIG}, ldo={BIG})", "overflows"),
    ("sub_row_mu_null", "ce_sub_row(mu=0)", "mu"),
    # ce_dx_finish: labels[t] - v0 overflowed; v0 < 0
    ("dx_finish_label_overflows", "ce_dx_finish(labels=i64(I64_MIN, 0), v0=5)", "labels"),
    ("dx_finish_v0_negative", "ce_dx_finish(v0=-1)", "v0"),
    ("dx_finish_extent_overflows", f"ce_dx_finish(t={BIG}, ldx={BIG})", "overflows"),
    ("dx_finish_tc_null", "ce_dx_finish(tc=0)", "tc"),
]


def _run_child(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + body, EXT_PATH], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("call,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_binding_rejects(call, needle):
    body = textwrap.dedent(
        f"""
        try:
            {call}
        except ValueError as e:
            print("VALUEERROR:", e)
        else:
            print("NO ERROR")
        """
    )
    r = _run_child(body)
    assert r.returncode == 0, f"{call} crashed the interpreter (rc {r.returncode}):\n{r.stderr[-3000:]}"
    out = r.stdout.strip()
    assert out.startswith("VALUEERROR:"), f"{call} did not raise ValueError: {out!r} {r.stderr[-2000:]}"
    # "moepeak._C.<binding>: <what is wrong>": the explanation names the argument as a word
    explanation = out.split(": ", 2)[-1]
    assert re.search(rf"\b{re.escape(needle)}\b", explanation), f"{call}: the message should name {needle!r}: {out!r}"


def test_valid_calls_still_pass():
    """The defaults the cases override are valid calls with the right results."""
    body = textwrap.dedent(
        """
        import ctypes
        def ints(addr, n): return list((ctypes.c_int64 * n).from_address(addr))
        def floats(addr, n): return list((ctypes.c_float * n).from_address(addr))
        cnt = i64(n=3); llep_count(cnt=cnt); assert ints(cnt, 3) == [1, 2, 1]
        Q, A, S = i64(n=4), i64(n=8), i64(n=4)
        llep_plan(Q=Q, A=A, S=S); assert sum(ints(Q, 4)) == 15 and sum(ints(S, 4)) == 15
        assert llep_num_chunks() == 4            # ceil(7 / (4 // 2))
        perm = i64(n=3); assert llep_chunk_layout(perm=perm) == 3 and ints(perm, 3) == [0, 1, 2]
        assert llep_chunk_layout(perm=0) == 3    # 0: no grouping permutation (one rank, cd916fc)
        out = i64(n=3); llep_route_cpu(out=out); assert ints(out, 3) == [0, 2, 1]
        out = f32(n=4); llep_gather(out=out); assert floats(out, 4) == [3, 4, 1, 2]
        acc = f32(n=4); llep_combine(acc=acc); assert floats(acc, 4) == [3, 4, 1, 2]
        dwr = f32(n=2); llep_down_bwd(dwr=dwr); assert floats(dwr, 2) == [3, 7]
        zs = f32(n=2); ce_fold(zsum=zs); assert floats(zs, 2) == [10, 26]
        z = f32(1, 2, 3, 4, 5, 6, 7, 8); ce_grad_inplace(z=z); assert all(v == v for v in floats(z, 8))
        t = f32(1, 2, 3); ce_scale(t=t); assert floats(t, 3) == [2, 4, 6]
        dw = f32(n=4); ce_dw_finish(dw=dw); assert floats(dw, 4) == [3, 4, 1, 2]
        o = f32(n=4); ce_sub_row(out=o); assert floats(o, 4) == [0, 1, 2, 3]
        dx = f32(n=4); ce_dx_finish(dx=dx); assert floats(dx, 4) == [3, 4, 0, 0]
        print("OK")
        """
    )
    r = _run_child(body)
    assert r.returncode == 0 and r.stdout.strip() == "OK", (r.stdout, r.stderr[-3000:])
