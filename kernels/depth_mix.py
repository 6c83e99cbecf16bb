"""
The depth mix: m queries read S sources in one pass.

m queries q_j (C,) read a list of S sources v_s (B, T, C), with a bias b_js or none; per token:

    r_s = 1 / RMS(v_s),   l_js = r_s q_j . v_s + b_js,   w_js = softmax_s(l_js)
    mixed_j = sum_s w_js v_s,   lse_j = logsumexp_s l_js

(residuals.DepthAttention's read, for every query at once). A prior (mixed_0, lse_0), a read of
sources before, counts as one more source with value mixed_0 and logit lse_0, so that a read can
be continued later (the online softmax of the AttnRes paper's phase 2). Backward, with g_j and h_j
the gradients of mixed_j and lse_j:

    dl_js = w_js (g_j . v_s - g_j . mixed_j + h_j)
    dv_s  = sum_j [w_js g_j + dl_js r_s q_j] - (r_s^2 / C) (sum_j dl_js r_s q_j . v_s) v_s
    dq_j  = sum_s dl_js r_s v_s,   db_js = dl_js (summed over tokens)
    prior: d mixed_0 = w_j0 g_j,   d lse_0 = dl_j0

A read of WAV's matched detail (Matched) reads D and scales it by s = min(rho, RMS(state) /
(RMS(D) + eps)) as it reads it (s detached: dD = s dD~).
"""
import math
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from residuals import MATCH_EPS, RMS_EPS, upcast

from .common import (GradPool, accumulator, cast, common_dtype, next_pow2, on_device, other_dtypes,
                     reduction_programs, rms_inverse_of_norm, token_tile, tl, triton)


# ---------------------------------------------------------------------------- the PyTorch functions

def stacked(tensors):
    """torch.stack, or a view for a single tensor (a stack of one is a copy)."""
    return torch.stack(tensors) if len(tensors) > 1 else tensors[0].unsqueeze(0)


def stacked_rms_inverse(values):
    """1/RMS of each of the values (S, B, T, 1), from their norms (one pass over each)."""
    norms = [torch.linalg.vector_norm(v, dim=-1, keepdim=True) for v in values]
    return rms_inverse_of_norm(stacked(norms), values[0].shape[-1])


def _mix_dtype(sources, prior_mixed):
    return common_dtype(sources if prior_mixed is None else [*sources, prior_mixed])


def mix_torch(queries, bias, sources, prior_mixed, prior_lse, single, rinv=None):
    """The depth mix in PyTorch, one source at a time (the sources are never stacked), shaped as the
    kernel's outputs -> mixed, lse (None for a single query: no caller merges its read further) and
    what the backward needs: 1/RMS r (S, B, T, 1), the scores (S, [m,] B, T, 1) and the weights (S,
    [m,] B, T, 1; the prior's row after them). Per token the numbers keep a trailing 1, so that they
    broadcast against the sources (B, T, C) as they are. rinv: the sources' 1/RMS, if known. Out of
    place, as every forward of an autograd.Function here (see cast)."""
    values, q = [upcast(v) for v in sources], upcast(queries)
    (m, C), tokens = q.shape, values[0].shape[:-1]
    shape = (len(values),) + (() if single else (m,)) + tokens + (1,)
    rinv = stacked_rms_inverse(values) if rinv is None else rinv
    r = rinv if single else rinv.unsqueeze(1)
    products = [torch.mm(q, v.reshape(-1, C).T) for v in values]
    scores = stacked(products).view(shape) * r  # q_j . RMSNorm(v_s)
    logits = scores
    if bias is not None:  # any tensor of m S numbers, a query's row after another (as the kernels)
        per_read = shape[:1 if single else 2] + (1,) * (len(tokens) + 1)
        logits = scores + upcast(bias).reshape(m, -1).T.reshape(per_read)
    if prior_lse is not None:  # the prior: one more source, value prior_mixed, logit prior_lse
        logits = torch.cat([logits, prior_lse.view((1,) + prior_lse.shape + (1,))])
        values = values + [upcast(prior_mixed)]
    if single:  # no one merges a single query's read further: no lse
        lse, weights = None, torch.softmax(logits, 0)
    else:
        lse = torch.logsumexp(logits, 0)
        weights = torch.exp(logits - lse)
        lse = lse.squeeze(-1)
    w = weights.unbind()
    mixed = w[0] * values[0]
    for w_s, v in zip(w[1:], values[1:]):
        mixed = torch.addcmul(mixed, w_s, v)
    return mixed, lse, (rinv, scores, weights)


