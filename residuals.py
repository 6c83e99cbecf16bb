"""
Residual routing methods, one class each; ../shared/SPEC.md gives the maths.

Interface: `Cls(config)` is an nn.Module whose `forward(x, sublayers)` takes the embedding
output x = e (B, T, C) and the list of the L = 2*n_layer sublayer callables (attention, MLP,
attention, ...), runs them, and returns the (B, T, C) tensor that goes into the final norm.
The class attribute `sublayer_norm` says whether sublayers keep their own pre-norm.
Everything here works per token, so causality is the attention's alone.

To add a method: write one class below and add one line to RESIDUALS at the bottom.
"""
import itertools
import math

import torch
import torch.nn as nn
from torch.nn import functional as F

import kernels


class PreNorm(nn.Module):
    """x <- x + f_i(x): the standard pre-norm residual (GPT-2, nanoGPT)."""
    sublayer_norm = True

    def __init__(self, config):
        super().__init__()

    def forward(self, x, sublayers):
        for f in sublayers:
            x = x + f(x)
        return x


class ReZero(nn.Module):
    """x <- x + a_i f_i(x), a_i init 0, no pre-norm (Bachlechner et al. 2020, arXiv 2003.04887)."""
    sublayer_norm = False

    def __init__(self, config):
        super().__init__()
        # one scalar per sublayer (our choice; the reference shares one per layer)
        self.alpha = nn.Parameter(torch.zeros(2 * config.n_layer))

    def forward(self, x, sublayers):
        for alpha, f in zip(self.alpha, sublayers):
            x = x + alpha * f(x)
        return x


class LayerScale(nn.Module):
    """x <- x + diag(lambda_i) f_i(x), lambda_i init eps (Touvron et al. 2021, CaiT, arXiv 2103.17239)."""
    sublayer_norm = True

    def __init__(self, config):
        super().__init__()
        eps = config.layerscale_init or self.depth_rule(config.n_layer)
        self.scale = nn.Parameter(torch.full((2 * config.n_layer, config.n_embd), eps))

    @staticmethod
    def depth_rule(n_layer):
        """CaiT's initial scale: 0.1 up to 18 layers, 1e-5 up to 24, 1e-6 deeper."""
        return 0.1 if n_layer <= 18 else 1e-5 if n_layer <= 24 else 1e-6

    def forward(self, x, sublayers):
        for scale, f in zip(self.scale, sublayers):
            x = x + scale * f(x)
        return x


# ----------------------------------------------------------------------------- Attention Residuals

RMS_EPS = kernels.RMS_EPS  # 1e-6: one value for the PyTorch code and the kernels


def upcast(x):
    """float32 for half-precision tensors (scores and softmax never run in bf16); others as they are."""
    return x.float() if x.element_size() < 4 else x


