"""
MGR: the fused step.

n streams s_j, started by e and the first n - 1 updates; each later sublayer's update u moves
every stream by its gate, s_j <- s_j + beta_j (u - s_j), beta from the streams' own RMS-normalised
scores (competitive: a softmax with a keep logit; independent: sigmoids), and the next sublayer
reads h = AttnPool(s) (residuals.MultiGateResiduals). One step, per token, with r_j = 1/RMS(s_j)
and r'_j = 1/RMS(s'_j), g and p the gate's and the pool's query:

    z_j = r_j s_j . g,   beta = softmax([b, z])[1:] (competitive) or sigmoid(z + b)
    s'_j = s_j + beta_j (u - s_j),   y_j = r'_j s'_j . p,   alpha = softmax(y)
    h = sum_j alpha_j s'_j

backward, from g_h and the new streams' gradients g'_j:

    dy_j = alpha_j g_h . (s'_j - h)
    ds'_j = g'_j + alpha_j g_h + dy_j r'_j (p - (y_j r'_j / C) s'_j)
    du = sum_j beta_j ds'_j,   dbeta_j = ds'_j . (u - s_j)
    dz: sigmoid's or the softmax's backward (with the keep logit b),   ds_j = (1 - beta_j) ds'_j
        + dz_j r_j (g - (z_j r_j / C) s_j)

One step does the gates, the update and the next AttnPool in one pass over the streams; its
backward can rebuild the step's input streams from its output by inverting the update, s_j =
(s'_j - beta_j u) / (1 - beta_j), so the steps keep one set of streams (MGRStep).
"""
from typing import Tuple

import torch
from torch import Tensor

from residuals import RMS_EPS, upcast

from .common import accumulator, cast, next_pow2, reduction_programs, rms_inverse, token_tile, tl, triton
from .depth_mix import reads


# ---------------------------------------------------------------------------- the PyTorch functions

def _gates(z, bias, competitive):
    """beta (n, N) from scores z (n, N): softmax with a keep logit, or independent sigmoids."""
    if competitive:
        return torch.softmax(torch.cat([bias.expand_as(z[:1]), z]), dim=0)[1:]
    return torch.sigmoid(z + bias)


def _rms_dot(x, query, r=None):
    """r = 1/RMS(x) (unless given) and the score r x.query, per stream and token: x (n, ..., C),
    query (C,) or (1, C) -> (n, ...), (n, ...)."""
    r = rms_inverse(x) if r is None else r
    return r, r * torch.mv(x.reshape(-1, x.shape[-1]), query.reshape(-1)).view(r.shape)


def mgr_step_torch(streams, u, gate_query, gate_bias, pool_query, competitive, keep, rinv=None):
    """The fused step in PyTorch: the gates from the input streams, the lerp, the AttnPool of the
    result. streams (n, *tokens, C), u (*tokens, C) (tokens: (B, T), or (N,)); queries (C,) or
    (1, C) already scaled by 1/sqrt(C); gate_bias (1,); rinv: the streams' 1/RMS if known (the step
    before took it for its AttnPool). Returns new streams, h (*tokens, C), beta and alpha
    (n, *tokens) (float32 for half precision), and the originals of the `keep` largest gates per
    token (indices (keep, *tokens), streams (keep, *tokens, C)) for the inversion, and for the
    backward the scores and 1/RMS of both (gates: the input streams, AttnPool: the new ones;
    (n, *tokens) each)."""
    s, u_wide = upcast(streams), upcast(u)
    r, z = _rms_dot(s, upcast(gate_query), rinv)
    beta = _gates(z, upcast(gate_bias), competitive)
    new = torch.lerp(s, u_wide, beta.unsqueeze(-1))  # s + beta (u - s)
    r2, y = _rms_dot(new, upcast(pool_query))
    alpha = torch.softmax(y, dim=0)
    h = (alpha.unsqueeze(-1) * new).sum(0)  # (einsum would run one tiny matmul per token on CPU)
    index = beta.topk(keep, dim=0).indices
    kept = streams.gather(0, index.unsqueeze(-1).expand(*index.shape, streams.shape[-1]))
    return cast(new, streams.dtype), cast(h, u.dtype), beta, alpha, index, kept, (r, z, r2, y)


