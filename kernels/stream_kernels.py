"""
The Triton kernels of HC's and mHC-lite's stream step, and the custom ops that launch them
(streams.py: the maths, the PyTorch twins and the schedule that runs these).
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from residuals import RMS_EPS, SinkhornCoefficients

from .common import accumulator, next_pow2, reduction_programs, tl, triton


# ---------------------------------------------------------- the Triton kernels: one step a sublayer
#
# One kernel per sublayer forward: the RMS of the streams, the projection XW (HC: each stream's
# (C, n + 2) product, in the same pass over the columns; mHC-lite's (n C, 2n + n!) one: a GEMM
# outside, by cuBLAS), the connections from it, the mixing A^T H and the outputs h, H', post. One
# kernel backward, on the rebuilt streams: the mixing's, the connections' and (HC) the projection's
# gradients, and each program's partial sums of the parameters' gradients (no atomics; HC's W among
# them: C (n + 2) numbers a program, where mHC-lite's n C (2n + n!) would be 16x as many: its GEMMs
# stay outside). The streams are rebuilt by the same forward kernel from the saved XW (a few numbers
# per token). The update H <- H' + post^T f(h) is never written: the next step's kernels take the
# last H', post and u = f(h) and form the streams as they read them (ADD), forward, replay and
# backward, and HC's backward kernel does the update's backward too (d H' = d H,
# d u = sum_s post_s d H_s, d post_s = d H_s . u). mHC-lite's projection of the streams is
# H' W + sum_s post_s (u W_s), two GEMMs combined in the kernel; its backward kernel writes the
# streams it formed for the GEMM of W's gradient and does the update's backward too, by linearity:
# d H = d H_kernel + d XW W^T (a GEMM after it), so d u = sum_s post_s d H_kernel,s + (post^T d XW)
# [W_1 | .. | W_n]^T (the kernel writes post^T d XW, n K numbers a token; a GEMM adds its product)
# and d post_s = d H_kernel,s . u + d XW . (u W_s) (the forward's u W_s, saved), so no pass reads
# the whole d H again. The readout's streams, after the last sublayer, are formed by advance
# (_advance_bwd).
# mHC's step is mHC-lite's with H_res from its n^2 logits by 20 Sinkhorn iterations in the log domain,
# per token in the kernel's registers (SINKHORN); its backward computes the iterations again, keeping
# each normalisation's log-sum-exp (2 x 20 x n numbers a token, in registers), and steps back through
# them. KromHC's is mHC-lite's with n permutations (streams.kron_as_permutations).
# Kinds: HC (dynamic), HC static, mHC-lite, mHC.
HC, HC_STATIC, MHC_LITE, MHC = 0, 1, 2, 3
MANIFOLD = (MHC_LITE, MHC)  # the mHC family's kinds: projection by GEMMs, alpha and bias
ITERATIONS = SinkhornCoefficients.ITERATIONS


STREAM_BC = 256  # columns per pass: the (n + 1, n, BC) products stay small in registers


# elements of a program's largest block: (tokens, n + 1, n, BC), HC's projection
# (tokens, n, BC, n + 2) or mHC-lite's (tokens, n!, n + 1, n)
STREAM_TILE = 8192


def stream_columns(C):
    """Columns per pass of the stream kernels (BC)."""
    return min(next_pow2(C), STREAM_BC)


def stream_tile(n, C, n_perm, N, hr):
    """Tokens per program of the stream kernels: one at GPT-2's width (n = 4: an (n + 1, n, 256)
    block, or HC's projection (n, 256, n + 2), fills the budget), several at small widths (as
    token_tile for the depth mix)."""
    NP, NP2 = next_pow2(n), next_pow2(n + hr + 1)
    block = NP2 * NP * max(stream_columns(C), next_pow2(n_perm))
    return max(1, min(next_pow2(N), STREAM_TILE // block))


if triton is not None:
    @triton.jit
    def _sigmoid(x):
        return 1 / (1 + tl.exp(-x))

    @triton.jit
    def _sublayer_params(P0, P1, P2, P3, i, n, hr, K, LITE: tl.constexpr, DYNAMIC: tl.constexpr):
        """Sublayer i's rows of the stacked parameters (L, ...): HC width (n, hr + n), depth, s_a,
        s_b; mHC-lite alpha, bias (P2: the permutations, shared)."""
        if LITE:
            return P0 + i * 3, P1 + i * K, P2, P3
        elif DYNAMIC:
            return P0 + i * n * (n + hr), P1 + i * n, P2 + i, P3 + i
        else:
            return P0 + i * n * (n + hr), P1 + i * n, P2, P3

    @triton.jit
    def _hc_connect(XW,  # (N, n, K), K = n + 2 (DYNAMIC)
                    P0,  # width (n, n+1)
                    P1,  # depth (n,)
                    P2,  # s_a (DYNAMIC)
                    P3,  # s_b (DYNAMIC)
                    t,
                    tmask,
                    r,
                    n,
                    hr,
                    K,
                    DYNAMIC: tl.constexpr,
                    ACC: tl.constexpr,
                    BT: tl.constexpr, NP: tl.constexpr, NP1: tl.constexpr):
        """HC's connections of the tokens t (BT,): A^T (BT, NP1, NP) (rows 0..hr-1 read h: HC's
        one, Frac's m; rows hr..hr+n-1 the streams H') and post (BT, NP), from XW ((n, K) per token,
        K = hr + n + 1) and r: 1/RMS per stream (BT, NP). Also returns what the backward needs:
        P^T, its tanh, the depth column's P and tanh (zeros for static HC)."""
        k, j = tl.arange(0, NP), tl.arange(0, NP1)
        kmask, jmask = k < n, j < n + hr
        m2 = jmask[:, None] & kmask[None, :]
        tk = tmask[:, None] & kmask[None, :]
        width = tl.load(P0 + k[None, :] * (n + hr) + j[:, None], mask=m2, other=0.).to(ACC)
        AT = tl.broadcast_to(width[None, :, :], (BT, NP1, NP))
        post = tl.broadcast_to(tl.load(P1 + k, mask=kmask, other=0.).to(ACC)[None, :], (BT, NP))
        PT = tl.zeros((BT, NP1, NP), ACC)
        TT = tl.zeros((BT, NP1, NP), ACC)
        pb = tl.zeros((BT, NP), ACC)
        tb = tl.zeros((BT, NP), ACC)
        if DYNAMIC:
            PT = r[:, None, :] * tl.load(
                XW + t[:, None, None] * n * K + k[None, None, :] * K + j[None, :, None],
                mask=tmask[:, None, None] & m2[None, :, :], other=0.).to(ACC)
            TT = 2 * _sigmoid(2 * PT) - 1  # tanh
            AT += tl.load(P2).to(ACC) * TT
            pb = r * tl.load(XW + t[:, None] * n * K + k[None, :] * K + n + hr, mask=tk,
                             other=0.).to(ACC)
            tb = 2 * _sigmoid(2 * pb) - 1
            post += tl.load(P3).to(ACC) * tb
        return AT, post, PT, TT, pb, tb

    @triton.jit
    def _manifold_gates(XW, P0, P1, t, tk, k, kmask, r, n, K, ACC: tl.constexpr):
        """The mHC family's gates of the tokens t from XW ((K,) per token) and r, 1/RMS of the
        flattened streams (BT,): a_res, P's pre and post parts, H_pre and H_post (BT, NP)."""
        a_pre, a_post, a_res = tl.load(P0).to(ACC), tl.load(P0 + 1).to(ACC), tl.load(P0 + 2).to(ACC)
        p_pre = r[:, None] * tl.load(XW + t[:, None] * K + k[None, :], mask=tk, other=0.).to(ACC)
        p_post = r[:, None] * tl.load(XW + t[:, None] * K + n + k[None, :], mask=tk,
                                      other=0.).to(ACC)
        h_pre = _sigmoid(a_pre * p_pre + tl.load(P1 + k, mask=kmask, other=0.).to(ACC)[None, :])
        post = 2 * _sigmoid(a_post * p_post
                            + tl.load(P1 + n + k, mask=kmask, other=0.).to(ACC)[None, :])
        return a_res, p_pre, p_post, h_pre, post

    @triton.jit
    def _lite_connect(XW,  # (N, K), K = 2n + n!
                      P0,  # alpha (3,)
                      P1,  # bias (K,)
                      P2,  # the permutations (n!, n) as stream indices
                      t,
                      tmask,
                      r,
                      n,
                      K,
                      n_perm,
                      ACC: tl.constexpr,
                      NP: tl.constexpr, NP1: tl.constexpr, PP: tl.constexpr):
        """mHC-lite's connections of the tokens t (BT,): A^T (BT, NP1, NP) (row 0 reads h, rows 1..n
        the streams H') and post (BT, NP), from XW ((K,) per token, K = 2n + n!) and r: 1/RMS of all
        n streams together (BT,). Also returns what the backward needs: the permutation table, the
        softmax weights, P's parts and h_pre."""
        k, j, p = tl.arange(0, NP), tl.arange(0, NP1), tl.arange(0, PP)
        kmask, jmask, pmask = k < n, j < n + 1, p < n_perm
        tk, tp = tmask[:, None] & kmask[None, :], tmask[:, None] & pmask[None, :]
        a_res, p_pre, p_post, h_pre, post = _manifold_gates(XW, P0, P1, t, tk, k, kmask, r, n, K,
                                                            ACC)
        p_res = r[:, None] * tl.load(XW + t[:, None] * K + 2 * n + p[None, :], mask=tp,
                                     other=0.).to(ACC)
        bias_res = tl.load(P1 + 2 * n + p, mask=pmask, other=0.).to(ACC)
        z = tl.where(pmask[None, :], a_res * p_res + bias_res[None, :], float('-inf'))
        w = tl.exp(z - tl.max(z, axis=1)[:, None])
        w = w / tl.sum(w, axis=1)[:, None]
        # perm[p, j]: the stream that row j of permutation p reads (-1 outside); row j of A^T is
        # H_res row j-1
        perm = tl.load(P2 + p[:, None] * n + j[None, :] - 1,
                       mask=pmask[:, None] & (j[None, :] >= 1) & jmask[None, :], other=-1)
        AT = tl.sum(tl.where(perm[None, :, :, None] == k[None, None, None, :], w[:, :, None, None],
                             0.), axis=1)
        AT = tl.where(j[None, :, None] == 0, h_pre[:, None, :], AT)
        return AT, post, perm, w, p_pre, p_post, p_res, h_pre

    @triton.jit
    def _sinkhorn(z, valid, ACC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, NP1: tl.constexpr,
                  ITERS: tl.constexpr, IP: tl.constexpr, RECORD: tl.constexpr):
        """ITERS Sinkhorn iterations on the logits z (BT, NP1, NP) in the log domain, columns then
        rows, its entries outside `valid` -inf and kept so: the last iterate, and with RECORD (for
        the backward; else zeros) the log-sum-exp each normalisation subtracted, per column
        (BT, IP, NP) and per row (BT, IP, NP1) (0 on a line with no valid entry). (The
        normalisations are written out, not called: Triton's interpreter pays for every call of a
        jit function.)"""
        col_in = tl.max(valid.to(tl.int32), axis=1) > 0  # the columns (BT, NP) with a valid entry
        row_in = tl.max(valid.to(tl.int32), axis=2) > 0  # the rows (BT, NP1)
        it = tl.arange(0, IP)
        cols = tl.zeros((BT, IP, NP), ACC)
        rows = tl.zeros((BT, IP, NP1), ACC)
        lm = z
        for q in range(ITERS):
            top = tl.where(col_in, tl.max(lm, axis=1), 0.)  # T_c: every column sums to 1
            total = tl.where(col_in, tl.sum(tl.exp(lm - top[:, None, :]), axis=1), 1.)
            lse = tl.where(col_in, top + tl.log(total), 0.)
            lm = tl.where(valid, lm - lse[:, None, :], float('-inf'))
            if RECORD:
                cols = tl.where(it[None, :, None] == q, lse[:, None, :], cols)
            top = tl.where(row_in, tl.max(lm, axis=2), 0.)  # T_r: every row sums to 1
            total = tl.where(row_in, tl.sum(tl.exp(lm - top[:, :, None]), axis=2), 1.)
            lse = tl.where(row_in, top + tl.log(total), 0.)
            lm = tl.where(valid, lm - lse[:, :, None], float('-inf'))
            if RECORD:
                rows = tl.where(it[None, :, None] == q, lse[:, None, :], rows)
        return lm, cols, rows

    @triton.jit
    def _sinkhorn_connect(XW,  # (N, K), K = 2n + n^2
                          P0,  # alpha (3,)
                          P1,  # bias (K,)
                          t,
                          tmask,
                          r,
                          n,
                          K,
                          ACC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr,
                          NP1: tl.constexpr, ITERS: tl.constexpr, IP: tl.constexpr,
                          RECORD: tl.constexpr):
        """mHC's connections of the tokens t, as _lite_connect's: A^T (BT, NP1, NP) (row 0 H_pre,
        rows 1..n H_res from the logits by ITERS Sinkhorn iterations, columns then rows, in the log
        domain) and post, and what the backward needs: the last iterate (BT, NP1, NP) (-inf
        outside) with, if RECORD, its log-sum-exps (_sinkhorn's), P's parts (p_res as the logits)
        and h_pre."""
        k, j = tl.arange(0, NP), tl.arange(0, NP1)
        kmask = k < n
        tk = tmask[:, None] & kmask[None, :]
        a_res, p_pre, p_post, h_pre, post = _manifold_gates(XW, P0, P1, t, tk, k, kmask, r, n, K,
                                                            ACC)
        # H_res[a, b] at row j = a + 1, column k = b of A^T
        valid = (j[:, None] >= 1) & (j[:, None] < n + 1) & kmask[None, :]
        at = 2 * n + (j[:, None] - 1) * n + k[None, :]
        p_res = r[:, None, None] * tl.load(XW + t[:, None, None] * K + at[None, :, :],
                                           mask=tmask[:, None, None] & valid[None, :, :],
                                           other=0.).to(ACC)
        bias_res = tl.load(P1 + at, mask=valid, other=0.).to(ACC)
        z = tl.where(valid[None, :, :], a_res * p_res + bias_res[None, :, :], float('-inf'))
        lm, cols, rows = _sinkhorn(z, tl.broadcast_to(valid[None, :, :], z.shape), ACC, BT, NP,
                                   NP1, ITERS, IP, RECORD)
        AT = tl.where(j[None, :, None] == 0, h_pre[:, None, :], tl.exp(lm))
        return AT, post, lm, cols, rows, p_pre, p_post, p_res, h_pre

    @triton.jit
    def _sinkhorn_bwd(lm, cols, rows, g, ACC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr,
                      NP1: tl.constexpr, ITERS: tl.constexpr, IP: tl.constexpr):
        """The gradient of the Sinkhorn logits from H_res's, g (BT, NP1, NP) (zero outside), given
        _sinkhorn's last iterate lm and the log-sum-exps it recorded: back through the
        normalisations, last first: y_k = y_(k-1) - lse_k, so d y_(k-1) = d y_k - exp(y_k) sum(d y_k)
        along the normalised axis, and y_(k-1) = y_k + lse_k."""
        valid = lm != float('-inf')
        it = tl.arange(0, IP)
        d = g * tl.exp(lm)  # H_res = exp(y_last)
        for back in range(ITERS):
            q = ITERS - 1 - back
            d = d - tl.exp(lm) * tl.expand_dims(tl.sum(d, axis=2), 2)  # T_r's
            lse_r = tl.sum(tl.where(it[None, :, None] == q, rows, 0.), axis=1)
            lm = tl.where(valid, lm + lse_r[:, :, None], float('-inf'))
            d = d - tl.exp(lm) * tl.expand_dims(tl.sum(d, axis=1), 1)  # T_c's
            lse_c = tl.sum(tl.where(it[None, :, None] == q, cols, 0.), axis=1)
            lm = tl.where(valid, lm + lse_c[:, None, :], float('-inf'))
        return tl.where(valid, d, 0.)

    @triton.jit
    def _stream_rms(ss, n, C, eps, LITE: tl.constexpr):
        """r from the streams' sums of squares ss (BT, NP): per stream (HC), or one for all n
        streams (mHC-lite)."""
        if LITE:
            return 1 / tl.sqrt(tl.sum(ss, axis=1) / (n * C) + eps)
        else:
            return 1 / tl.sqrt(ss / C + eps)

    @triton.jit
    def _last_post(POST_IN, t, tk, n, ADD: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr,
                   NP: tl.constexpr):
        """With ADD, the last sublayer's post at the tokens t (BT, NP) (else zeros, unused)."""
        if ADD:
            return tl.load(POST_IN + t[:, None] * n + tl.arange(0, NP)[None, :], mask=tk,
                           other=0.).to(ACC)
        else:
            return tl.zeros((BT, NP), ACC)

    @triton.jit
    def _streams_tile(H,  # (N, n, C) at `streams` (+ columns)
                      U_IN,  # (N, C), Frac's (N, n C) (ADD)
                      post_in,
                      streams,
                      t,
                      tmask,
                      k,
                      cols,
                      tk3,
                      cmask,
                      n,
                      C,
                      ADD: tl.constexpr,
                      FRAC: tl.constexpr,
                      ACC: tl.constexpr):
        """The streams at the tokens t and columns cols (BT, NP, BC): H itself, or with ADD the last
        sublayer's H' (at H) + diag(post) u, formed here and never written; and u (BT, 1, BC), one
        row for every stream, or with FRAC (BT, NP, BC), Frac's fraction of each row (ADD only)."""
        HT = tl.load(H + streams + cols[None, None, :], mask=tk3 & cmask, other=0.).to(ACC)
        u = tl.zeros((1, 1, 1), ACC)
        if ADD:
            if FRAC:
                u = tl.load(U_IN + t[:, None, None] * n * C + k[None, :, None] * C
                            + cols[None, None, :], mask=tk3 & cmask, other=0.).to(ACC)
            else:
                u = tl.load(U_IN + t[:, None, None] * C + cols[None, None, :],
                            mask=tmask[:, None, None] & cmask, other=0.).to(ACC)
            HT += post_in[:, :, None] * u
        return HT, u

    @triton.jit
    def _combined_projection(XW,  # (N, K), written
                             XW_IN,  # H' W (N, K)
                             UW,  # u [W_1 | .. | W_n] (N, n, K)
                             post_in,
                             t,
                             tmask,
                             k,
                             kmask,
                             n,
                             K,
                             ACC: tl.constexpr, KP: tl.constexpr):
        """mHC-lite's XW = H W of the streams H = H' + post^T u (of the last sublayer) from its two
        GEMMs, XW_IN = H' W and UW = u [W_1 | .. | W_n] (W_s: stream s's rows of W):
        XW_IN + sum_s post_s UW_s, written to XW."""
        q = tl.arange(0, KP)
        tq = tmask[:, None] & (q < K)[None, :]
        uw = tl.load(UW + t[:, None, None] * n * K + k[None, :, None] * K + q[None, None, :],
                     mask=tq[:, None, :] & kmask[None, :, None], other=0.).to(ACC)
        xw = tl.load(XW_IN + t[:, None] * K + q[None, :], mask=tq, other=0.).to(ACC)
        tl.store(XW + t[:, None] * K + q[None, :], xw + tl.sum(post_in[:, :, None] * uw, axis=1),
                 mask=tq)

    @triton.jit
    def _stream_mix_fwd(H,  # the streams (N, n, C), at (stride_t, stride_k, 1)
                        POST_IN,  # the last sublayer's post (N, n) (ADD)
                        U_IN,  # the last sublayer's update u (N, C) (ADD)
                        UW,  # mHC-lite: u [W_1 | .. | W_n] (N, n, K) (COMBINE)
                        W,  # HC: the stacked projections (L, C, K) (PROJECT)
                        XW_IN,  # mHC-lite: H' W (N, K) (COMBINE)
                        XW,  # HC: (N, n, K) (written with PROJECT); mHC-lite: (N, K)
                        P0,  # HC: width (L, n, n+1); mHC-lite: alpha (L, 3)
                        P1,  # HC: depth (L, n); mHC-lite: bias (L, K)
                        P2,  # HC: s_a (L,); mHC-lite: the permutations (n!, n)
                        P3,  # HC: s_b (L,)
                        OUT_H,  # h (N, C) (not with REPLAY)
                        OUT_MIXED,  # H' (N, n, C)
                        OUT_POST,  # post (N, n)
                        i,
                        stride_t,
                        stride_k,
                        N,
                        n,
                        C,
                        K,
                        n_perm,
                        hr,  # the rows of A^T that read h: 1, Frac's m
                        eps,
                        LITE: tl.constexpr, DYNAMIC: tl.constexpr, PROJECT: tl.constexpr,
                        COMBINE: tl.constexpr, REPLAY: tl.constexpr, ADD: tl.constexpr,
                        FRAC: tl.constexpr, SINKHORN: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr,
                        NP: tl.constexpr, NP1: tl.constexpr, KP: tl.constexpr, PP: tl.constexpr,
                        BC: tl.constexpr, ITERS: tl.constexpr, IP: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)  # a tile of BT tokens
        # sublayer i's: rows of (L, ...)
        P0, P1, P2, P3 = _sublayer_params(P0, P1, P2, P3, i, n, hr, K, LITE, DYNAMIC)
        if PROJECT:
            W += i * C * K
        k, j, c, q = tl.arange(0, NP), tl.arange(0, NP1), tl.arange(0, BC), tl.arange(0, KP)
        tmask, kmask = t < N, k < n
        streams = t[:, None, None] * stride_t + k[None, :, None] * stride_k  # (+ columns)
        tk = tmask[:, None, None] & kmask[None, :, None]
        post_in = _last_post(POST_IN, t, tmask[:, None] & kmask[None, :], n, ADD, ACC, BT, NP)
        ss = tl.zeros((BT, NP), ACC)
        xw = tl.zeros((BT, NP, KP), ACC)
        # the streams' sums of squares (and HC's XW), BC columns at a time
        for c0 in range(0, C, BC):
            cols = c0 + c
            HT, u = _streams_tile(H, U_IN, post_in, streams, t, tmask, k, cols, tk,
                                  (cols < C)[None, None, :], n, C, ADD, FRAC, ACC)
            ss += tl.sum(HT * HT, axis=2)
            if PROJECT:
                Wc = tl.load(W + cols[:, None] * K + q[None, :],
                             mask=(cols < C)[:, None] & (q < K)[None, :], other=0.).to(ACC)
                xw += tl.sum(HT[:, :, :, None] * Wc[None, None, :, :], axis=2)
        # written, then read back by _hc_connect (after a barrier: other threads wrote it)
        if PROJECT:
            tl.store(XW + t[:, None, None] * n * K + k[None, :, None] * K + q[None, None, :], xw,
                     mask=tk & (q < K)[None, None, :])
            tl.debug_barrier()
        if COMBINE:  # likewise, read back by _lite_connect
            _combined_projection(XW, XW_IN, UW, post_in, t, tmask, k, kmask, n, K, ACC, KP)
            tl.debug_barrier()
        r = _stream_rms(ss, n, C, eps, LITE)
        if SINKHORN:  # (the rest: what the backward needs)
            AT, post, _, _, _, _, _, _, _ = _sinkhorn_connect(XW, P0, P1, t, tmask, r, n, K, ACC,
                                                              BT, NP, NP1, ITERS, IP, False)
        elif LITE:
            AT, post, _, _, _, _, _, _ = _lite_connect(XW, P0, P1, P2, t, tmask, r, n, K, n_perm,
                                                       ACC, NP, NP1, PP)
        else:
            AT, post, _, _, _, _ = _hc_connect(XW, P0, P1, P2, P3, t, tmask, r, n, hr, K, DYNAMIC, ACC,
                                               BT, NP, NP1)
        out = OUT_MIXED.dtype.element_ty
        tj = tmask[:, None, None] & (j[None, :, None] >= hr) & (j[None, :, None] < n + hr)
        t0 = tmask[:, None, None] & (j[None, :, None] < hr)
        for c0 in range(0, C, BC):  # A^T H: row 0 is h, rows 1..n are H'
            cols = c0 + c
            cmask = (cols < C)[None, None, :]
            HT, u = _streams_tile(H, U_IN, post_in, streams, t, tmask, k, cols, tk, cmask, n, C, ADD,
                                  FRAC, ACC)
            mixed = tl.sum(AT[:, :, :, None] * HT[:, None, :, :], axis=2)
            tl.store(OUT_MIXED + t[:, None, None] * n * C + (j[None, :, None] - hr) * C
                     + cols[None, None, :], mixed.to(out), mask=tj & cmask)
            if not REPLAY:
                tl.store(OUT_H + t[:, None, None] * hr * C + j[None, :, None] * C + cols[None, None, :],
                         mixed.to(out), mask=t0 & cmask)
        tl.store(OUT_POST + t[:, None] * n + k[None, :], post.to(OUT_POST.dtype.element_ty),
                 mask=tmask[:, None] & kmask[None, :])

    @triton.jit
    def _mixing_grad(G_H, G_MIXED, t, j, cols, tj, t0, cmask, n, hr, C, ACC: tl.constexpr):
        """The gradient G of A^T H at the tokens t and columns cols (BT, NP1, BC): rows 0..hr-1
        h's, the others H''s."""
        G = tl.load(G_MIXED + t[:, None, None] * n * C + (j[None, :, None] - hr) * C
                    + cols[None, None, :], mask=tj & cmask, other=0.).to(ACC)
        G += tl.load(G_H + t[:, None, None] * hr * C + j[None, :, None] * C + cols[None, None, :],
                     mask=t0 & cmask, other=0.).to(ACC)
        return G

    @triton.jit
    def _mixing_grams(H,  # (N, n, C) at `streams` (+ columns)
                      U_IN,  # (N, C) (ADD)
                      post_in,
                      G_H,  # d h (N, C)
                      G_MIXED,  # d H' (N, n, C)
                      streams,
                      t,
                      tmask,
                      k,
                      j,
                      c,
                      tk3,
                      tj,
                      t0,
                      n,
                      hr,
                      C,
                      ADD: tl.constexpr,
                      FRAC: tl.constexpr,
                      ACC: tl.constexpr,
                      BT: tl.constexpr, NP: tl.constexpr, NP1: tl.constexpr, BC: tl.constexpr):
        """A pass over the columns for the tokens t: d loss / d A^T[j, s] = G_j . H_s
        (BT, NP1, NP), G_0 the gradient of h, G_j of H'_j, and the streams' sums of squares
        (BT, NP)."""
        g_AT = tl.zeros((BT, NP1, NP), ACC)
        ss = tl.zeros((BT, NP), ACC)
        for c0 in range(0, C, BC):
            cols = c0 + c
            cmask = (cols < C)[None, None, :]
            HT, u = _streams_tile(H, U_IN, post_in, streams, t, tmask, k, cols, tk3, cmask, n,
                                  C, ADD, FRAC, ACC)
            G = _mixing_grad(G_H, G_MIXED, t, j, cols, tj, t0, cmask, n, hr, C, ACC)
            g_AT += tl.sum(G[:, :, None, :] * HT[:, None, :, :], axis=3)
            ss += tl.sum(HT * HT, axis=2)
        return g_AT, ss

    @triton.jit
    def _mhc_connections_bwd(P0,  # alpha (3,)
                             D_XW,  # (N, K), written
                             t,
                             tmask,
                             tk,
                             k,
                             j,
                             p,
                             pmask,
                             e,
                             r,
                             g_AT,
                             g_post,
                             post,
                             perm,
                             w,
                             cols,
                             rows,
                             p_pre,
                             p_post,
                             p_res,
                             h_pre,
                             n,
                             C,
                             K,
                             SINKHORN: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr,
                             NP: tl.constexpr, NP1: tl.constexpr, ITERS: tl.constexpr,
                             IP: tl.constexpr):
        """mHC-lite's (and mHC's: SINKHORN, w the last Sinkhorn iterate, cols and rows its
        log-sum-exps, p_res (BT, NP1, NP)) connections
        backward for the tokens t, from d A^T (g_AT) and d post: writes d XW (the GEMMs outside take
        it on to the streams and W) and returns the RMS's share of d H per stream (BT, 1) and the
        tile's sums of the gradients of the bias (pre, post, res; mHC's res (NP1, NP)) and of alpha
        (e: 0..2)."""
        a_pre, a_post, a_res = tl.load(P0).to(ACC), tl.load(P0 + 1).to(ACC), tl.load(P0 + 2).to(ACC)
        du = tl.sum(tl.where(j[None, :, None] == 0, g_AT, 0.), axis=1) * h_pre * (1 - h_pre)
        dv = g_post * post * (1 - post / 2)
        dtype = D_XW.dtype.element_ty
        if SINKHORN:
            valid = (j[:, None] >= 1) & (j[:, None] < n + 1) & (k < n)[None, :]
            dz = _sinkhorn_bwd(w, cols, rows, tl.where(valid[None, :, :], g_AT, 0.), ACC, BT, NP,
                               NP1, ITERS, IP)
            tl.store(D_XW + t[:, None, None] * K + 2 * n + (j[None, :, None] - 1) * n
                     + k[None, None, :], (r[:, None, None] * a_res * dz).to(dtype),
                     mask=tmask[:, None, None] & valid[None, :, :])
            s_res = tl.sum(tl.sum(dz * p_res, axis=2), axis=1)
        else:
            # d loss / d w_p = sum_j g_AT[j, perm_p(j)]
            g_w = tl.sum(tl.sum(tl.where(perm[None, :, :, None] == k[None, None, None, :],
                                         g_AT[:, None, :, :], 0.), axis=3), axis=2)
            dz = w * (g_w - tl.sum(w * g_w, axis=1)[:, None])
            tl.store(D_XW + t[:, None] * K + 2 * n + p[None, :], (r[:, None] * a_res * dz).to(dtype),
                     mask=tmask[:, None] & pmask[None, :])
            s_res = tl.sum(dz * p_res, axis=1)
        tl.store(D_XW + t[:, None] * K + k[None, :], (r[:, None] * a_pre * du).to(dtype), mask=tk)
        tl.store(D_XW + t[:, None] * K + n + k[None, :], (r[:, None] * a_post * dv).to(dtype),
                 mask=tk)
        s_pre, s_post = tl.sum(du * p_pre, axis=1), tl.sum(dv * p_post, axis=1)
        corr = (r * r * (a_pre * s_pre + a_post * s_post + a_res * s_res) / (n * C))[:, None]
        d_a = tl.where(e == 0, tl.sum(s_pre, axis=0),
                       tl.where(e == 1, tl.sum(s_post, axis=0),
                                tl.where(e == 2, tl.sum(s_res, axis=0), 0.)))
        # (tokens outside the tile: all zero)
        return corr, tl.sum(du, axis=0), tl.sum(dv, axis=0), tl.sum(dz, axis=0), d_a

    @triton.jit
    def _hc_connections_bwd(P2,  # s_a
                            P3,  # s_b
                            e,
                            r,
                            g_AT,
                            g_post,
                            PT,
                            TT,
                            pb,
                            tb,
                            C,
                            ACC: tl.constexpr):
        """Dynamic HC's connections backward for a tile of tokens, through the tanh: returns d XW
        (its columns 0..n transposed (BT, NP1, NP), and column n + 1 (BT, NP)), the RMS's share of
        d H per stream (BT, NP) and the tile's sums of the gradients of s_a and s_b (e: 0, 1)."""
        s_a, s_b = tl.load(P2).to(ACC), tl.load(P3).to(ACC)
        dPT = s_a * (1 - TT * TT) * g_AT
        dpb = s_b * (1 - tb * tb) * g_post
        corr = r * r * (tl.sum(dPT * PT, axis=1) + dpb * pb) / C
        d_a = tl.where(e == 0, tl.sum(tl.sum(tl.sum(TT * g_AT, axis=2), axis=1), axis=0), 0.)
        d_a += tl.where(e == 1, tl.sum(tl.sum(tb * g_post, axis=1), axis=0), 0.)
        return r[:, None, :] * dPT, r * dpb, corr, d_a

    @triton.jit
    def _streams_grad(H,  # (N, n, C) at `streams` (+ columns)
                      U_IN,  # (N, C) (ADD)
                      post_in,
                      W,  # HC: sublayer i's projection (C, K) (DYNAMIC)
                      G_H,  # d h (N, C)
                      G_MIXED,  # d H' (N, n, C)
                      D_H,  # (N, n, C), written
                      D_U,  # d u (N, C), written (ADD)
                      OUT_H,  # mHC-lite: the streams formed (N, n C), written (ADD)
                      part_w,  # HC: W's gradient (C, K) in the program's part
                      AT,
                      corr,
                      d_xa,
                      d_xb,
                      later,
                      streams,
                      t,
                      tmask,
                      k,
                      j,
                      c,
                      jmask,
                      tk3,
                      tj,
                      t0,
                      n,
                      hr,
                      C,
                      K,
                      LITE: tl.constexpr, DYNAMIC: tl.constexpr, ADD: tl.constexpr,
                      FRAC: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr,
                      BC: tl.constexpr):
        """A second pass over the columns for the tokens t: d H_s = sum_j A^T[j, s] G_j - corr_s H_s
        written (+ HC: d XW_s W^T, and W's gradient H^T d XW in this program's part of PART, at
        part_w: written by the program's first tile, added to by its `later` ones). With ADD, d H is
        also the last sublayer's d H', and (HC) its update's backward is here:
        d u = sum_s post_s d H_s written, d post_s = d H_s . u returned (BT, NP) (FRAC: d u_s =
        post_s d H_s, d post_s = d H_s . u_s). mHC-lite's d H
        lacks its GEMM's share (d XW W^T), so its d u and d post are the kernel's parts of them
        (_mhc_update_bwd and a GEMM outside add the rest); it also writes the streams it formed, for
        the GEMM of its projection's gradient (OUT_H)."""
        d_post_in = tl.zeros((BT, NP), ACC)
        for c0 in range(0, C, BC):
            cols = c0 + c
            cmask = (cols < C)[None, None, :]
            HT, u = _streams_tile(H, U_IN, post_in, streams, t, tmask, k, cols, tk3, cmask, n,
                                  C, ADD, FRAC, ACC)
            G = _mixing_grad(G_H, G_MIXED, t, j, cols, tj, t0, cmask, n, hr, C, ACC)
            dH = tl.sum(AT[:, :, :, None] * G[:, :, None, :], axis=1) - corr[:, :, None] * HT
            # XW = H W per stream: H gets d XW W^T; W gets H^T d XW, in this program's part
            if DYNAMIC:
                # W[c, j], j = 0..n (the width columns)
                at_a = part_w + cols[None, :] * K + j[:, None]
                m_a = jmask[:, None] & (cols < C)[None, :]
                w_a = tl.load(W + cols[None, :] * K + j[:, None], mask=m_a, other=0.).to(ACC)
                dH += tl.sum(d_xa[:, :, :, None] * w_a[None, :, None, :], axis=1)
                # W[c, n + hr] (depth)
                w_b = tl.load(W + cols * K + n + hr, mask=cols < C, other=0.).to(ACC)
                dH += d_xb[:, :, None] * w_b[None, None, :]
                g_a = tl.sum(tl.sum(d_xa[:, :, :, None] * HT[:, None, :, :], axis=2), axis=0)
                g_b = tl.sum(tl.sum(d_xb[:, :, None] * HT, axis=1), axis=0)
                g_a += tl.where(later, tl.load(at_a, mask=m_a, other=0.), 0.)
                g_b += tl.where(later, tl.load(part_w + cols * K + n + hr, mask=cols < C, other=0.),
                                0.)
                tl.store(at_a, g_a, mask=m_a)
                tl.store(part_w + cols * K + n + hr, g_b, mask=cols < C)
            tl.store(D_H + t[:, None, None] * n * C + k[None, :, None] * C + cols[None, None, :],
                     dH.to(D_H.dtype.element_ty), mask=tk3 & cmask)
            if ADD:
                if LITE:
                    tl.store(OUT_H + t[:, None, None] * n * C + k[None, :, None] * C
                             + cols[None, None, :], HT.to(OUT_H.dtype.element_ty), mask=tk3 & cmask)
                if FRAC:
                    tl.store(D_U + t[:, None, None] * n * C + k[None, :, None] * C
                             + cols[None, None, :], (post_in[:, :, None] * dH).to(D_U.dtype.element_ty),
                             mask=tk3 & cmask)
                else:
                    d_u = tl.sum(post_in[:, :, None] * dH, axis=1)
                    tl.store(D_U + t[:, None] * C + cols[None, :], d_u.to(D_U.dtype.element_ty),
                             mask=tmask[:, None] & (cols < C)[None, :])
                d_post_in += tl.sum(dH * u, axis=2)
        return d_post_in

    @triton.jit
    def _mhc_update_bwd(D_XW,  # (N, K)
                        UW,  # u [W_1 | .. | W_n] (N, n, K)
                        D_UW,  # post^T d XW (N, n, K), written
                        post_in,
                        t,
                        tmask,
                        k,
                        kmask,
                        n,
                        K,
                        ACC: tl.constexpr, KP: tl.constexpr):
        """The share of mHC-lite's update backward that flows through its projection's GEMM, for the
        tokens t: with H = H' + post^T u and d H_s's share d XW W_s^T, d post_s gets d XW . (u W_s)
        (UW = u [W_1 | .. | W_n], the forward's), returned (BT, NP); d u gets
        sum_s post_s d XW W_s^T, a GEMM outside of the (N, n K) products post_s d XW, written to
        D_UW."""
        q = tl.arange(0, KP)
        tq = tmask[:, None] & (q < K)[None, :]
        # (BT, NP, KP) of (N, n, K)
        at = t[:, None, None] * n * K + k[None, :, None] * K + q[None, None, :]
        m3 = tq[:, None, :] & kmask[None, :, None]
        d_xw = tl.load(D_XW + t[:, None] * K + q[None, :], mask=tq, other=0.).to(ACC)
        uw = tl.load(UW + at, mask=m3, other=0.).to(ACC)
        tl.store(D_UW + at, (post_in[:, :, None] * d_xw[:, None, :]).to(D_UW.dtype.element_ty),
                 mask=m3)
        return tl.sum(uw * d_xw[:, None, :], axis=2)

    @triton.jit
    def _stream_parts_store(part,  # the program's partial sums (n_part,)
                            d_AT,
                            d_post,
                            d_pre,
                            d_z,
                            d_a,
                            k,
                            j,
                            p,
                            e,
                            kmask,
                            pmask,
                            m2,
                            n,
                            hr,
                            LITE: tl.constexpr, DYNAMIC: tl.constexpr, SINKHORN: tl.constexpr):
        """A program's partial sums of the parameters' gradients, at `part`: mHC-lite [alpha (3) |
        bias: pre (n), post (n), res (n!)]; HC [width (n, n+1) | depth (n) | s_a, s_b | W (C, K), by
        _streams_grad]."""
        if LITE:
            tl.store(part + e, d_a, mask=e < 3)
            tl.store(part + 3 + k, d_pre, mask=kmask)
            tl.store(part + 3 + n + k, d_post, mask=kmask)
            if SINKHORN:  # (NP1, NP): H_res[a, b] at row a + 1
                tl.store(part + 3 + 2 * n + (j[:, None] - 1) * n + k[None, :], d_z,
                         mask=(j[:, None] >= 1) & m2)
            else:
                tl.store(part + 3 + 2 * n + p, d_z, mask=pmask)
        else:
            tl.store(part + k[None, :] * (n + hr) + j[:, None], d_AT, mask=m2)
            tl.store(part + n * (n + hr) + k, d_post, mask=kmask)
            if DYNAMIC:
                tl.store(part + n * (n + hr) + n + e, d_a, mask=e < 2)

    @triton.jit
    def _stream_mix_bwd(H,  # the streams (N, n, C), at (stride_t, stride_k, 1)
                        POST_IN,  # the last sublayer's post (N, n) (ADD)
                        U_IN,  # the last sublayer's update u (N, C) (ADD)
                        UW,  # mHC-lite: u [W_1 | .. | W_n] (N, n, K) (ADD)
                        W,  # HC: the stacked projections (L, C, K) (DYNAMIC)
                        XW,  # HC: (N, n, K) (DYNAMIC); mHC-lite: (N, K)
                        P0,  # HC: width (L, n, n+1); mHC-lite: alpha (L, 3)
                        P1,  # HC: depth (L, n); mHC-lite: bias (L, K)
                        P2,  # HC: s_a (L,); mHC-lite: the permutations (n!, n)
                        P3,  # HC: s_b (L,)
                        G_H,  # d h (N, C)
                        G_MIXED,  # d H' (N, n, C)
                        G_POST,  # d post (N, n)
                        D_H,  # (N, n, C), written
                        D_U,  # d u (N, C), written (ADD)
                        D_POST_IN,  # d post_in (N, n), written (ADD)
                        OUT_H,  # mHC-lite: the streams formed (N, n C), written (ADD)
                        D_UW,  # mHC-lite: post_in^T d XW (N, n, K), written (ADD)
                        D_XW,  # mHC-lite: (N, K), written
                        PART,  # the programs' partial sums (programs, n_part), written
                        i,
                        stride_t,
                        stride_k,
                        N,
                        n,
                        C,
                        K,
                        n_perm,
                        n_part,
                        hr,
                        eps,
                        LITE: tl.constexpr, DYNAMIC: tl.constexpr, ADD: tl.constexpr,
                        FRAC: tl.constexpr, SINKHORN: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr,
                        NP: tl.constexpr, NP1: tl.constexpr, KP: tl.constexpr, PP: tl.constexpr,
                        BC: tl.constexpr, ITERS: tl.constexpr, IP: tl.constexpr):
        # per tile of tokens: d A^T and the RMS in a pass over the columns, the connections again,
        # their backward (mHC-lite's or HC's), and d H in a second pass (with ADD, the last
        # sublayer's update's backward with it: mHC-lite's with its projection's share from d XW);
        # the parameters' gradients summed per program (the helpers are inlined: one kernel, one
        # launch)
        pid, programs = tl.program_id(0), tl.num_programs(0)
        # as in the forward
        P0, P1, P2, P3 = _sublayer_params(P0, P1, P2, P3, i, n, hr, K, LITE, DYNAMIC)
        if DYNAMIC:
            W += i * C * K
        k, j, p, c = tl.arange(0, NP), tl.arange(0, NP1), tl.arange(0, PP), tl.arange(0, BC)
        kmask, jmask, pmask = k < n, j < n + hr, p < n_perm
        m2 = jmask[:, None] & kmask[None, :]
        # each program's sums over its tokens: HC width^T (NP1, NP), depth, s_a, s_b; mHC-lite
        # alpha, bias
        d_AT = tl.zeros((NP1, NP), ACC)
        d_post = tl.zeros((NP,), ACC)
        d_pre = tl.zeros((NP,), ACC)
        if SINKHORN:
            d_z = tl.zeros((NP1, NP), ACC)
        else:
            d_z = tl.zeros((PP,), ACC)
        e = tl.arange(0, 4)
        d_a = tl.zeros((4,), ACC)  # s_a, s_b (HC) or a_pre, a_post, a_res (mHC-lite)
        # HC: W's gradient (C, K) after the small ones
        part_w = PART + pid * n_part + n * (n + hr) + n + 2
        # each program: every programs-th tile of BT tokens
        for tile in range(pid, tl.cdiv(N, BT), programs):
            # int64 (the interpreter: Python ints)
            t = (pid.to(tl.int64) + (tile - pid)) * BT + tl.arange(0, BT)
            tmask = t < N
            tk = tmask[:, None] & kmask[None, :]
            streams, tk3 = t[:, None, None] * stride_t + k[None, :, None] * stride_k, tk[:, :, None]
            tj = tmask[:, None, None] & (j[None, :, None] >= hr) & jmask[None, :, None]
            t0 = tmask[:, None, None] & (j[None, :, None] < hr)
            g_post = tl.load(G_POST + t[:, None] * n + k[None, :], mask=tk, other=0.).to(ACC)
            post_in = _last_post(POST_IN, t, tk, n, ADD, ACC, BT, NP)
            g_AT, ss = _mixing_grams(H, U_IN, post_in, G_H, G_MIXED, streams, t, tmask, k, j, c,
                                     tk3, tj, t0, n, hr, C, ADD, FRAC, ACC, BT, NP, NP1, BC)
            r = _stream_rms(ss, n, C, eps, LITE)
            # (r^2 / D) dP . P per projected row: the RMS's share of d H
            corr = tl.zeros((BT, NP), ACC)
            # HC: d XW (its columns 0..n transposed, and column n + 1)
            d_xa = tl.zeros((BT, NP1, NP), ACC)
            d_xb = tl.zeros((BT, NP), ACC)
            if LITE:
                if SINKHORN:  # (w: the last Sinkhorn iterate; no permutations)
                    AT, post, w, cols, rows, p_pre, p_post, p_res, h_pre = _sinkhorn_connect(
                        XW, P0, P1, t, tmask, r, n, K, ACC, BT, NP, NP1, ITERS, IP, True)
                    perm = w
                else:  # (no Sinkhorn record)
                    AT, post, perm, w, p_pre, p_post, p_res, h_pre = _lite_connect(
                        XW, P0, P1, P2, t, tmask, r, n, K, n_perm, ACC, NP, NP1, PP)
                    cols, rows = w, w
                corr_t, pre_t, post_t, z_t, a_t = _mhc_connections_bwd(
                    P0, D_XW, t, tmask, tk, k, j, p, pmask, e, r, g_AT, g_post, post, perm, w,
                    cols, rows, p_pre, p_post, p_res, h_pre, n, C, K, SINKHORN, ACC, BT, NP, NP1,
                    ITERS, IP)
                corr += corr_t
                d_pre += pre_t
                d_post += post_t
                d_z += z_t
                d_a += a_t
            else:
                AT, post, PT, TT, pb, tb = _hc_connect(XW, P0, P1, P2, P3, t, tmask, r, n, hr, K,
                                                       DYNAMIC, ACC, BT, NP, NP1)
                d_AT += tl.sum(g_AT, axis=0)
                d_post += tl.sum(g_post, axis=0)
                if DYNAMIC:
                    d_xa, d_xb, corr, a_t = _hc_connections_bwd(P2, P3, e, r, g_AT, g_post, PT, TT,
                                                                pb, tb, C, ACC)
                    d_a += a_t
            # the program's first tile writes its part of W's gradient, later ones add to it
            later = tile > pid
            d_post_in = _streams_grad(H, U_IN, post_in, W, G_H, G_MIXED, D_H, D_U, OUT_H, part_w,
                                      AT, corr, d_xa, d_xb, later, streams, t, tmask, k, j, c,
                                      jmask, tk3, tj, t0, n, hr, C, K, LITE, DYNAMIC, ADD, FRAC, ACC,
                                      BT, NP, BC)
            if ADD:
                # d XW, written by _mhc_connections_bwd, read back (other threads wrote it)
                if LITE:
                    tl.debug_barrier()
                    d_post_in += _mhc_update_bwd(D_XW, UW, D_UW, post_in, t, tmask, k, kmask, n, K,
                                                 ACC, KP)
                tl.store(D_POST_IN + t[:, None] * n + k[None, :],
                         d_post_in.to(D_POST_IN.dtype.element_ty), mask=tk)
        _stream_parts_store(PART + pid * n_part, d_AT, d_post, d_pre, d_z, d_a, k, j, p, e, kmask,
                            pmask, m2, n, hr, LITE, DYNAMIC, SINKHORN)

    @triton.jit
    def _advance_bwd(G,  # d H (N, n, C)
                     U,  # u (N, C); Frac's (N, n C)
                     POST,  # post (N, n)
                     D_U,  # as U, written
                     D_POST,  # (N, n), written
                     N,
                     n,
                     C,
                     FRAC: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr,
                     BC: tl.constexpr):
        """H = H' + post^T u: d u = sum_s post_s G_s, d post_s = G_s . u, per token (a tile of
        BT); FRAC, H = H' + diag(post) u by fractions: d u_s = post_s G_s, d post_s = G_s . u_s."""
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        k, c = tl.arange(0, NP), tl.arange(0, BC)
        tmask, kmask = t < N, k < n
        tk = tmask[:, None] & kmask[None, :]
        post = tl.load(POST + t[:, None] * n + k[None, :], mask=tk, other=0.).to(ACC)
        d_post = tl.zeros((BT, NP), ACC)
        for c0 in range(0, C, BC):
            cols = c0 + c
            cmask = cols < C
            rows = t[:, None, None] * n * C + k[None, :, None] * C + cols[None, None, :]
            m3 = tk[:, :, None] & cmask[None, None, :]
            g = tl.load(G + rows, mask=m3, other=0.).to(ACC)
            if FRAC:
                u = tl.load(U + rows, mask=m3, other=0.).to(ACC)
                tl.store(D_U + rows, (post[:, :, None] * g).to(D_U.dtype.element_ty), mask=m3)
            else:
                u = tl.load(U + t[:, None, None] * C + cols[None, None, :],
                            mask=tmask[:, None, None] & cmask[None, None, :], other=0.).to(ACC)
                d_u = tl.sum(post[:, :, None] * g, axis=1)
                tl.store(D_U + t[:, None] * C + cols[None, :], d_u.to(D_U.dtype.element_ty),
                         mask=tmask[:, None] & cmask[None, :])
            d_post += tl.sum(g * u, axis=2)
        tl.store(D_POST + t[:, None] * n + k[None, :], d_post.to(D_POST.dtype.element_ty), mask=tk)