def mix_torch_backward(queries, bias, sources, prior_mixed, saved, grad_mixed, grad_lse, grads):
    """mix_torch's backward (the equations above): each source's gradient in a new tensor (grads[s]
    None) or added to grads[s] (in the computing precision) -> the queries' gradient, [the bias's]
    + [the prior's two] where given, and the sources' gradients (grads[s] itself where given);
    grad_mixed None: only lse was used."""
    rinv, scores, weights = saved
    if grad_mixed is None:
        grad_mixed = weights.new_zeros(weights.shape[1:-1] + sources[0].shape[-1:])
    g, q, S = upcast(grad_mixed), upcast(queries), len(sources)
    values = [upcast(v) for v in sources] + ([] if prior_mixed is None else [upcast(prior_mixed)])
    (m, C), single = q.shape, g.dim() == values[0].dim()
    N = values[0].numel() // C
    # g_j . v_s per token: a batch of N (1, C) x (C, m) products per source (on a CPU faster than a
    # product and a sum over an (m, B, T, C) temporary); a prior of m queries (a row per query, not
    # a source all read) in a product and a sum
    read_by_all = values if single or prior_mixed is None else values[:S]
    G = g.reshape(-1 if single else m, N, C).permute(1, 2, 0)  # (N, C, m)
    gv = stacked([torch.bmm(v.reshape(N, 1, C), G) for v in read_by_all])  # (S, N, 1, m)
    if single:
        gv = gv.view(weights.shape)
    else:
        gv = gv.view(gv.shape[:1] + values[0].shape[:-1] + (m,)).movedim(-1, 1).unsqueeze(-1)
        if prior_mixed is not None:
            gv = torch.cat([gv, (g * values[S]).sum(-1, keepdim=True).unsqueeze(0)])
    # w (g.v - g.out), g.out = sum_s w_s g.v_s: softmax's backward in one operator; + w h for lse's
    # gradient h (the prior's row, if any, last)
    grad_logits = torch.ops.aten._softmax_backward_data(gv, weights, 0, weights.dtype)
    if grad_lse is not None:
        grad_logits = torch.addcmul(grad_logits, weights, upcast(grad_lse).unsqueeze(-1))
    own = grad_logits if prior_mixed is None else grad_logits[:S]
    scaled = own * (rinv if single else rinv.unsqueeze(1))  # dl_js r_s
    along = scaled * scores if single else (scaled * scores).sum(1)
    along = along * rinv  # (r_s^2 sum_j dl_js r_s v_s.q_j; the 1 / C below)
    dq, out = None, []
    g_rows = (g,) if single else g.unbind()
    w, sc, al = weights.unbind(), scaled.unbind(), along.unbind()
    for s, v in enumerate(values[:S]):
        w_rows, dv, rows = (w[s],) if single else w[s].unbind(), grads[s], range(len(g_rows))
        if dv is None:
            dv, rows = w_rows[0] * g_rows[0], rows[1:]
        for j in rows:
            dv.addcmul_(w_rows[j], g_rows[j])
        dv.view(N, C).addmm_(sc[s].view(m, N).T, q)
        dv.addcmul_(v, al[s], value=-1.0 / C)
        v = v.reshape(N, C)
        dq = sc[s].view(m, N) @ v if dq is None else dq.addmm_(sc[s].view(m, N), v)
        out.append(dv)
    extra = []
    if bias is not None:
        db = own.flatten(1 if single else 2).sum(-1)  # (S, [m])
        extra.append((db if single else db.T).reshape(bias.shape).to(bias.dtype))
    if prior_mixed is not None:
        extra += [(w[S] * g).to(prior_mixed.dtype), grad_logits[S].squeeze(-1)]
    return dq.to(queries.dtype), extra, out


class Matched(NamedTuple):
    """A detail that the kernels read matched to its state's RMS (WAV's rms_match: D~ = s D, s =
    min(rho, RMS(state) / (RMS(D) + eps)) per token, detached): they compute s as they read D, from
    the RMS of the state, the last source before it in the read that is not matched, so that no
    matched copy (nor s) is written, and the backward gives D the gradient s dD~ in the same
    pass."""
    detail: Tensor
    state: Tensor
    rho: float


def match_flags(sources):
    """A list of sources, tensors or Matched -> the tensors, whether each is matched (1) or not
    (0), and the matched details' rho (0 if none)."""
    state, rhos = None, set()
    for v in sources:
        if isinstance(v, Matched):
            assert v.state is state, "a matched detail must follow its state"
            rhos.add(float(v.rho))
        else:
            state = v
    tensors = [v.detail if isinstance(v, Matched) else v for v in sources]
    assert len(rhos) <= 1, "one rho per read"
    return tensors, [int(isinstance(v, Matched)) for v in sources], rhos.pop() if rhos else 0.


def rms_match_torch(details, state, rho, eps=MATCH_EPS):
    """WAV's detached RMS matching of several details to one state (residuals.rms_match for each):
    D~ = s D, s = min(rho, RMS(state) / (RMS(D) + eps)) per token, detached. Norms instead of
    pow/mean/sqrt, and the state's RMS once: about half the operators."""
    C = state.shape[-1]
    norm = lambda v: torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=upcast(v).dtype)
    with torch.no_grad():
        state_norm = norm(state)
        scales = [(state_norm / (norm(d) + eps * math.sqrt(C))).clamp_(max=rho) for d in details]
    return [d * s.to(d.dtype) for d, s in zip(details, scales)]


# ------------------------------------------------------------------------------- the Triton kernels
#
# One program per tile of BT tokens (token_tile), (queries, tokens, channels) blocks. The sources
# and the queries' rows are read through `table`, one int64 tensor of addresses and flags (see
# source_table), so that no source is stacked or copied and every row is its own tensor.