def mgr_step_backward_torch(x, u, gate_query, gate_bias, pool_query, beta, alpha, index, kept,
                            grad_new, grad_h, competitive, invert, scores):
    """Backward of mgr_step_torch. x is the step's output streams when `invert` (the inputs are
    rebuilt from them, the kept originals put back), else its input streams (the outputs are
    recomputed); scores: the forward's (r, z, r2, y). Returns the grads of streams, u, gate_query,
    gate_bias, pool_query, and the (rebuilt) input streams."""
    x, u_wide, b = upcast(x), upcast(u), beta.unsqueeze(-1)
    kept_share = 1 - b
    if invert:
        new = x
        s = torch.addcmul(x, b, u_wide, value=-1).div_(kept_share)
        s.scatter_(0, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]), upcast(kept))
    else:
        s = x
        new = torch.lerp(s, u_wide, b)
    (r, z, r2, y), C, grad_h = scores, x.shape[-1], upcast(grad_h)
    # AttnPool: h = sum_j alpha_j s'_j, alpha = softmax(r'_j s'_j.w); in place where a pass is saved
    dy = torch.ops.aten._softmax_backward_data((new * grad_h).sum(-1), alpha, 0, alpha.dtype)
    d_new = torch.addcmul(upcast(grad_new), alpha.unsqueeze(-1), grad_h)
    scaled = dy * r2
    d_new.addcmul_(scaled.unsqueeze(-1), upcast(pool_query)).addcmul_(
        (scaled * r2 * y).unsqueeze(-1), new, value=-1 / C)
    grad_pool = torch.mv(new.reshape(-1, C).T, scaled.reshape(-1)).view_as(pool_query)
    # lerp: s' = s + beta (u - s)
    grad_u = (b * d_new).sum(0)
    d_beta = (d_new * (u_wide - s)).sum(-1)
    d_s = d_new.mul_(kept_share)
    # gates
    if competitive:
        # beta = softmax([b, z])[1:]: d b = sum -p_keep (beta . d_beta), p_keep = 1 - sum beta
        weighted = (beta * d_beta).sum(0)
        dz = beta * (d_beta - weighted)
        grad_bias = torch.dot(beta.sum(0).sub_(1).flatten(), weighted.flatten())
    else:
        dz = torch.ops.aten.sigmoid_backward(d_beta, beta)
        grad_bias = dz.sum()
    scaled = dz * r
    d_s.addcmul_(scaled.unsqueeze(-1), upcast(gate_query)).addcmul_(
        (scaled * r * z).unsqueeze(-1), s, value=-1 / C)
    grad_gate = torch.mv(s.reshape(-1, C).T, scaled.reshape(-1)).view_as(gate_query)
    return (d_s.to(x.dtype), grad_u.to(u.dtype), grad_gate, grad_bias.reshape(1), grad_pool, s)


# ------------------------------------------------------------------------------- the Triton kernels