def rms_norm(x, eps=RMS_EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def depth_mix(sources, query, bias=None):
    """Softmax attention over depth: sum_s softmax_s(query . RMSNorm(v_s) + bias_s) v_s.

    sources (S, B, T, C), query (C,), bias (S,) or None -> mixed (B, T, C), weights (S, B, T).
    Keys are normalised, values stay raw; scores and softmax in float32, no 1/sqrt(C) scale.
    This is the reference: plain autograd, the oracle of DepthMix and of the kernels."""
    values = upcast(sources)
    logits = rms_norm(values) @ upcast(query)
    if bias is not None:
        logits = logits + upcast(bias)[:, None, None]
    weights = logits.softmax(dim=0)
    return (weights.unsqueeze(-1) * values).sum(0).to(sources.dtype), weights


def weighted_sum(weights, values):
    """sum_k weights[:, k, ..., None] * values[k]: weights (I, K, B, T), K values (B, T, C) -> (I, B, T, C).
    einsum('ikbt,kbtc->ibtc') is the same, but on CPU PyTorch runs it as one tiny matmul per token,
    3-10x slower at our sizes; K fused multiply-adds instead."""
    out = weights[:, 0, ..., None] * values[0]
    for k in range(1, len(values)):
        out.addcmul_(weights[:, k, ..., None], values[k])
    return out


class DepthMix(torch.autograd.Function):
    """depth_mix for m queries at once over a list of S sources, with a hand-written backward.

    queries (m, C), bias (m, S) or None -> mixed (m, B, T, C), lse (m, B, T), weights (m, S, B, T).
    lse_j = logsumexp_s l_js lets a caller merge more sources later with an online softmax (the
    AttnRes paper's two-phase computation: all queries of a block read the finished blocks in one
    pass). It works one source at a time and saves per-token statistics (1/RMS per source, lse per
    query: the weights are recomputed in the backward) and references to the sources, never a
    stacked copy (with plain autograd, Full AttnRes would keep an (S, B, T, C)
    stack per sublayer: L^2 memory; on CPU, passes over such stacks also cost 3x the time).
    With r_s = 1/RMS(v_s), l_js = r_s v_s.q_j + b_js, w = softmax_s(l), out_j = sum_s w_js v_s and
    g_j, h_j the gradients of out_j and lse_j: dl_js = w_js (g_j.v_s - g_j.out_j + h_j), and
    dv_s = sum_j [w_js g_j + dl_js r_s q_j - dl_js r_s^2 (r_s v_s.q_j) v_s / C]."""

    @staticmethod
    def forward(ctx, queries, bias, *sources):
        values = [upcast(v) for v in sources]
        rinv = torch.stack([torch.rsqrt(v.pow(2).mean(-1) + RMS_EPS) for v in values])  # r_s (S, B, T)
        scores, logits = DepthMix.logits(queries, bias, values, rinv)
        lse = torch.logsumexp(logits, dim=1)
        weights = torch.exp(logits - lse.unsqueeze(1))
        mixed = weighted_sum(weights, values).to(sources[0].dtype)
        ctx.save_for_backward(queries, bias, rinv, lse, *sources)
        ctx.mark_non_differentiable(weights)
        return mixed, lse, weights

    @staticmethod
    def logits(queries, bias, values, rinv):
        """The scores q_j . RMSNorm(v_s) and the logits (scores + bias), both (m, S, B, T)."""
        q = upcast(queries).T
        scores = rinv * torch.stack([v @ q for v in values]).permute(3, 0, 1, 2)
        return scores, scores if bias is None else scores + upcast(bias)[:, :, None, None]

    @staticmethod
    def backward(ctx, grad_mixed, grad_lse, _):
        queries, bias, rinv, lse, *sources = ctx.saved_tensors
        g, q, values = upcast(grad_mixed), upcast(queries), [upcast(v) for v in sources]
        m, C = q.shape
        scores, logits = DepthMix.logits(queries, bias, values, rinv)
        weights = torch.exp(logits - lse.unsqueeze(1))
        grad_weights = torch.stack([torch.einsum('btc,mbtc->mbt', v, g) for v in values], dim=1)  # g_j . v_s
        grad_logits = weights * (grad_weights - (weights * grad_weights).sum(1, keepdim=True)
                                 + grad_lse.unsqueeze(1))
        scaled = grad_logits * rinv  # dl_js r_s
        along_value = (scaled * rinv * scores).sum(0) / C
        grad_queries, grad_values = torch.zeros_like(q), []
        for s, v in enumerate(values):  # dv_s built in place, one source at a time
            grad = v * -along_value[s].unsqueeze(-1)
            for j in range(m):
                grad.addcmul_(weights[j, s].unsqueeze(-1), g[j])
            grad.view(-1, C).addmm_(scaled[:, s].reshape(m, -1).T, q)
            grad_queries.addmm_(scaled[:, s].reshape(m, -1), v.reshape(-1, C))
            grad_values.append(grad.to(sources[s].dtype))
        grad_bias = grad_logits.sum(dim=(2, 3)) if bias is not None else None
        return (grad_queries.to(queries.dtype), grad_bias, *grad_values)


class DepthRouter(nn.Module):
    """What the AttnRes family shares: one zero-init pseudo-query per sublayer (index i) and one
    for the output mixer (index L), so that at init every read is the plain average of its
    sources. Set `self.recorded = []` to collect, for every read in order, a dict with the
    query index, its weights (S, B, T) and which sources are WAV details (for analyze.py).
    `self.kernels` ('torch' or 'triton', see kernels.py) picks who computes the depth mixing."""
    sublayer_norm = True

    def __init__(self, config):
        super().__init__()
        self.queries = nn.Parameter(torch.zeros(2 * config.n_layer + 1, config.n_embd))
        self.recorded = None
        self.kernels = 'torch'

    def depth_mix(self, queries, bias, sources):
        """DepthMix or its Triton kernel -> mixed (m, B, T, C), lse (m, B, T), weights or None.
        The kernel returns no weights, so a recording run uses DepthMix."""
        if self.kernels == 'triton' and self.recorded is None:
            return *kernels.triton_depth_mix(queries, bias, list(sources)), None
        return DepthMix.apply(queries, bias, *sources)

    def mix(self, i, sources, bias=None, is_detail=None):
        """Query i reads the sources: sum_s softmax_s(q_i . RMSNorm(v_s) + bias_s) v_s."""
        return self.read(i, self.mix_many(i, 1, sources, None if bias is None else bias[None]), 0,
                         is_detail=is_detail)

    def mix_many(self, first, n, sources, bias=None):
        """Phase 1: queries first..first+n-1 against the same sources, in one pass over them.
        Returns mixed and lse as tuples of n rows (unbound once: indexing row k of the whole tensor
        would give every row's backward a zero gradient of the whole size), and the weights."""
        mixed, lse, weights = self.depth_mix(self.queries[first:first + n], bias, sources)
        return mixed.unbind(0), lse.unbind(0), weights

    def read(self, i, done, k, more=(), more_bias=None, is_detail=None):
        """Phase 2: row k of a mix_many result for query i, merged by an online softmax with
        further sources (the current block's) that query i alone reads. is_detail flags the
        sources that are WAV details, for the recording only."""
        mixed, lse, weights = (None if t is None else t[k] for t in done)
        if more:
            more_mixed, more_lse, more_weights = (None if t is None else t[0] for t in self.mix_many(
                i, 1, more, None if more_bias is None else more_bias[None]))
            total = torch.logaddexp(lse, more_lse)
            old, new = torch.exp(lse - total), torch.exp(more_lse - total)
            mixed = old.unsqueeze(-1).to(mixed.dtype) * mixed + new.unsqueeze(-1).to(mixed.dtype) * more_mixed
            if self.recorded is not None:
                weights = torch.cat([weights * old, more_weights * new])
        if self.recorded is not None:
            flags = list(is_detail) if is_detail is not None else [False] * len(weights)
            self.recorded.append({'query': i, 'weights': weights.detach(), 'is_detail': flags})
        return mixed


class AttnRes(DepthRouter):
    """Full AttnRes: h_i = sum_s alpha_{s->i} v_s over {e, u_0..u_{i-1}} (Kimi Team, arXiv 2603.15031).
    Computed in chunks of about sqrt(L) sublayers, as Block AttnRes is (the same maths, far fewer
    reads): the chunk's queries read the finished sources in one pass, and each merges the chunk's
    own fresh updates by an online softmax."""

    def forward(self, x, sublayers):
        L, sources = len(sublayers), [x]  # e, u_0, u_1, ...
        chunk = max(1, math.isqrt(L))
        for start in range(0, L, chunk):
            m = min(chunk, L - start)
            finished, fresh = self.mix_many(start, m, sources), []
            for k in range(m):
                fresh.append(sublayers[start + k](self.read(start + k, finished, k, fresh)))
            sources = sources + fresh
        return self.mix(L, sources)


class BlockAttnRes(DepthRouter):
    """Block AttnRes: read {e, C_0..C_{n-1}, PC}, block sums C_n of res_block_size layers and the
    running partial sum PC of the current block (Kimi Team, arXiv 2603.15031)."""

    def __init__(self, config):
        super().__init__(config)
        # sublayers per block; auto gives about 8 blocks, as the paper recommends
        self.block_len = 2 * (config.res_block_size or max(1, config.n_layer // 8))

    def forward(self, x, sublayers):
        L, sources = len(sublayers), [x]  # e, C_0, C_1, ...: e is never summed into a block
        for start in range(0, L, self.block_len):
            m = min(self.block_len, L - start)  # the last block may be shorter
            finished = self.mix_many(start, m, sources)  # every query of the block reads e, C_0..C_{n-1}
            partial = None  # PC: the sum of the block's updates so far (excludes u_i itself)
            for k in range(m):  # ... and merges the block's partial sum PC, once it has begun
                u = sublayers[start + k](self.read(start + k, finished, k, [] if partial is None else [partial]))
                partial = u if partial is None else partial + u
            sources.append(partial)
        return self.mix(L, sources)


class DeltaAttnRes(DepthRouter):
    """Delta AttnRes: the PreNorm stream plus a gated routed read over the individual deltas,
    h_i = x_i + sigmoid(c_i) sum_s alpha_{s->i} v_s, V = {e, u_0..u_{i-1}} (arXiv 2605.18855).
    The output is the PreNorm stream x_L (the output query is unused; our reading)."""

    def __init__(self, config):
        super().__init__(config)
        self.gate_logit = nn.Parameter(torch.full((2 * config.n_layer,), -2.0))  # our choice of gate mode

    def forward(self, x, sublayers):
        L, deltas = len(sublayers), [x]  # e, u_0, u_1, ...
        chunk = max(1, math.isqrt(L))  # read in chunks, as in AttnRes
        for start in range(0, L, chunk):
            m = min(chunk, L - start)
            finished, fresh = self.mix_many(start, m, deltas), []
            for k in range(m):
                i = start + k
                u = sublayers[i](x + torch.sigmoid(self.gate_logit[i]) * self.read(i, finished, k, fresh))
                x = x + u
                fresh.append(u)
            deltas = deltas + fresh
        return x


def detail_signs(m, levels):
    """The detail bases of a block of m sublayers, one row each: phase (+1 attention, -1 MLP),
    then Haar levels: level l contrasts the two halves of each of its 2^(l-1) segments (level 1
    is the split basis: first half +1, second half -1). A segment of odd length leaves its middle
    sublayer at 0, so every row sums to zero; a segment too short gives a row of zeros.
    Plain numbers (a tuple of rows), so that code branching on them compiles without a graph break."""
    rows = [[1.0 if k % 2 == 0 else -1.0 for k in range(m)]]
    for level in range(1, levels + 1):
        n_segments = 2 ** (level - 1)
        bounds = [j * m // n_segments for j in range(n_segments + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            half = (hi - lo) // 2
            rows.append([1.0 if lo <= k < lo + half else -1.0 if hi - half <= k < hi else 0.0 for k in range(m)])
    return tuple(tuple(row) for row in rows)


def rms_match(detail, state, rho, eps=1e-6):
    """Detached RMS matching: rescale a detail tensor to its block's state RMS, at most rho times."""
    rms = lambda v: upcast(v).pow(2).mean(-1, keepdim=True).sqrt()
    scale = (rms(state) / (rms(detail) + eps)).clamp(max=rho).detach()
    return detail * scale.to(detail.dtype)


class WAV(BlockAttnRes):
    """WAV v1: Block AttnRes whose blocks also offer zero-sum detail bases, phase and split, with a
    negative learnable detail bias, detached RMS matching and a conservative readout (seed
    documents 000/001). Beyond the paper: Haar levels (wav_levels) and learned bases."""

    def __init__(self, config):
        super().__init__(config)
        m = self.block_len
        levels = max(1, min(config.wav_levels, (m // 2).bit_length()))  # while segments hold 2 sublayers
        self.levels, self.rho, self.detail_readout = levels, config.wav_rho, config.wav_detail_readout
        n_details = len(detail_signs(m, levels))
        self.detail_bias = nn.Parameter(torch.full((2 * config.n_layer + 1, n_details), config.wav_detail_bias))
        # learned bases (off by default): the signs plus a learned zero-sum correction per position
        self.basis_delta = nn.Parameter(torch.zeros(n_details, m)) if config.wav_learned_basis else None

    def basis(self, m):
        """Coefficients (n_details, m) of a block of m sublayers; every row sums to zero."""
        signs = torch.tensor(detail_signs(m, self.levels), device=self.detail_bias.device)
        if self.basis_delta is None:
            return signs
        delta = self.basis_delta[:, :m]
        return signs + delta - delta.mean(dim=1, keepdim=True)

    def forward(self, x, sublayers):
        L = len(sublayers)
        sources, kinds = [x], [-1]  # the pool of finished blocks; kinds: -1 = e or C, d = detail row d
        for start in range(0, L, self.block_len):
            m = min(self.block_len, L - start)
            signs = detail_signs(m, self.levels)
            coeffs = self.basis(m)
            # phase 1: every query of the block reads the finished pool in one pass
            finished = self.mix_many(start, m, sources, self.pool_bias(slice(start, start + m), kinds))
            partial = details = None  # PC and the raw partial details P_d, a list: one per detail row
            for k in range(m):
                i = start + k
                more, more_kinds = [], []
                if k > 0:  # the P terms only once the block has begun; rows whose support has begun
                    rows = [d for d in range(len(signs)) if any(signs[d][:k])]
                    more = [partial] + [rms_match(details[d], partial, self.rho) for d in rows]
                    more_kinds = [-1] + rows
                h = self.read(i, finished, k, more, self.pool_bias(i, more_kinds) if more else None,
                              is_detail=[kind >= 0 for kind in kinds + more_kinds])
                u = sublayers[i](h)
                partial = u if partial is None else partial + u
                terms = [coeffs[d, k].to(u.dtype) * u for d in range(len(signs))]
                details = terms if details is None else [p + t for p, t in zip(details, terms)]
            rows = [d for d in range(len(signs)) if any(signs[d])]
            sources = sources + [partial] + [rms_match(details[d], partial, self.rho) for d in rows]
            kinds = kinds + [-1] + rows
        if not self.detail_readout:  # conservative readout: e and the block sums only
            sources = [s for s, kind in zip(sources, kinds) if kind < 0]
            kinds = [-1] * len(sources)
        return self.mix(L, sources, self.pool_bias(L, kinds), [k >= 0 for k in kinds])

    def pool_bias(self, i, kinds):
        """Per-source bias for query i (an index or a slice of queries): 0 for e, C and PC, and
        detail_bias[i, d] for detail row d."""
        padded = F.pad(self.detail_bias[i], (1, 0))
        return padded[..., torch.tensor(kinds, device=padded.device) + 1]


# ----------------------------------------------------------------------------- multi-stream

class HyperConnections(nn.Module):
    """Hyper-Connections: n streams H (B, T, n, C); per sublayer the width connection gives the
    input h = A_m^T H and the mixed streams H' = A_r^T H, the depth connection H <- B^T f(h) + H'
    (Zhu et al., arXiv 2409.19606). Dynamic: tanh projections of RMSNorm(H) added to A and B.
    Readout: the mean of the streams (SPEC says sum; the final norm removes the factor n up to its
    eps, and the mean makes HC at init equal PreNorm exactly)."""
    sublayer_norm = True

    def __init__(self, config):
        super().__init__()
        n, L, C = config.hc_streams, 2 * config.n_layer, config.n_embd
        self.n, self.dynamic = n, config.hc_dynamic
        width = torch.zeros(L, n, n + 1)  # [A_m | A_r] per sublayer, rows = streams
        width[torch.arange(L), torch.arange(L) % n, 0] = 1.0  # A_m = e_{i mod n}
        width[:, :, 1:] = torch.eye(n)  # A_r = I
        self.width = nn.Parameter(width)
        self.depth = nn.Parameter(torch.ones(L, n))  # B = 1
        if self.dynamic:
            self.width_proj = nn.Parameter(torch.zeros(L, C, n + 1))  # W_a
            self.depth_proj = nn.Parameter(torch.zeros(L, C))  # W_b
            self.width_scale = nn.Parameter(torch.full((L,), 0.01))  # s_a
            self.depth_scale = nn.Parameter(torch.full((L,), 0.01))  # s_b
        self.recorded = None  # set to [] to collect the streams (n, B, T, C) after every sublayer

    def forward(self, x, sublayers):
        H = x.unsqueeze(-2).expand(*x.shape[:-1], self.n, x.shape[-1])  # e copied into n streams
        for i, f in enumerate(sublayers):
            width, depth = self.width[i], self.depth[i]
            if self.dynamic:
                Hn = rms_norm(H)
                width = width + self.width_scale[i] * torch.tanh(Hn @ self.width_proj[i])  # (B, T, n, n+1)
                depth = depth + self.depth_scale[i] * torch.tanh(Hn @ self.depth_proj[i])  # (B, T, n)
            mixed = width.transpose(-1, -2) @ H  # row 0: A_m^T H, rows 1..n: A_r^T H
            h, H = mixed[..., 0, :], mixed[..., 1:, :]
            H = H + depth.unsqueeze(-1) * f(h).unsqueeze(-2)
            if self.recorded is not None:
                self.recorded.append(H.detach().movedim(-2, 0))
        return H.mean(dim=-2)


class MHCLite(nn.Module):
    """mHC-lite: x <- H_res x + H_post^T f(H_pre x) over n streams, H_res an exact convex mix of
    all n! permutation matrices, so doubly stochastic without Sinkhorn (arXiv 2601.05732, after
    mHC, arXiv 2512.24880). Coefficients come from x' = RMSNorm of the flattened streams."""
    sublayer_norm = True

    def __init__(self, config):
        super().__init__()
        n, L, C = config.hc_streams, 2 * config.n_layer, config.n_embd
        if n > 6:
            raise ValueError(f"mhc_lite sums over all n! permutation matrices: hc_streams={n} would need "
                             f"{math.factorial(n)}; use hc_streams <= 6")
        self.n = n
        perms = torch.tensor(list(itertools.permutations(range(n))))  # the identity comes first
        self.register_buffer('permutations', torch.eye(n)[perms], persistent=False)  # (n!, n, n)
        self.proj = nn.Parameter(torch.zeros(L, n * C, 2 * n + len(perms)))  # [W_pre | W_post | W_res]
        self.alpha = nn.Parameter(torch.full((L, 3), 0.01))  # a_pre, a_post, a_res
        bias = torch.full((L, 2 * n + len(perms)), -1.0)
        bias[torch.arange(L), torch.arange(L) % n] = 1.0  # b_pre: +1 on stream i mod n
        bias[torch.arange(L), n + torch.arange(L) % n] = 1.0  # b_post likewise
        bias[:, 2 * n] = 0.0  # b_res: 0 for the identity permutation ...
        bias[:, 2 * n + 1:] = -8.0  # ... -8 for the others
        self.bias = nn.Parameter(bias)
        self.recorded = None  # set to [] to collect the streams (n, B, T, C) after every sublayer

    def coefficients(self, i, x):
        """H_pre (B, T, n), H_post (B, T, n), H_res (B, T, n, n) of sublayer i for streams x (B, T, n, C)."""
        n = self.n
        flat = rms_norm(x.flatten(-2)) @ self.proj[i]
        a_pre, a_post, a_res = self.alpha[i]
        b = self.bias[i]
        h_pre = torch.sigmoid(a_pre * flat[..., :n] + b[:n])
        h_post = 2 * torch.sigmoid(a_post * flat[..., n:2 * n] + b[n:2 * n])
        perm_weights = torch.softmax(a_res * flat[..., 2 * n:] + b[2 * n:], dim=-1)
        h_res = torch.einsum('btp,pkj->btkj', perm_weights, self.permutations.to(perm_weights.dtype))
        return h_pre, h_post, h_res

    def forward(self, x, sublayers):
        x = x.unsqueeze(-2).expand(*x.shape[:-1], self.n, x.shape[-1])
        for i, f in enumerate(sublayers):
            h_pre, h_post, h_res = self.coefficients(i, x)
            update = f((h_pre.unsqueeze(-2) @ x).squeeze(-2))
            x = h_res @ x + h_post.unsqueeze(-1) * update.unsqueeze(-2)
            if self.recorded is not None:
                self.recorded.append(x.detach().movedim(-2, 0))
        return x.sum(dim=-2)


class MultiGateResiduals(nn.Module):
    """Multi-Gate Residuals: n streams s_j (n, B, T, C); an AttnPool reads h_i = sum_j alpha_j s_j and
    every stream takes a convex step towards the update, s_j <- (1 - beta_j) s_j + beta_j f_i(h_i),
    with independent (sigmoid) or competitive (softmax with a keep logit) gates (arXiv 2605.23259)."""
    sublayer_norm = True

    def __init__(self, config):
        super().__init__()
        n, C = config.mgr_streams, config.n_embd
        L = 2 * config.n_layer - (n - 1)  # gated sublayers: the first n-1 start the streams
        if n < 1 or L < 1:
            raise ValueError(f"mgr with mgr_streams={n} needs more than {n - 1} sublayers to start its "
                             f"streams; use n_layer >= {n // 2 + 1} or fewer streams")
        if config.mgr_gate not in ('independent', 'competitive'):
            raise ValueError(f"mgr_gate={config.mgr_gate!r}; choose independent or competitive")
        self.n, self.competitive, self.scale = n, config.mgr_gate == 'competitive', C ** -0.5
        self.pool_queries = nn.Parameter(torch.zeros(2 * config.n_layer + 1, C))  # w_i; the last reads out
        self.gate_queries = nn.Parameter(torch.zeros(L, C))  # v_i
        # depth-scaled init: every gate starts at g = sigmoid(b_base) * sqrt(L_base / L)
        g = torch.sigmoid(torch.tensor(config.mgr_b_base)).item() * math.sqrt(config.mgr_L_base / L)
        if self.competitive and g * n >= 1:
            raise ValueError(f"mgr: the initial gate {g:.3f} leaves no keep weight for {n} competing streams; "
                             f"use more layers, fewer streams or a lower mgr_b_base")
        bias = math.log(1 / g - n) if self.competitive else math.log(g / (1 - g))
        self.gate_bias = nn.Parameter(torch.full((L,), bias))
        self.kernels, self.fallback_p = 'torch', 1  # how it runs, not what it computes: GPT.set_kernels
        self.recorded = None  # set to [] to collect the streams (n, B, T, C) after every sublayer

    def pool(self, i, streams):
        return depth_mix(streams, self.pool_queries[i] * self.scale)[0]

    def gates(self, j, streams):
        """beta (n, B, T) of gated sublayer j, from each stream's own state."""
        z = rms_norm(upcast(streams)) @ (upcast(self.gate_queries[j]) * self.scale)
        if self.competitive:  # softmax over [keep, stream 1..n]: the betas sum to less than 1
            keep = upcast(self.gate_bias[j]).expand_as(z[:1])
            return torch.softmax(torch.cat([keep, z]), dim=0)[1:]
        return torch.sigmoid(z + upcast(self.gate_bias[j]))

    def step(self, i, streams, u, tape, last):
        """Gated sublayer i: every stream's convex step towards u, then the AttnPool that gives
        sublayer i + 1 its input (the readout after the last). This plain version is the
        reference; kernels.mgr_step fuses it and can invert the lerp in its backward."""
        j = i - (self.n - 1)
        if self.kernels == 'torch' and self.fallback_p < 0:
            beta = self.gates(j, streams).unsqueeze(-1).to(u.dtype)
            streams = streams + beta * (u - streams)  # (1 - beta) s + beta u
            return streams, self.pool(i + 1, streams)
        return kernels.mgr_step(streams, u, self.gate_queries[j] * self.scale, self.gate_bias[j],
                                self.pool_queries[i + 1] * self.scale, self.competitive, self.fallback_p,
                                tape, i, last, self.kernels)

    def forward(self, x, sublayers):
        streams = x.unsqueeze(0)  # s_1 = e
        h = self.pool(0, streams)
        # the fused steps' inverting backward passes the streams backwards on this tape (eager only)
        tape = {} if self.fallback_p >= 0 and not torch.compiler.is_compiling() else None
        for i, f in enumerate(sublayers):
            u = f(h)
            if i < self.n - 1:  # accumulation phase: the update starts a new stream
                streams = torch.cat([streams, u.unsqueeze(0)])
                h = self.pool(i + 1, streams)
            else:
                streams, h = self.step(i, streams, u, tape, last=i == len(sublayers) - 1)
            if self.recorded is not None:
                self.recorded.append(streams.detach())
        return h


RESIDUALS = {
    'prenorm': PreNorm,
    'rezero': ReZero,
    'layerscale': LayerScale,
    'attnres': AttnRes,
    'block_attnres': BlockAttnRes,
    'delta_attnres': DeltaAttnRes,
    'wav': WAV,
    'hc': HyperConnections,
    'mhc_lite': MHCLite,
    'mgr': MultiGateResiduals,
}