if triton is not None:
    @triton.jit
    def _depth_mix_fwd(table,      # (5S + 2M,) int64: see source_table
                       LOW,        # any source in the other dtype (its pointer type), or OUT
                       Q,          # (M, C) the queries
                       BIAS,       # (M, S) or None
                       PRIOR,      # (M, N, C) or None: the prior's mixed
                       PRIOR_LSE,  # (M, N) or None
                       OUT,        # the first row's mixed (its pointer type)
                       LSE,        # the first row's lse (its pointer type)
                       S, M, N, C, eps, rho, match_eps,
                       HAS_BIAS: tl.constexpr, HAS_PRIOR: tl.constexpr, ACC: tl.constexpr,
                       BM: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # a tile of BT tokens: (queries, tokens, channels) blocks, (queries, tokens) statistics
        toks = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        rows, cols = tl.arange(0, BM), tl.arange(0, BC)
        rmask, tmask, cmask = rows < M, toks < N, cols < C
        stat_at, stat_mask = rows[:, None] * N + toks[None, :], rmask[:, None] & tmask[None, :]
        v_at, v_mask = toks[:, None] * C + cols[None, :], tmask[:, None] & cmask[None, :]
        at = rows[:, None, None] * N * C + v_at[None, :, :]  # (a prior: a row per query)
        mask = stat_mask[:, :, None] & cmask[None, None, :]
        # each query's rows of the outputs (mixed, lse) by their addresses, table[3S + j] and
        # table[3S + M + j]: separate tensors, whose gradients reach the backward as they are
        out = tl.load(table + 3 * S + rows, mask=rmask, other=0)
        out = out.to(tl.pointer_type(OUT.dtype.element_ty))
        lse_out = tl.load(table + 3 * S + M + rows, mask=rmask, other=0)
        lse_out = lse_out.to(tl.pointer_type(LSE.dtype.element_ty))
        q = tl.load(Q + rows[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.).to(ACC)
        if HAS_PRIOR:  # the sources read before: one more source, with its log-sum-exp as its logit
            run_max = tl.load(PRIOR_LSE + stat_at, mask=stat_mask, other=0.).to(ACC)
            run_sum = tl.full((BM, BT), 1., ACC)
            acc = tl.load(PRIOR + at, mask=mask, other=0.).to(ACC)
        else:
            run_max = tl.full((BM, BT), float('-inf'), ACC)
            run_sum = tl.zeros((BM, BT), ACC)
            acc = tl.zeros((BM, BT, BC), ACC)
        state_ss = tl.zeros((BT,), ACC)  # the sum of squares of the last source not matched
        for s in range(S):  # online softmax over the sources: each is read once, in its dtype
            addr = tl.load(table + s)  # (inline: the interpreter is slow to call a jit function)
            if tl.load(table + S + s) == 0:  # table[S + s]: 0 OUT's dtype, 1 LOW's
                v = tl.load(addr.to(tl.pointer_type(OUT.dtype.element_ty)) + v_at, mask=v_mask,
                            other=0.).to(ACC)
            else:
                v = tl.load(addr.to(tl.pointer_type(LOW.dtype.element_ty)) + v_at, mask=v_mask,
                            other=0.).to(ACC)
            ss = tl.sum(v * v, axis=1)
            if tl.load(table + 2 * S + s) != 0:  # a matched detail: scaled to its state's RMS
                v *= tl.minimum(tl.sqrt(state_ss / C) / (tl.sqrt(ss / C) + match_eps), rho)[:, None]
                ss = tl.sum(v * v, axis=1)
            else:
                state_ss = ss
            r = 1 / tl.sqrt(ss / C + eps)
            logit = r[None, :] * tl.sum(q[:, None, :] * v[None, :, :], axis=2)
            if HAS_BIAS:
                logit += tl.load(BIAS + rows * S + s, mask=rmask, other=0.).to(ACC)[:, None]
            new_max = tl.maximum(run_max, logit)
            old, p = tl.exp(run_max - new_max), tl.exp(logit - new_max)
            run_sum = run_sum * old + p
            acc = acc * old[:, :, None] + p[:, :, None] * v[None, :, :]
            run_max = new_max
        mixed = acc / run_sum[:, :, None]
        tl.store(out[:, None, None] + v_at[None, :, :], mixed.to(OUT.dtype.element_ty), mask=mask)
        tl.store(lse_out[:, None] + toks[None, :], run_max + tl.log(run_sum), mask=stat_mask)

    @triton.jit
    def _depth_mix_bwd(table,        # (5S + 4M,) int64: see source_table
                       LOW,          # as in the forward
                       Q,            # (M, C)
                       BIAS,         # (M, S) or None
                       PRIOR,        # (M, N, C) or None
                       PRIOR_LSE,    # (M, N) or None
                       OUT,          # the first row's mixed (its pointer type)
                       LSE,          # the first row's lse (its pointer type)
                       G,            # a row's gradient of mixed (its pointer type)
                       GLSE,         # a row's gradient of lse (its pointer type)
                       DQ,           # (programs, M, C) each program's partial sum
                       DB,           # (programs, M, S) or None: likewise
                       D_PRIOR,      # (M, N, C) or None
                       D_PRIOR_LSE,  # (M, N) or None
                       S, M, N, C, eps, rho, match_eps,
                       HAS_BIAS: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_GLSE: tl.constexpr,
                       ACC: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                       BS: tl.constexpr):
        pid, programs = tl.program_id(0), tl.num_programs(0)
        rows, cols, srcs = tl.arange(0, BM), tl.arange(0, BC), tl.arange(0, BS)
        rmask, cmask = rows < M, cols < C
        q = tl.load(Q + rows[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.).to(ACC)
        # each query's rows by their addresses, as in the forward: table[5S + j] its mixed, then its
        # lse, then their gradients (address 0: none, read as zeros)
        rows_at = table + 5 * S + rows
        out = tl.load(rows_at, mask=rmask, other=0).to(tl.pointer_type(OUT.dtype.element_ty))
        lse_rows = tl.load(rows_at + M, mask=rmask, other=0)
        lse_rows = lse_rows.to(tl.pointer_type(LSE.dtype.element_ty))
        g_rows = tl.load(rows_at + 2 * M, mask=rmask, other=0)
        glse_rows = tl.load(rows_at + 3 * M, mask=rmask, other=0)
        g_given, glse_given = g_rows != 0, glse_rows != 0
        g_rows = g_rows.to(tl.pointer_type(G.dtype.element_ty))
        glse_rows = glse_rows.to(tl.pointer_type(GLSE.dtype.element_ty))
        dq = tl.zeros((BM, BC), ACC)
        db = tl.zeros((BM, BS), ACC)
        for tile in range(pid, tl.cdiv(N, BT), programs):  # every programs-th tile of BT tokens
            # int64 tokens (the interpreter: Python ints)
            toks = (pid.to(tl.int64) + (tile - pid)) * BT + tl.arange(0, BT)
            tmask = toks < N
            stat_at, stat_mask = rows[:, None] * N + toks[None, :], rmask[:, None] & tmask[None, :]
            v_at, v_mask = toks[:, None] * C + cols[None, :], tmask[:, None] & cmask[None, :]
            at = rows[:, None, None] * N * C + v_at[None, :, :]  # (a prior's)
            mask = stat_mask[:, :, None] & cmask[None, None, :]
            g = tl.load(g_rows[:, None, None] + v_at[None, :, :],
                        mask=mask & g_given[:, None, None], other=0.).to(ACC)
            mixed = tl.load(out[:, None, None] + v_at[None, :, :], mask=mask, other=0.).to(ACC)
            g_out = tl.sum(g * mixed, axis=2)
            g_lse = tl.zeros((BM, BT), ACC)
            if HAS_GLSE:
                g_lse = tl.load(glse_rows[:, None] + toks[None, :],
                                mask=stat_mask & glse_given[:, None], other=0.).to(ACC)
            lse = tl.load(lse_rows[:, None] + toks[None, :], mask=stat_mask, other=0.).to(ACC)
            if HAS_PRIOR:
                prior = tl.load(PRIOR + at, mask=mask, other=0.).to(ACC)
                prior_lse = tl.load(PRIOR_LSE + stat_at, mask=stat_mask, other=0.).to(ACC)
                w = tl.where(stat_mask, tl.exp(prior_lse - lse), 0.)
                tl.store(D_PRIOR + at, (w[:, :, None] * g).to(D_PRIOR.dtype.element_ty), mask=mask)
                d_prior_lse = w * (tl.sum(g * prior, axis=2) - g_out + g_lse)
                tl.store(D_PRIOR_LSE + stat_at, d_prior_lse.to(D_PRIOR_LSE.dtype.element_ty),
                         mask=stat_mask)
            state_ss = tl.zeros((BT,), ACC)
            for s in range(S):  # as in the forward
                addr, low = tl.load(table + s), tl.load(table + S + s)
                if low == 0:
                    v = tl.load(addr.to(tl.pointer_type(OUT.dtype.element_ty)) + v_at,
                                mask=v_mask, other=0.).to(ACC)
                else:
                    v = tl.load(addr.to(tl.pointer_type(LOW.dtype.element_ty)) + v_at,
                                mask=v_mask, other=0.).to(ACC)
                ss, scale = tl.sum(v * v, axis=1), tl.full((BT,), 1., ACC)
                if tl.load(table + 2 * S + s) != 0:
                    scale = tl.minimum(tl.sqrt(state_ss / C) / (tl.sqrt(ss / C) + match_eps), rho)
                    v *= scale[:, None]
                    ss = tl.sum(v * v, axis=1)
                else:
                    state_ss = ss
                r = 1 / tl.sqrt(ss / C + eps)
                score = r[None, :] * tl.sum(q[:, None, :] * v[None, :, :], axis=2)
                logit = score
                if HAS_BIAS:
                    logit += tl.load(BIAS + rows * S + s, mask=rmask, other=0.).to(ACC)[:, None]
                w = tl.where(stat_mask, tl.exp(logit - lse), 0.)
                dl = w * (tl.sum(g * v[None, :, :], axis=2) - g_out + g_lse)  # d loss / d logit
                dv = (tl.sum(w[:, :, None] * g, axis=0)
                      + r[:, None] * tl.sum(dl[:, :, None] * q[:, None, :], axis=0)
                      - (r * r * tl.sum(dl * score, axis=0) / C)[:, None] * v)
                dv = dv * scale[:, None]  # (s detached)
                # each source's gradient in its dtype, written, or added (table[4S + s] = 1) to
                # what other reads of it wrote there
                dv_at, add = tl.load(table + 3 * S + s), tl.load(table + 4 * S + s)
                if low == 0:  # (no name may hold two pointer types: the compiler refuses)
                    dv_hi = dv_at.to(tl.pointer_type(OUT.dtype.element_ty)) + v_at
                    if add != 0:
                        dv += tl.load(dv_hi, mask=v_mask, other=0.).to(ACC)
                    tl.store(dv_hi, dv.to(OUT.dtype.element_ty), mask=v_mask)
                else:
                    dv_lo = dv_at.to(tl.pointer_type(LOW.dtype.element_ty)) + v_at
                    if add != 0:
                        dv += tl.load(dv_lo, mask=v_mask, other=0.).to(ACC)
                    tl.store(dv_lo, dv.to(LOW.dtype.element_ty), mask=v_mask)
                dq += tl.sum((dl * r[None, :])[:, :, None] * v[None, :, :], axis=1)
                if HAS_BIAS:
                    db += tl.where(srcs[None, :] == s, tl.sum(dl, axis=1)[:, None], 0.)
        tl.store(DQ + pid * M * C + rows[:, None] * C + cols[None, :], dq,
                 mask=rmask[:, None] & cmask[None, :])
        if HAS_BIAS:
            tl.store(DB + pid * M * S + rows[:, None] * S + srcs[None, :], db,
                     mask=rmask[:, None] & (srcs[None, :] < S))


def readable(sources, dtype):
    """The depth-mix kernels read each source in the mix's dtype or in one other (under autocast: a
    float32 e beside bfloat16 updates) through its own pointer type, so nothing is copied to one
    dtype; a source of a third dtype is (a temporary copy). -> (the sources, contiguous, and one of
    the other dtype for its pointer type, or None)."""
    others = other_dtypes(sources, dtype)
    low = others.pop() if len(others) == 1 else dtype
    sources = [v.contiguous() if v.dtype in (dtype, low) else v.to(dtype).contiguous()
               for v in sources]
    return sources, next((v for v in sources if v.dtype != dtype), None)


def source_table(sources, match, dtype, grads=(), add=(), rows=()):
    """One table for a depth-mix kernel (one copy to the GPU): the sources' addresses, their kinds
    (0: `dtype`, 1: the other), whether each is a matched detail (1; see Matched), backward the
    addresses of their gradients and whether each is written (0) or added to (1), then the
    addresses of the queries' rows (0: a gradient that is none)."""
    table = [v.data_ptr() for v in sources] + [int(v.dtype != dtype) for v in sources] + list(match)
    table += [g.data_ptr() for g in grads] + list(add)
    table += [0 if t is None else t.data_ptr() for t in rows]
    return on_device(table, sources[0].device)


def contiguous(t):
    """t contiguous, or None."""
    return None if t is None else t.contiguous()


def read_inputs(queries, bias, prior_mixed, prior_lse, mixed, lse, low):
    """The arguments of both depth-mix kernels that give a read's inputs and the types of its rows
    (the kernels take the rows themselves by their addresses in the table)."""
    return dict(LOW=mixed[0] if low is None else low,  # (its pointer type)
                Q=queries.contiguous(),                # (m, C)
                BIAS=contiguous(bias),                 # (m, S) or None
                PRIOR=contiguous(prior_mixed),         # (m, B, T, C) or None
                PRIOR_LSE=contiguous(prior_lse),       # (m, B, T) or None
                OUT=mixed[0],                          # (its pointer type)
                LSE=lse[0])                            # (its pointer type)


# ----------------------------------------------------------------------------------- the custom ops

@torch.library.custom_op('resroute::depth_mix', mutates_args=())
def _triton_depth_mix(queries: Tensor, bias: Optional[Tensor], sources: List[Tensor],
                      match: List[int], rho: float, prior_mixed: Optional[Tensor],
                      prior_lse: Optional[Tensor],
                      single: bool) -> Tuple[List[Tensor], List[Tensor]]:
    """The m queries' rows, mixed (B, T, C) and lse (B, T) each: DepthMix's (m, B, T, C) and
    (m, B, T) as separate tensors. The sources with match[s] = 1 are read matched (Matched, rho).
    A prior: (m, B, T, C) and (m, B, T), or a row each for one query. single: one query's read,
    whose lse no one reads. The bias: any contiguous tensor of m S numbers (a query's row after
    another); its gradient has its shape."""
    dtype = _mix_dtype(sources, prior_mixed)
    acc, acc_tl = accumulator(dtype)
    sources, low = readable(sources, dtype)
    (m, C), S, N = queries.shape, len(sources), sources[0].numel() // queries.shape[1]
    mixed = [sources[0].new_empty(sources[0].shape, dtype=dtype) for _ in range(m)]
    lse = [torch.empty(sources[0].shape[:-1], device=queries.device, dtype=acc) for _ in range(m)]
    BT = token_tile(m, C, N)
    _depth_mix_fwd[(triton.cdiv(N, BT),)](
        table=source_table(sources, match, dtype, rows=mixed + lse),
        **read_inputs(queries, bias, prior_mixed, prior_lse, mixed, lse, low),
        S=S, M=m, N=N, C=C, eps=RMS_EPS, rho=rho, match_eps=MATCH_EPS,
        HAS_BIAS=bias is not None, HAS_PRIOR=prior_mixed is not None, ACC=acc_tl,
        BM=next_pow2(m), BT=BT, BC=next_pow2(C))
    return mixed, lse


@_triton_depth_mix.register_fake
def _(queries, bias, sources, match, rho, prior_mixed, prior_lse, single):
    shape, dtype, m = sources[0].shape, _mix_dtype(sources, prior_mixed), len(queries)
    return ([sources[0].new_empty(shape, dtype=dtype) for _ in range(m)],
            [queries.new_empty(shape[:-1], dtype=accumulator(dtype)[0]) for _ in range(m)])


def saved_rows(ctx, mixed, lse, single):
    """The rows a read saves for its backward (rows_saved unpacks them): mixed and lse; a single
    query's lse (single) has no reader after the read: it is marked non-differentiable and kept on
    ctx instead (autograd detaches each output it saves, once when saved and once when unpacked; a
    tensor without a graph node makes no reference cycle there) -> the rows to save."""
    ctx.rows, ctx.lse = len(mixed), lse if single else None
    if single:
        ctx.mark_non_differentiable(*lse)
        return [*mixed]
    return [*mixed, *lse]


def rows_saved(ctx, saved):
    """saved_rows's rows at the head of `saved` -> mixed, lse, the rest."""
    m = ctx.rows
    if ctx.lse is not None:
        return saved[:m], ctx.lse, saved[m:]
    return saved[:m], saved[m:2 * m], saved[2 * m:]


def _depth_mix_setup(ctx, inputs, output):
    queries, bias, sources, match, rho, prior_mixed, prior_lse, single = inputs
    ctx.match = match, rho
    rows = saved_rows(ctx, *output, single)
    ctx.save_for_backward(queries, bias, prior_mixed, prior_lse, *rows, *sources)
    # an unused row gets no gradient (the kernel reads zeros), not a tensor of zeros
    ctx.set_materialize_grads(False)


def _depth_mix_grads(ctx, grad_mixed, grad_lse):
    queries, bias, prior_mixed, prior_lse, *saved = ctx.saved_tensors
    mixed, lse, sources = rows_saved(ctx, saved)
    dq, grads, extra = _triton_depth_mix_backward(queries, bias, sources, *ctx.match, prior_mixed,
                                                  prior_lse, mixed, lse, grad_mixed, grad_lse)
    extra = iter(extra)
    db = next(extra) if bias is not None else None
    return dq, db, grads, None, None, next(extra, None), next(extra, None), None


_triton_depth_mix.register_autograd(_depth_mix_grads, setup_context=_depth_mix_setup)


@torch.library.custom_op('resroute::depth_mix_backward', mutates_args=())
def _triton_depth_mix_backward(queries: Tensor, bias: Optional[Tensor], sources: List[Tensor],
                               match: List[int], rho: float, prior_mixed: Optional[Tensor],
                               prior_lse: Optional[Tensor], mixed: List[Tensor],
                               lse: List[Tensor], grad_mixed: List[Optional[Tensor]],
                               grad_lse: List[Optional[Tensor]]
                               ) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
    """The gradients of the queries, of the sources, and of the bias and the prior where given,
    from the rows' gradients (None: none)."""
    dtypes = [v.dtype for v in sources]
    sources = readable(sources, mixed[0].dtype)[0]
    grads = [torch.empty_like(v) for v in sources]
    dq, extra = _depth_mix_backward_into(queries, bias, sources, match, rho, prior_mixed,
                                         prior_lse, mixed, lse, grad_mixed, grad_lse, grads,
                                         [0] * len(sources))
    return dq, [cast(g, t) for g, t in zip(grads, dtypes)], extra


@_triton_depth_mix_backward.register_fake
def _(queries, bias, sources, match, rho, prior_mixed, prior_lse, mixed, lse, grad_mixed,
      grad_lse):
    extra = [torch.empty_like(t) for t in (bias, prior_mixed, prior_lse) if t is not None]
    return torch.empty_like(queries), [torch.empty_like(v) for v in sources], extra


def _depth_mix_backward_into(queries, bias, sources, match, rho, prior_mixed, prior_lse, mixed,
                             lse, grad_mixed, grad_lse, grads, add):
    """The backward kernel's launch: each source's gradient written into, or added (add[s] = 1)
    to, grads[s]; -> the queries' gradient, [the bias's] + [the prior's two] where given. The rows
    (mixed, lse) and their gradients (None: none) by their addresses."""
    dtype = mixed[0].dtype
    sources, low = readable(sources, dtype)
    acc, acc_tl = accumulator(dtype)
    (m, C), S, N = queries.shape, len(sources), sources[0].numel() // queries.shape[1]
    BT = token_tile(m, C, N)
    programs = reduction_programs(triton.cdiv(N, BT))
    dq = torch.empty((programs, m, C), device=queries.device, dtype=acc)
    db = None
    if bias is not None:
        db = torch.empty((programs,) + bias.shape, device=queries.device, dtype=acc)
    has_prior = prior_mixed is not None
    d_prior = torch.empty_like(prior_mixed) if has_prior else None
    d_prior_lse = torch.empty_like(prior_lse) if has_prior else None
    grad_mixed, grad_lse = [contiguous(g) for g in grad_mixed], [contiguous(g) for g in grad_lse]
    given = lambda rows, default: next((t for t in rows if t is not None), default)
    _depth_mix_bwd[(programs,)](
        table=source_table(sources, match, dtype, grads, add,
                           [*mixed, *lse, *grad_mixed, *grad_lse]),
        **read_inputs(queries, bias, prior_mixed, prior_lse, mixed, lse, low),
        G=given(grad_mixed, mixed[0]),  # (for their pointer types)
        GLSE=given(grad_lse, lse[0]),
        DQ=dq,
        DB=db,
        D_PRIOR=d_prior,
        D_PRIOR_LSE=d_prior_lse,
        S=S, M=m, N=N, C=C, eps=RMS_EPS, rho=rho, match_eps=MATCH_EPS,
        HAS_BIAS=bias is not None, HAS_PRIOR=has_prior,
        HAS_GLSE=given(grad_lse, None) is not None, ACC=acc_tl,
        BM=next_pow2(m), BT=BT, BC=next_pow2(C), BS=next_pow2(S))
    extra = [] if db is None else [db.sum(0).to(bias.dtype)]
    if has_prior:
        extra += [d_prior, d_prior_lse]
    return dq.sum(0).to(queries.dtype), extra


@torch.library.custom_op('resroute::depth_mix_backward_pooled', mutates_args=('grads',))
def _triton_depth_mix_backward_pooled(queries: Tensor, bias: Optional[Tensor],
                                      sources: List[Tensor], match: List[int], rho: float,
                                      mixed: List[Tensor], lse: List[Tensor],
                                      grad_mixed: List[Optional[Tensor]],
                                      grad_lse: List[Optional[Tensor]], grads: List[Tensor],
                                      add: List[int]) -> Tuple[Tensor, List[Tensor]]:
    """A pooled read's backward (PooledRead): the sources' gradients into `grads`."""
    return _depth_mix_backward_into(queries, bias, sources, match, rho, None, None, mixed, lse,
                                    grad_mixed, grad_lse, grads, add)


@_triton_depth_mix_backward_pooled.register_fake
def _(queries, bias, sources, match, rho, mixed, lse, grad_mixed, grad_lse, grads, add):
    return torch.empty_like(queries), [] if bias is None else [torch.empty_like(bias)]


# ------------------------------------------------------------------------------------ the Functions

class DepthMix(torch.autograd.Function):
    """m queries read a list of S sources in PyTorch (mix_torch), with its hand-written backward.
    queries (m, C), bias (m, S) or None -> mixed (m, B, T, C), lse (m, B, T); single (m = 1): (B, T,
    C), None; a prior (mixed_0, lse_0) of sources read before is merged as one more source. It saves
    per-token numbers (1/RMS per source; scores and weights per query and source) and references to
    the sources, never a stacked copy (with plain autograd, Full AttnRes keeps an (S, B, T, C) stack
    per sublayer: L^2 memory; on a CPU, passes over a temporary stack of the sources cost 1.2-5x the
    time, measured). The kernels' twin: the custom op _triton_depth_mix."""

    @staticmethod
    def forward(ctx, queries, bias, prior_mixed, prior_lse, single, *sources):
        mixed, lse, saved = mix_torch(queries, bias, sources, prior_mixed, prior_lse, single)
        ctx.save_for_backward(queries, bias, prior_mixed, *saved, *sources)
        # an unused lse gets no gradient, rather than a tensor of zeros
        ctx.set_materialize_grads(False)
        return cast(mixed, _mix_dtype(sources, prior_mixed)), lse

    @staticmethod
    def backward(ctx, grad_mixed, grad_lse):
        queries, bias, prior_mixed, *saved = ctx.saved_tensors
        saved, sources = saved[:3], saved[3:]
        dq, extra, grads = mix_torch_backward(queries, bias, sources, prior_mixed, saved,
                                              grad_mixed, grad_lse, [None] * len(sources))
        extra = iter(extra)
        db = next(extra) if bias is not None else None
        sources_grads = [cast(g, v.dtype) for g, v in zip(grads, sources)]
        return dq, db, next(extra, None), next(extra, None), None, *sources_grads


class PooledRead(torch.autograd.Function):
    """One depth read of a Reads' pooled sources (see Reads): forward as an unpooled read; backward,
    each source's share is added into its pooled gradient, and the gradients of the sources this
    read owns (it read them first) are returned. The backend's work is the Reads' (forward_pooled,
    backward_pooled)."""

    @staticmethod
    def forward(ctx, queries, bias, reads, keys, owned, single, match, *sources):
        out = reads.forward_pooled(ctx, queries, bias, sources, match, single)
        ctx.reads, ctx.keys, ctx.owned, ctx.match = reads, keys, owned, match
        # an unused lse gets no gradient, rather than a tensor of zeros
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, *grad_out):
        dq, db, sources = ctx.reads.backward_pooled(ctx, grad_out)
        owned = [cast(ctx.reads.pool.take(key), v.dtype) if own else None
                 for key, own, v in zip(ctx.keys, ctx.owned, sources)]
        return dq, db, None, None, None, None, None, *owned


# ---------------------------------------------------------------------------------------- the reads

def unbound_rows(mixed, lse, single):
    """A read's outputs, mixed (m, B, T, C) and lse (m, B, T), as its m rows [(mixed, lse)]; one
    (m = 1): [(mixed, None)] as they are."""
    return [(mixed, lse)] if single else list(zip(mixed.unbind(), lse.unbind()))


class Reads:
    """The depth reads of one forward, in PyTorch (TritonReads: with the kernels); reads(backend)
    makes one. Three reads, by how many queries read and whether a prior row is given (a row: a
    read left open for more sources, (mixed (B, T, C), lse (B, T))):

        many(queries, sources, bias)       phase 1: m queries read the same sources -> m rows
        continued(row, query, more, bias)  phase 2: a query's row merges `more` -> (B, T, C)
        one(query, sources, bias)          a query reads, no prior (output mixers) -> (B, T, C)

    and matched(details, state, rho), WAV's RMS-matched details as the reads take them.

    The sources that many and one read are the finished sources of the forward, which every later
    block's phase-1 read and the output mixer read again: in eager mode each has one gradient, in
    a GradPool, which every read's backward adds its share to and its first reader hands to
    autograd (autograd's own sum per later reader and source cost WAV at 12 layers 9.7 operators
    per sublayer with the kernels). Compiled, the compiler plans the sums."""

    def __init__(self):
        self.pooled = not torch.compiler.is_compiling()
        self.seen, self.pool, self.rinv = set(), GradPool(), {}

    # the three reads
    def many(self, queries, sources, bias):
        """Phase 1: queries (m, C) read the same sources in one pass, bias (m, S) or None -> the m
        rows, separate tensors (indexing row k of one tensor would give every row's backward a
        zero gradient of the whole size)."""
        return self.pool_read(queries, bias, sources, False)

    def continued(self, row, query, more, bias):
        """Phase 2: one query (1, C) continues its row from phase 1, merging the sources `more`
        that it alone reads (bias (1, S) or None) by an online softmax, in the same pass that reads
        them -> (B, T, C); the row's mixed as it is when there are none."""
        return self.rows(query, bias, more, row, single=True)[0][0] if more else row[0]

    def one(self, query, sources, bias):
        """One query (1, C) reads the sources, with no prior -> (B, T, C)."""
        return self.pool_read(query, bias, sources, True)[0][0]

    def matched(self, details, state, rho):
        """The details RMS-matched to their state (WAV): copies, matched here."""
        return rms_match_torch(details, state, rho) if details else []

    # a read of the backend, unpooled
    def rows(self, queries, bias, sources, prior=None, single=False):
        """m queries (m, C) read S sources, merged with a prior (mixed (m, B, T, C), lse (m, B, T))
        or None -> the m rows [(mixed, lse)]; single (m = 1): [(mixed, None)] (no lse: no one merges
        a single query's read further). The autograd Function's rows are unbound once."""
        prior_mixed, prior_lse = (None, None) if prior is None else prior
        out = DepthMix.apply(queries, bias, prior_mixed, prior_lse, single, *sources)
        return unbound_rows(*out, single)

    # the pool
    def poolable(self, keys, tensors):
        """Whether a read of these sources can go through the pool: each source once."""
        return self.pooled and len(set(keys)) == len(keys)

    def pool_read(self, queries, bias, sources, single):
        keys = [id(v) for v in sources]  # (a Matched: a source of its own)
        tensors, match, rho = match_flags(sources)
        if not self.poolable(keys, tensors):
            return self.rows(queries, bias, sources, single=single)
        owned = [key not in self.seen for key in keys]
        self.seen.update(keys)
        out = PooledRead.apply(queries, bias, self, keys, owned, single, (match, rho), *tensors)
        return self.pooled_rows(out, single)

    def cached_rms_inverse(self, sources):
        """The sources' 1/RMS (S, B, T, 1), each source's computed once per forward."""
        new = [v for v in sources if id(v) not in self.rinv]
        if new:
            rinv = stacked_rms_inverse([upcast(v) for v in new]).unbind()
            self.rinv.update(zip(map(id, new), rinv))
        return stacked([self.rinv[id(v)] for v in sources])

    def forward_pooled(self, ctx, queries, bias, sources, match, single):
        """PooledRead's forward: the read, and what its backward needs saved on ctx."""
        mixed, lse, saved = mix_torch(queries, bias, sources, None, None, single,
                                      self.cached_rms_inverse(sources))
        ctx.save_for_backward(queries, bias, *saved, *sources)
        return cast(mixed, common_dtype(sources)), lse

    def pooled_rows(self, out, single):
        """PooledRead's outputs as rows (see rows)."""
        return unbound_rows(*out, single)

    def backward_pooled(self, ctx, grad_out):
        """PooledRead's backward: each source's share added into its pooled gradient (in the
        computing precision) -> the queries' and the bias's gradients, and the sources."""
        (grad_mixed, grad_lse), (queries, bias, rinv, scores, weights, *sources) = (
            grad_out, ctx.saved_tensors)
        shares = [self.pool.share(key) for key in ctx.keys]
        saved = rinv, scores, weights
        dq, extra, shares = mix_torch_backward(queries, bias, sources, None, saved, grad_mixed,
                                               grad_lse, shares)
        for key, share in zip(ctx.keys, shares):
            self.pool.put(key, share)
        return dq, extra[0] if bias is not None else None, sources


class TritonReads(Reads):
    """Reads with the Triton kernels: each read one launch forward and one backward; the rows are
    separate tensors from the kernel; a matched detail (Matched) is matched by the read that reads
    it."""

    def matched(self, details, state, rho):
        return [Matched(d, state, rho) for d in details]

    def rows(self, queries, bias, sources, prior=None, single=False):
        prior_mixed, prior_lse = (None, None) if prior is None else prior
        mixed, lse = _triton_depth_mix(queries, bias, *match_flags(sources), prior_mixed, prior_lse,
                                       single)
        return list(zip(mixed, lse))

    def poolable(self, keys, tensors):
        """As Reads', and of two dtypes at most (a third is promoted: a copy, read unpooled)."""
        two_dtypes = len(other_dtypes(tensors, common_dtype(tensors))) <= 1
        return two_dtypes and super().poolable(keys, tensors)

    def forward_pooled(self, ctx, queries, bias, sources, match, single):
        mixed, lse = _triton_depth_mix(queries, bias, list(sources), *match, None, None, single)
        ctx.save_for_backward(queries, bias, *saved_rows(ctx, mixed, lse, single), *sources)
        return (*mixed, *lse)

    def pooled_rows(self, out, single):
        """The kernel's rows: the mixed, then the lse, each a tensor."""
        return list(zip(out[:len(out) // 2], out[len(out) // 2:]))

    def backward_pooled(self, ctx, grad_out):
        queries, bias, *saved = ctx.saved_tensors
        mixed, lse, sources = rows_saved(ctx, saved)
        add = [int(self.pool.share(key) is not None) for key in ctx.keys]
        for key, v in zip(ctx.keys, sources):
            if self.pool.share(key) is None:  # its last reader, the first to run backward
                self.pool.put(key, torch.empty(v.shape, dtype=v.dtype, device=v.device))
        grads = [self.pool.share(key) for key in ctx.keys]
        dq, extra = _triton_depth_mix_backward_pooled(
            queries, bias, sources, *ctx.match, mixed, lse, grad_out[:len(mixed)],
            grad_out[len(mixed):], grads, add)
        return dq, extra[0] if bias is not None else None, sources


def reads(backend):
    """The depth reads of one forward: the family's one choice of backend."""
    return TritonReads() if backend == 'triton' else Reads()