if triton is not None:
    @triton.jit
    def _mgr_step_fwd(S,      # (n, N, C) the streams
                      U,      # (N, C) the update
                      VG,     # (C,) the gate query
                      VP,     # (C,) the pool query
                      BIAS,   # (1,) the gate bias
                      NEW,    # (n, N, C) out: the new streams
                      H,      # (N, C) out: the new streams' AttnPool
                      BETA,   # (n, N) out, ACC
                      ALPHA,  # (n, N) out, ACC
                      INDEX,  # (keep, N) out, int64
                      KEPT,   # (keep, N, C) out
                      n,
                      N,
                      C,
                      keep,
                      eps,
                      COMPETITIVE: tl.constexpr,
                      ACC: tl.constexpr,
                      BN: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # a tile of BT tokens: (streams, tokens, channels) blocks, (streams, tokens) gates and
        # weights
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        rows, cols = tl.arange(0, BN), tl.arange(0, BC)
        rmask, tmask, cmask = rows < n, t < N, cols < C
        tc, st = tmask[:, None] & cmask[None, :], rmask[:, None] & tmask[None, :]
        mask = st[:, :, None] & cmask[None, None, :]
        at = rows[:, None, None] * N * C + t[None, :, None] * C + cols[None, None, :]
        s = tl.load(S + at, mask=mask, other=0.).to(ACC)  # the n streams: read once
        u = tl.load(U + t[:, None] * C + cols[None, :], mask=tc, other=0.).to(ACC)
        vg = tl.load(VG + cols, mask=cmask, other=0.).to(ACC)[None, None, :]
        vp = tl.load(VP + cols, mask=cmask, other=0.).to(ACC)[None, None, :]
        b = tl.load(BIAS).to(ACC)
        z = 1 / tl.sqrt(tl.sum(s * s, axis=2) / C + eps) * tl.sum(s * vg, axis=2)
        if COMPETITIVE:  # softmax over [b, z_1..z_n], without the keep entry
            z = tl.where(rmask[:, None], z, float('-inf'))
            top = tl.maximum(tl.max(z, axis=0), b)
            e = tl.exp(z - top[None, :])
            beta = e / (tl.exp(b - top) + tl.sum(e, axis=0))[None, :]
        else:
            beta = tl.where(rmask[:, None], tl.sigmoid(z + b), 0.)
        new = s + beta[:, :, None] * (u[None, :, :] - s)
        tl.store(NEW + at, new.to(NEW.dtype.element_ty), mask=mask)
        y = 1 / tl.sqrt(tl.sum(new * new, axis=2) / C + eps) * tl.sum(new * vp, axis=2)
        y = tl.where(rmask[:, None], y, float('-inf'))
        alpha = tl.exp(y - tl.max(y, axis=0)[None, :])
        alpha = alpha / tl.sum(alpha, axis=0)[None, :]
        tl.store(H + t[:, None] * C + cols[None, :],
                 tl.sum(alpha[:, :, None] * new, axis=0).to(H.dtype.element_ty), mask=tc)
        tl.store(BETA + rows[:, None] * N + t[None, :], beta, mask=st)
        tl.store(ALPHA + rows[:, None] * N + t[None, :], alpha, mask=st)
        left = tl.where(rmask[:, None], beta, -1.)
        for k in range(keep):  # originals of the largest gates, for the inversion
            j = tl.min(tl.where(left == tl.max(left, axis=0)[None, :], rows[:, None], BN), axis=0)
            tl.store(INDEX + k * N + t, j.to(tl.int64), mask=tmask)
            original = tl.sum(tl.where(rows[:, None, None] == j[None, :, None], s, 0.), axis=0)
            tl.store(KEPT + k * N * C + t[:, None] * C + cols[None, :],
                     original.to(KEPT.dtype.element_ty), mask=tc)
            left = tl.where(rows[:, None] == j[None, :], -2., left)

    @triton.jit
    def _mgr_step_bwd(X,        # (n, N, C) the output streams if INVERT, else the input ones
                      U,        # (N, C)
                      VG,       # (C,)
                      VP,       # (C,)
                      BETA,     # (n, N)
                      ALPHA,    # (n, N)
                      INDEX,    # (keep, N)
                      KEPT,     # (keep, N, C)
                      G_NEW,    # (n, N, C)
                      G_H,      # (N, C)
                      D_S,      # (n, N, C) out
                      D_U,      # (N, C) out
                      REBUILT,  # (n, N, C) out, if INVERT
                      D_VG,     # (programs, C) out: partial sums
                      D_VP,     # (programs, C) out: partial sums
                      D_B,      # (programs,) out: partial sums
                      n,
                      N,
                      C,
                      keep,
                      eps,
                      COMPETITIVE: tl.constexpr,
                      INVERT: tl.constexpr,
                      ACC: tl.constexpr,
                      BN: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        pid, programs = tl.program_id(0), tl.num_programs(0)
        rows, cols = tl.arange(0, BN), tl.arange(0, BC)
        rmask, cmask = rows < n, cols < C
        vg = tl.load(VG + cols, mask=cmask, other=0.).to(ACC)[None, None, :]
        vp = tl.load(VP + cols, mask=cmask, other=0.).to(ACC)[None, None, :]
        d_vg = tl.zeros((BC,), ACC)
        d_vp = tl.zeros((BC,), ACC)
        d_b = tl.zeros((BN,), ACC)
        # each program: every programs-th tile of BT tokens
        for tile in range(pid, tl.cdiv(N, BT), programs):
            # int64 (the interpreter: Python ints)
            t = (pid.to(tl.int64) + (tile - pid)) * BT + tl.arange(0, BT)
            tmask = t < N
            tc, st = tmask[:, None] & cmask[None, :], rmask[:, None] & tmask[None, :]
            mask = st[:, :, None] & cmask[None, None, :]
            at = rows[:, None, None] * N * C + t[None, :, None] * C + cols[None, None, :]
            x = tl.load(X + at, mask=mask, other=0.).to(ACC)
            u = tl.load(U + t[:, None] * C + cols[None, :], mask=tc, other=0.).to(ACC)[None, :, :]
            beta = tl.load(BETA + rows[:, None] * N + t[None, :], mask=st, other=0.)
            alpha = tl.load(ALPHA + rows[:, None] * N + t[None, :], mask=st, other=0.)
            if INVERT:
                # rebuild the inputs from the outputs; the largest gates' originals were kept
                new = x
                s = (x - beta[:, :, None] * u) / (1 - beta[:, :, None])
                for k in range(keep):
                    j = tl.load(INDEX + k * N + t, mask=tmask, other=-1)
                    original = tl.load(KEPT + k * N * C + t[:, None] * C + cols[None, :], mask=tc,
                                       other=0.).to(ACC)
                    s = tl.where(rows[:, None, None] == j[None, :, None], original[None, :, :], s)
                tl.store(REBUILT + at, s.to(REBUILT.dtype.element_ty), mask=mask)
            else:
                s = x
                new = s + beta[:, :, None] * (u - s)
            g_h = tl.load(G_H + t[:, None] * C + cols[None, :], mask=tc,
                          other=0.).to(ACC)[None, :, :]
            # AttnPool
            r2 = 1 / tl.sqrt(tl.sum(new * new, axis=2) / C + eps)
            y = r2 * tl.sum(new * vp, axis=2)
            g_alpha = tl.sum(new * g_h, axis=2)
            dy = alpha * (g_alpha - tl.sum(alpha * g_alpha, axis=0)[None, :])
            d_new = (tl.load(G_NEW + at, mask=mask, other=0.).to(ACC) + alpha[:, :, None] * g_h
                     + (dy * r2)[:, :, None] * vp - (dy * r2 * r2 * y / C)[:, :, None] * new)
            d_vp += tl.sum(tl.sum((dy * r2)[:, :, None] * new, axis=1), axis=0)
            # lerp
            tl.store(D_U + t[:, None] * C + cols[None, :],
                     tl.sum(beta[:, :, None] * d_new, axis=0).to(D_U.dtype.element_ty), mask=tc)
            d_beta = tl.sum(d_new * (u - s), axis=2)
            d_s = (1 - beta[:, :, None]) * d_new
            # gates
            if COMPETITIVE:
                weighted = tl.sum(beta * d_beta, axis=0)
                dz = beta * (d_beta - weighted[None, :])
                d_b += tl.where(rows == 0,
                                -tl.sum((1 - tl.sum(beta, axis=0)) * weighted, axis=0), 0.)
            else:
                dz = d_beta * beta * (1 - beta)
                d_b += tl.sum(dz, axis=1)
            r = 1 / tl.sqrt(tl.sum(s * s, axis=2) / C + eps)
            z = r * tl.sum(s * vg, axis=2)
            d_s += (dz * r)[:, :, None] * vg - (dz * r * r * z / C)[:, :, None] * s
            d_vg += tl.sum(tl.sum((dz * r)[:, :, None] * s, axis=1), axis=0)
            tl.store(D_S + at, d_s.to(D_S.dtype.element_ty), mask=mask)
        tl.store(D_VG + pid * C + cols, d_vg, mask=cmask)
        tl.store(D_VP + pid * C + cols, d_vp, mask=cmask)
        tl.store(D_B + pid, tl.sum(d_b, axis=0))


# ----------------------------------------------------------------------------------- the custom ops

@torch.library.custom_op('resroute::mgr_step', mutates_args=())
def triton_mgr_step(streams: Tensor, u: Tensor, gate_query: Tensor, gate_bias: Tensor,
                    pool_query: Tensor, competitive: bool, keep: int
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """mgr_step_torch in Triton, one program per tile of tokens (the tokens' shape as given: no
    view)."""
    streams, u = streams.contiguous(), u.contiguous()
    n, tokens, C = streams.shape[0], u.shape[:-1], u.shape[-1]
    N, (acc, acc_tl) = u.numel() // C, accumulator(streams.dtype)
    new, h = torch.empty_like(streams), torch.empty_like(u)
    beta, alpha = (torch.empty((n, *tokens), device=u.device, dtype=acc) for _ in range(2))
    index = torch.empty((keep, *tokens), device=u.device, dtype=torch.int64)
    kept = streams.new_empty((keep, *tokens, C))
    BT = token_tile(n, C, N)
    _mgr_step_fwd[(triton.cdiv(N, BT),)](
        S=streams,                   # (n, N, C)
        U=u,                         # (N, C)
        VG=gate_query.contiguous(),  # (C,) or (1, C)
        VP=pool_query.contiguous(),  # (C,) or (1, C)
        BIAS=gate_bias,              # (1,)
        NEW=new,                     # (n, N, C)
        H=h,                         # (N, C)
        BETA=beta,                   # (n, N)
        ALPHA=alpha,                 # (n, N)
        INDEX=index,                 # (keep, N)
        KEPT=kept,                   # (keep, N, C)
        n=n,
        N=N,
        C=C,
        keep=keep,
        eps=RMS_EPS,
        COMPETITIVE=competitive, ACC=acc_tl,
        BN=next_pow2(n), BT=BT, BC=next_pow2(C))
    return new, h, beta, alpha, index, kept


@triton_mgr_step.register_fake
def _(streams, u, gate_query, gate_bias, pool_query, competitive, keep):
    n, tokens = streams.shape[0], u.shape[:-1]
    stat = lambda: streams.new_empty((n, *tokens), dtype=accumulator(streams.dtype)[0])
    return (torch.empty_like(streams), torch.empty_like(u), stat(), stat(),
            streams.new_empty((keep, *tokens), dtype=torch.int64),
            streams.new_empty((keep, *u.shape)))


@torch.library.custom_op('resroute::mgr_step_backward', mutates_args=())
def triton_mgr_step_backward(x: Tensor, u: Tensor, gate_query: Tensor, gate_bias: Tensor,
                             pool_query: Tensor, beta: Tensor, alpha: Tensor, index: Tensor,
                             kept: Tensor, grad_new: Tensor, grad_h: Tensor, competitive: bool,
                             invert: bool
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """mgr_step_backward_torch in Triton."""
    x, u = x.contiguous(), u.contiguous()
    n, C = x.shape[0], x.shape[-1]
    N = u.numel() // C
    BT, (acc, acc_tl) = token_tile(n, C, N), accumulator(x.dtype)
    programs = reduction_programs(triton.cdiv(N, BT))
    d_s, d_u = torch.empty_like(x), torch.empty_like(u)
    rebuilt = torch.empty_like(x) if invert else x.new_empty(0)  # only the inversion writes it
    partial = lambda *shape: torch.empty((programs,) + shape, device=x.device, dtype=acc)
    d_vg, d_vp, d_b = partial(C), partial(C), partial()
    _mgr_step_bwd[(programs,)](
        X=x,                            # (n, N, C)
        U=u,                            # (N, C)
        VG=gate_query.contiguous(),     # (C,) or (1, C)
        VP=pool_query.contiguous(),     # (C,) or (1, C)
        BETA=beta,                      # (n, N)
        ALPHA=alpha,                    # (n, N)
        INDEX=index,                    # (keep, N)
        KEPT=kept.contiguous(),         # (keep, N, C)
        G_NEW=grad_new.contiguous(),    # (n, N, C)
        G_H=grad_h.contiguous(),        # (N, C)
        D_S=d_s,                        # (n, N, C)
        D_U=d_u,                        # (N, C)
        REBUILT=rebuilt,                # (n, N, C), or empty
        D_VG=d_vg,                      # (programs, C)
        D_VP=d_vp,                      # (programs, C)
        D_B=d_b,                        # (programs,)
        n=n,
        N=N,
        C=C,
        keep=index.shape[0],
        eps=RMS_EPS,
        COMPETITIVE=competitive, INVERT=invert, ACC=acc_tl,
        BN=next_pow2(n), BT=BT, BC=next_pow2(C))
    return (d_s, d_u, d_vg.sum(0).view(gate_query.shape), d_b.sum().reshape(1),
            d_vp.sum(0).view(pool_query.shape), rebuilt)


@triton_mgr_step_backward.register_fake
def _(x, u, gate_query, gate_bias, pool_query, beta, alpha, index, kept, grad_new, grad_h,
      competitive, invert):
    acc = accumulator(x.dtype)[0]
    return (torch.empty_like(x), torch.empty_like(u), x.new_empty(gate_query.shape, dtype=acc),
            x.new_empty((1,), dtype=acc), x.new_empty(pool_query.shape, dtype=acc),
            torch.empty_like(x) if invert else x.new_empty(0))


def triton_step(streams, u, gate_query, gate_bias, pool_query, competitive, keep, rinv):
    """triton_mgr_step as mgr_step_torch is called: no scores saved (the backward kernel computes
    them again), no rinv read."""
    return (*triton_mgr_step(streams, u, gate_query, gate_bias, pool_query, competitive, keep), ())


def triton_step_backward(*args):
    """triton_mgr_step_backward as mgr_step_backward_torch is called (its last argument, the
    scores, is none)."""
    return triton_mgr_step_backward(*args[:-1])


# the step and its backward, by backend (mgr chooses)
TORCH_STEP = mgr_step_torch, mgr_step_backward_torch


TRITON_STEP = triton_step, triton_step_backward


# -------------------------------------------------------------------- the Function and the schedule

class MGRStep(torch.autograd.Function):
    """One gated MGR sublayer: s_j <- s_j + beta_j (u - s_j), then h = AttnPool(s) for the next
    sublayer, in one pass. Without a tape it saves its input streams. With a `tape` (a dict shared
    by the steps of one forward) the backward inverts the lerp instead: only the last step saves its
    output streams; every step's backward rebuilds its input from its output and leaves it on the
    tape for the step before (backwards run in reverse order, so each finds its output there)."""

    @staticmethod
    def forward(ctx, streams, u, gate_query, gate_bias, pool_query, competitive, fallback_p, tape,
                step, last, step_fns, rinv):
        keep = min(fallback_p, streams.shape[0]) if tape is not None else 0
        args = streams, u, gate_query, gate_bias, pool_query, competitive, keep
        step_forward, _ = step_fns
        new, h, beta, alpha, index, kept, scores = step_forward(*args, rinv)
        if tape is None:
            saved_streams = [streams]
        elif last:
            saved_streams = [new]
        else:
            saved_streams = []
        ctx.save_for_backward(u, gate_query, gate_bias, pool_query, beta, alpha, index, kept,
                              *scores, *saved_streams)
        ctx.competitive, ctx.tape, ctx.step, ctx.step_fns, ctx.n_scores = (
            competitive, tape, step, step_fns, len(scores))
        # the new streams' 1/RMS, the next step's (PyTorch; exact only where the streams keep its
        # precision)
        rinv_new = scores[2] if scores and scores[2].dtype == new.dtype else None
        ctx.mark_non_differentiable(beta, alpha, index, kept,
                                    *[] if rinv_new is None else [rinv_new])
        ctx.set_materialize_grads(False)  # no tensors of zeros made for those
        return new, h, beta, alpha, index, kept, rinv_new

    @staticmethod
    def backward(ctx, grad_new, grad_h, *_):
        u, gate_query, gate_bias, pool_query, beta, alpha, index, kept, *saved = ctx.saved_tensors
        scores, saved = saved[:ctx.n_scores], saved[ctx.n_scores:]
        if grad_new is None:  # (the last step's streams: only its h is read)
            grad_new = u.new_zeros(beta.shape + u.shape[-1:])
        if grad_h is None:
            grad_h = torch.zeros_like(u)
        invert = ctx.tape is not None
        if saved:
            x = saved[0]
        elif ctx.step in ctx.tape:
            x = ctx.tape.pop(ctx.step)
        else:
            raise RuntimeError("MGR's inverting backward must start at the last step (each step "
                               "rebuilds its input from the step after); to backpropagate from an "
                               "inner step use mgr_fallback_p=-1")
        args = (x, u, gate_query, gate_bias, pool_query, beta, alpha, index, kept, grad_new, grad_h,
                ctx.competitive, invert)
        _, step_backward = ctx.step_fns
        d_s, d_u, d_gate, d_bias, d_pool, rebuilt = step_backward(*args, scores)
        if invert:
            ctx.tape[ctx.step - 1] = rebuilt.to(x.dtype)
        return (d_s, d_u, d_gate.to(gate_query.dtype), d_bias.to(gate_bias.dtype),
                d_pool.to(pool_query.dtype), None, None, None, None, None, None, None)


def mgr_step(streams, u, gate_query, gate_bias, pool_query, competitive, fallback_p, tape, step,
             last, step_fns, rinv=None):
    """Fused MGR step: streams (n, B, T, C), u (B, T, C), gate_bias (1,) -> (new streams, h
    (B, T, C), the new streams' 1/RMS for the next step (PyTorch) or None); see MGRStep. step_fns:
    the step and its backward (TORCH_STEP or TRITON_STEP), which take the tokens' shape as it is:
    no views around them. step: the sublayer's index."""
    new, h, *_, rinv = MGRStep.apply(streams, u, gate_query, gate_bias, pool_query, competitive,
                                     fallback_p, tape, step, last, step_fns, rinv)
    return new, h, rinv


def mgr(module, x, sublayers, backend, fallback_p):
    """MGR with the fused step (gates, convex update, next AttnPool). In the accumulation phase the
    streams are a list and each AttnPool is one depth read of them (AttnPool is DepthAttention;
    through a Reads, as the AttnRes family's); they are stacked once, where the gated phase
    begins. The queries are scaled once and split, so that each sublayer takes its own without an
    operator (and its gradient without a full-size zero).
    fallback_p, the inversion's setting p (route's mgr_fallback_p): with p >= 0 in eager mode, the
    steps' backwards invert the lerp, passing the rebuilt streams backwards on a tape local to this
    forward; the originals of the p largest gates per token are kept. The plain step (torch, p = -1)
    is the class's forward."""
    if backend == 'triton':  # the step's one choice of backend (the AttnPools': reads(backend))
        step_fns = TRITON_STEP
    elif fallback_p < 0:
        return module(x, sublayers)
    else:
        step_fns = TORCH_STEP
    n, gates = module.n, module.gates
    # Python state: eager only
    tape = {} if fallback_p >= 0 and not torch.compiler.is_compiling() else None
    # rows (1, C): the reads' and the steps'
    pool_queries = (module.pool.queries * module.pool.scale).split(1)
    gate_queries, gate_bias = (gates.queries * gates.scale).split(1), gates.bias.split(1)
    # s_1 = e, then a stream per update
    started, streams, rinv, read = [x], None, None, reads(backend)
    h = read.one(pool_queries[0], started, None)
    for i, f in enumerate(sublayers):
        u = f(h)
        if i < n - 1:  # accumulation phase: the update starts a new stream
            started.append(u)
            h = read.one(pool_queries[i + 1], started, None)
        else:
            if streams is None:
                streams = torch.stack(started) if len(started) > 1 else x.unsqueeze(0)
            j = i - (n - 1)
            streams, h, rinv = mgr_step(
                streams, u, gate_queries[j], gate_bias[j], pool_queries[i + 1], gates.competitive,
                fallback_p, tape, i, i == len(sublayers) - 1, step_fns, rinv)
    return h