# ----------------------------------------------------------------------------------- the custom ops

def _projection_sizes(XW, W, params, kind, n):
    """K, the projection's columns (HC's W or the mHC family's XW; 0 for static HC), and the number
    of res logits: mHC-lite's permutations (n!), mHC's n^2 (1 for HC)."""
    K = 0
    if W is not None:
        K = W.shape[-1]
    elif XW is not None:
        K = XW.shape[-1]
    return K, params[2].shape[0] if kind == MHC_LITE else (K - 2 * n if kind == MHC else 1)


def _stream_args(H, XW, W, params, kind):
    """The kernels' view of one step's inputs: streams (N, n, C) with a token and a stream stride (a
    stride-0 stream dimension for e's n copies), XW, W, the four parameter pointers, and the
    sizes."""
    n, C = H.shape[-2:]
    if H.stride(-1) != 1:
        H = H.contiguous()
    try:
        H = H.view(-1, n, C)
    except RuntimeError:
        H = H.reshape(-1, n, C)
    P = list(params) + [None] * (4 - len(params))
    K, n_perm = _projection_sizes(XW, W, params, kind, n)
    hr = rows_of_h(params, kind, n)
    blocks = dict(BT=stream_tile(n, C, n_perm, H.shape[0], hr), NP=next_pow2(n),
                  NP1=next_pow2(n + hr), PP=next_pow2(n_perm), BC=stream_columns(C))
    return (H, (None if XW is None else XW.contiguous()), (None if W is None else W.contiguous()),
            P, (n, C, K, n_perm, hr), blocks)


def rows_of_h(params, kind, n):
    """The rows of A^T that read h (hr): the width's columns beyond the n streams' (HC 1, Frac
    m = n); the mHC family's 1."""
    return 1 if kind in MANIFOLD else params[0].shape[-1] - n


def _last_update(post_in, u_in):
    """The last sublayer's post and update as the kernels read them (contiguous), or Nones."""
    return (None, None) if post_in is None else (post_in.contiguous(), u_in.contiguous())


@torch.library.custom_op('resroute::stream_mix', mutates_args=())
def _triton_stream_mix(H: Tensor, post_in: Optional[Tensor], u_in: Optional[Tensor],
                       XW: Optional[Tensor], UW: Optional[Tensor], W: Optional[Tensor],
                       params: List[Tensor], i: int, kind: int,
                       replay: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """h (B, T, C), H' (B, T, n, C), post (B, T, n, 1) of sublayer i's HC or mHC-lite step (the
    replay: no h, a tensor of no elements), and XW: HC's (B, T, n, n + 2), which the kernel projects
    when given W, or mHC-lite's (N, K) combined from H' W (XW) and UW (see _combined_projection),
    else a tensor of no elements. params (and HC's W): the stacked parameters (L, ...). The streams:
    H, or given the last sublayer's post_in (B, T, n, 1) and update u_in (B, T, C), H' + post_in^T
    u_in with H the last H'."""
    acc, acc_tl = accumulator(H.dtype)
    H3, XW, W, P, (n, C, K, n_perm, hr), blocks = _stream_args(H, XW, W, params, kind)
    N = H3.shape[0]
    h = H.new_empty((0,) if replay else H.shape[:-2] + (hr * C,))
    mixed = H.new_empty(H.shape)
    # a column: advance adds post u as is
    post = torch.empty(H.shape[:-1] + (1,), device=H.device, dtype=acc)
    projected = torch.empty(_projected_shape(H, XW, UW, W), device=H.device, dtype=acc)
    post_last, u_last = _last_update(post_in, u_in)
    _stream_mix_fwd[(triton.cdiv(N, blocks['BT']),)](
        H=H3,  # (N, n, C)
        POST_IN=post_last,  # (B, T, n, 1) or None
        U_IN=u_last,  # (B, T, C) or None
        UW=UW,  # (N, n K) or None
        W=W,  # (L, C, K) or None
        XW_IN=XW,  # (N, K) or None
        XW=projected if projected.numel() else XW,
        P0=P[0],
        P1=P[1],
        P2=P[2],
        P3=P[3],
        OUT_H=h,  # (B, T, C), or no elements (replay)
        OUT_MIXED=mixed,  # (B, T, n, C)
        OUT_POST=post,  # (B, T, n, 1)
        i=i, stride_t=H3.stride(0), stride_k=H3.stride(1),
        N=N, n=n, C=C, K=K, n_perm=n_perm, hr=hr, eps=RMS_EPS, FRAC=hr > 1,
        LITE=kind in MANIFOLD, DYNAMIC=kind == HC, PROJECT=W is not None, COMBINE=UW is not None,
        SINKHORN=kind == MHC, ITERS=ITERATIONS, IP=next_pow2(ITERATIONS),
        REPLAY=replay, ADD=post_in is not None, ACC=acc_tl, KP=next_pow2(K), **blocks)
    return h, mixed, post, projected


def _projected_shape(H, XW, UW, W):
    """The shape of the XW the forward kernel writes: HC's (..., n, K) given W, mHC-lite's combined
    (N, K) given UW, else none."""
    if W is not None:
        return H.shape[:-1] + (W.shape[-1],)
    if UW is not None:
        return XW.shape
    return (0,)


@_triton_stream_mix.register_fake
def _(H, post_in, u_in, XW, UW, W, params, i, kind, replay):
    acc, C = accumulator(H.dtype)[0], H.shape[-1]
    hr = rows_of_h(params, kind, H.shape[-2])
    return (H.new_empty((0,) if replay else H.shape[:-2] + (hr * C,)), H.new_empty(H.shape),
            H.new_empty(H.shape[:-1] + (1,), dtype=acc),
            H.new_empty(_projected_shape(H, XW, UW, W), dtype=acc))


@torch.library.custom_op('resroute::stream_mix_backward', mutates_args=())
def _triton_stream_mix_backward(H: Tensor, post_in: Optional[Tensor], u_in: Optional[Tensor],
                                XW: Optional[Tensor], UW: Optional[Tensor], W: Optional[Tensor],
                                params: List[Tensor], i: int, kind: int, grad_h: Tensor,
                                grad_mixed: Tensor, grad_post: Tensor, low: Optional[torch.dtype]
                                ) -> Tuple[Tensor, List[Tensor], Tensor, List[Tensor]]:
    """d H (HC: whole; mHC-lite: without the projection's GEMM), [d XW] (mHC-lite; else []), each
    program's partial sums of the parameters' gradients ([width | depth | s_a, s_b | W (C, n + 2)]
    or [alpha | bias]), to be summed over programs, and given post_in and u_in (the streams formed
    as in the forward; d H is then d H' of the last sublayer) [d u_in, d post_in], HC's whole,
    mHC-lite's without its GEMM's share of d u_in, followed by mHC-lite's [the streams formed as
    rows (N, n C), in `low` (autocast's dtype) where given, and post_in^T d XW (N, n K) for that
    share], else []. UW: mHC-lite's u_in [W_1 | .. | W_n] of the forward (see
    _combined_projection)."""
    acc, acc_tl = accumulator(H.dtype)
    H3, XW, W, P, (n, C, K, n_perm, hr), blocks = _stream_args(H, XW, W, params, kind)
    N = H3.shape[0]
    d_H = torch.empty(H.shape, device=H.device, dtype=H.dtype)
    d_XW = torch.empty(XW.shape, device=H.device, dtype=acc) if kind in MANIFOLD else None
    last = _last_outputs(H, post_in, u_in, UW, kind, low)
    programs, n_part = _stream_parts(kind, n, C, K, n_perm, N, hr)
    parts = torch.empty((programs, n_part), device=H.device, dtype=acc)
    post_last, u_last = _last_update(post_in, u_in)
    _stream_mix_bwd[(programs,)](
        H=H3,  # (N, n, C)
        POST_IN=post_last,  # (B, T, n, 1) or None
        U_IN=u_last,  # (B, T, C) or None
        UW=None if UW is None else UW.contiguous(),  # (N, n K) or None
        W=W,  # (L, C, K) or None
        XW=XW,  # HC: (B, T, n, K); mHC-lite: (N, K); or None
        P0=P[0],
        P1=P[1],
        P2=P[2],
        P3=P[3],
        G_H=grad_h.contiguous(),  # (B, T, C)
        G_MIXED=grad_mixed.contiguous(),  # (B, T, n, C)
        G_POST=grad_post.contiguous(),  # (B, T, n, 1)
        D_H=d_H,  # (B, T, n, C)
        D_U=last[0],  # d u_in (B, T, C) or None
        D_POST_IN=last[1],  # d post_in (B, T, n, 1) or None
        OUT_H=last[2],  # mHC-lite: the streams formed (N, n C), or None
        D_UW=last[3],  # mHC-lite: post_in^T d XW (N, n K), or None
        D_XW=d_XW,  # (N, K) or None
        PART=parts,  # (programs, n_part)
        i=i, stride_t=H3.stride(0), stride_k=H3.stride(1),
        N=N, n=n, C=C, K=K, n_perm=n_perm, n_part=n_part, hr=hr, eps=RMS_EPS, FRAC=hr > 1,
        LITE=kind in MANIFOLD, DYNAMIC=kind == HC, ADD=post_in is not None, ACC=acc_tl,
        SINKHORN=kind == MHC, ITERS=ITERATIONS, IP=next_pow2(ITERATIONS),
        KP=next_pow2(K), **blocks)
    return d_H, [] if d_XW is None else [d_XW], parts, [t for t in last if t is not None]


@_triton_stream_mix_backward.register_fake
def _(H, post_in, u_in, XW, UW, W, params, i, kind, grad_h, grad_mixed, grad_post, low):
    acc, (n, C), N = accumulator(H.dtype)[0], H.shape[-2:], H.numel() // (H.shape[-2] * H.shape[-1])
    K, n_perm = _projection_sizes(XW, W, params, kind, n)
    return (H.new_empty(H.shape), [XW.new_empty(XW.shape, dtype=acc)] if kind in MANIFOLD else [],
            H.new_empty(_stream_parts(kind, n, C, K, n_perm, N, rows_of_h(params, kind, n)), dtype=acc),
            [t for t in _last_outputs(H, post_in, u_in, UW, kind, low) if t is not None])


def _stream_parts(kind, n, C, K, n_perm, N, hr):
    """The stream backward's partial sums: (programs, numbers a program), [alpha | bias] of
    the mHC family, [width | depth | s_a, s_b | W (C, K)] of HC ([width | depth] of static HC)."""
    if kind in MANIFOLD:
        n_part = 3 + 2 * n + n_perm
    elif kind == HC:
        n_part = n * (n + hr) + n + (2 + C * K)
    else:
        n_part = n * (n + hr) + n
    return reduction_programs(-(-N // stream_tile(n, C, n_perm, N, hr))), n_part


def _last_outputs(H, post_in, u_in, UW, kind, low):
    """The stream backward's outputs for the last sublayer's update (see
    _triton_stream_mix_backward): d u_in, d post_in, and mHC-lite's streams formed and
    post_in^T d XW (in u_in's dtype, as its GEMM), or None."""
    if post_in is None:
        return None, None, None, None
    grads = (torch.empty(u_in.shape, device=H.device, dtype=u_in.dtype),
             torch.empty(post_in.shape, device=H.device, dtype=post_in.dtype))
    if kind in MANIFOLD:
        rows = (H.numel() // (H.shape[-2] * H.shape[-1]), H.shape[-2] * H.shape[-1])
        return *grads, torch.empty(rows, device=H.device, dtype=low or H.dtype), torch.empty(
            UW.shape, device=H.device, dtype=u_in.dtype)
    return *grads, None, None


@torch.library.custom_op('resroute::advance_backward', mutates_args=())
def _triton_advance_backward(grad: Tensor, update: Tensor, post: Tensor) -> Tuple[Tensor, Tensor]:
    n, C = grad.shape[-2:]
    N = grad.numel() // (n * C)
    BT = stream_tile(n, C, 1, N, 1)
    d_update, d_post = torch.empty_like(update), torch.empty_like(post)
    _advance_bwd[(triton.cdiv(N, BT),)](
        G=grad.contiguous(),  # (..., n, C)
        U=update.contiguous(),  # (..., C)
        POST=post.contiguous(),  # (..., n, 1)
        D_U=d_update,
        D_POST=d_post,
        N=N,
        n=n,
        C=C,
        FRAC=update.shape[-1] != C, ACC=accumulator(grad.dtype)[1], BT=BT, NP=next_pow2(n),
        BC=stream_columns(C))
    return d_update, d_post


@_triton_advance_backward.register_fake
def _(grad, update, post):
    return torch.empty_like(update), torch.empty_like(post)
