"""
Residual routing methods: the maths, one class each (docs/METHODS.md is the contract).

Interface: `Cls(config)` is an nn.Module whose `forward(x, sublayers)` takes the embedding output
x = e (B, T, C) and the L = 2*n_layer sublayers in order (attention, MLP, attention, ...), runs them,
and returns the (B, T, C) tensor that goes into the final norm. The class attribute `sublayer_norm`
says whether the sublayers keep their own pre-norm, and `equals_at_init` names the registered method whose
logits it gives at init with the same shared weights (None: none does), which the tests check. Everything
works per token, so causality is the attention's alone.

This file is the reference: plain autograd, each forward written as its paper writes the equations
(`--kernels=reference` runs exactly this). The kernels package computes the same maths faster, and
the tests hold the two equal. Each routing computation (a read over depth, an AttnPool, the gates, the stream
connections) is a call of a small submodule, so it can be watched from outside with a forward hook,
as analyze.py does; the classes keep no recording state.

To add a method: write one class below and add one line to RESIDUALS at the bottom.

This file stands alone (torch and the standard library): it owns the routing's RMSNorm epsilon,
upcast and rms_norm, which the kernels package imports from here.
"""
import functools
import itertools
import math

import torch
import torch.nn as nn
from torch.nn import functional as F

RMS_EPS = 1e-6  # of every RMSNorm in the routing, here and in kernels/
MATCH_EPS = 1e-6  # WAV's RMS matching: RMS(C) / (RMS(D) + eps), here and in kernels/


# ----------------------------------------------------------------------------- helpers the methods share

def upcast(x):
    """float32 for half-precision tensors (scores and softmax never run in bf16); others as they are."""
    return x.float() if x.element_size() < 4 else x


def rms_norm(x, eps=RMS_EPS):
    """x / RMS(x) over the last dimension (no gain)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- PreNorm and per-sublayer scales

class PreNorm(nn.Module):
    """x <- x + f_i(x): the standard pre-norm residual (GPT-2, nanoGPT)."""
    sublayer_norm = True
    equals_at_init = 'prenorm'

    def __init__(self, config):
        super().__init__()

    def forward(self, x, sublayers):
        for f in sublayers:
            x = x + f(x)
        return x


class ReZero(nn.Module):
    """x <- x + a_i f_i(x), a_i init 0, no pre-norm (Bachlechner et al. 2020, arXiv 2003.04887)."""
    sublayer_norm = False
    equals_at_init = None  # the embedding alone: every a_i is 0

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
    equals_at_init = None  # prenorm with every update scaled by eps

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


class LaurelRW(nn.Module):
    """LAuReL-RW: x <- alpha_i f_i(x) + beta_i x, learned scalar weights of the update and of the residual,
    1 at init (Menghani, Kumar, Kumar, arXiv 2411.07501)."""
    sublayer_norm = True
    equals_at_init = 'prenorm'

    def __init__(self, config):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(2 * config.n_layer))
        self.beta = nn.Parameter(torch.ones(2 * config.n_layer))

    def forward(self, x, sublayers):
        for alpha, beta, f in zip(self.alpha, self.beta, sublayers):
            x = alpha * f(x) + beta * x
        return x


class LaurelLR(nn.Module):
    """LAuReL-LR: x <- f_i(x) + x + B_i A_i x, a learned rank-r map added to the residual, A_i (r, C),
    B_i (C, r), B_i = 0 at init (Menghani, Kumar, Kumar, arXiv 2411.07501; its rank-64 form is Gemma 3n's)."""
    sublayer_norm = True
    equals_at_init = 'prenorm'

    def __init__(self, config):
        super().__init__()
        L, r, C = 2 * config.n_layer, config.laurel_rank, config.n_embd
        self.down = nn.Parameter(torch.randn(L, r, C) * C ** -0.5)  # A: our choice, unit gain on a unit-RMS x
        self.up = nn.Parameter(torch.zeros(L, C, r))  # B

    def forward(self, x, sublayers):
        for A, B, f in zip(self.down, self.up, sublayers):
            x = f(x) + x + (x @ A.t()) @ B.t()
        return x


# ----------------------------------------------------------------------------- Attention Residuals

class DepthAttention(nn.Module):
    """Softmax attention over depth with one learned pseudo-query w_i per reader i (AttnRes, arXiv 2603.15031):

        read(i, V) = sum_s alpha_s v_s,   alpha_s = softmax_s(scale * w_i . RMSNorm(v_s) + b_s)

    Keys are RMS-normalised, values stay raw, the softmax runs in float32. The queries start at zero,
    so at init every read is the plain average of its sources. b_s is 0, except for `details` (WAV's
    detail sources), which get `detail_bias`. AttnRes has no scale; MGR's AttnPool divides by sqrt(C)."""

    def __init__(self, n_readers, n_embd, scale=1.0):
        super().__init__()
        self.queries = nn.Parameter(torch.zeros(n_readers, n_embd))
        self.scale = scale

    def weights(self, i, sources, details=(), detail_bias=None):
        """alpha (S, B, T), float32: the sources first, then the details."""
        query = upcast(self.queries[i]) * self.scale
        logits = torch.stack([rms_norm(upcast(v)) @ query for v in (*sources, *details)])
        if len(details):
            logits = logits + F.pad(upcast(detail_bias), (len(sources), 0))[:, None, None]
        return logits.softmax(dim=0)

    def forward(self, i, sources, details=(), detail_bias=None):
        values = (*sources, *details)
        alpha = self.weights(i, sources, details, detail_bias)
        h = sum(a.unsqueeze(-1) * upcast(v) for a, v in zip(alpha, values))
        return h.to(functools.reduce(torch.promote_types, [v.dtype for v in values]))


class AttnRes(nn.Module):
    """Full AttnRes: h_i = sum_s alpha_{s->i} v_s over V = {e, u_0..u_{i-1}}, and the output mixer
    over {e, u_0..u_{L-1}} (Kimi Team, arXiv 2603.15031)."""
    sublayer_norm = True
    equals_at_init = None  # every read the average of its sources

    def __init__(self, config):
        super().__init__()
        self.read = DepthAttention(2 * config.n_layer + 1, config.n_embd)  # w_0..w_{L-1}, then the output's

    def forward(self, x, sublayers):
        sources = [x]  # e, u_0, u_1, ...
        for i, f in enumerate(sublayers):
            sources.append(f(self.read(i, sources)))
        return self.read(len(sublayers), sources)


class BlockAttnRes(nn.Module):
    """Block AttnRes: sublayer i reads {e, C_0..C_{n-1}, PC}, the sums C_n of the finished blocks of
    res_block_size layers and the running partial sum PC of its own block (Kimi Team, arXiv 2603.15031)."""
    sublayer_norm = True
    equals_at_init = None  # every read the average of its sources

    def __init__(self, config):
        super().__init__()
        self.read = DepthAttention(2 * config.n_layer + 1, config.n_embd)
        # sublayers per block; auto gives about 8 blocks, as the paper recommends
        self.block_len = 2 * (config.res_block_size or max(1, config.n_layer // 8))

    def forward(self, x, sublayers):
        L = len(sublayers)
        states = [x]  # e, C_0, C_1, ... (e is never summed into a block)
        for start in range(0, L, self.block_len):
            block = sublayers[start:start + self.block_len]  # m sublayers; the last block may be shorter
            updates = []
            for k, f in enumerate(block):
                i = start + k
                if updates:  # the partial sum PC of the block's updates so far (u_i excluded)
                    h = self.read(i, states + [sum(updates)])
                else:
                    h = self.read(i, states)
                updates.append(f(h))
            states = states + [sum(updates)]  # the finished block's sum C_n
        return self.read(L, states)


class DeltaAttnRes(nn.Module):
    """Delta AttnRes: the PreNorm stream plus a gated routed read over the individual deltas,
    h_i = x_i + sigmoid(c_i) sum_s alpha_{s->i} v_s, V = {e, u_0..u_{i-1}} (arXiv 2605.18855).
    The output is the PreNorm stream x_L (the output query is unused; our reading)."""
    sublayer_norm = True
    equals_at_init = None  # prenorm plus sigmoid(-2) times an average of the deltas

    def __init__(self, config):
        super().__init__()
        self.read = DepthAttention(2 * config.n_layer + 1, config.n_embd)
        self.gate_logit = nn.Parameter(torch.full((2 * config.n_layer,), -2.0))  # our choice of gate mode

    def forward(self, x, sublayers):
        deltas = [x]  # e, u_0, u_1, ...
        for i, f in enumerate(sublayers):
            u = f(x + torch.sigmoid(self.gate_logit[i]) * self.read(i, deltas))
            x = x + u
            deltas.append(u)
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


def rms_match(detail, state, rho, eps=MATCH_EPS):
    """Detached RMS matching: D~ = s D, s = min(rho, stopgrad(RMS(C) / (RMS(D) + eps))), per token."""
    rms = lambda v: upcast(v).pow(2).mean(-1, keepdim=True).sqrt()
    scale = (rms(state) / (rms(detail) + eps)).clamp(max=rho).detach()
    return detail * scale.to(detail.dtype)


class WAV(BlockAttnRes):
    """WAV v1: Block AttnRes whose blocks also offer zero-sum detail bases of their updates, phase and
    split, with a negative learnable detail bias, detached RMS matching and a conservative readout
    ("Multi-Resolution Residual Routing for Deep Decoder-Only Transformers", WAV v1; no arXiv id yet).
    Beyond the paper: Haar levels (wav_levels) and learned bases."""
    equals_at_init = None  # Block AttnRes's reads, each detail source at weight e^-2 beside every other source

    def __init__(self, config):
        super().__init__(config)
        m = self.block_len
        levels = max(1, min(config.wav_levels, (m // 2).bit_length()))  # while segments hold 2 sublayers
        self.levels, self.rho, self.detail_readout = levels, config.wav_rho, config.wav_detail_readout
        n_types = len(detail_signs(m, levels))  # phase, split (and more Haar levels)
        self.detail_bias = nn.Parameter(torch.full((2 * config.n_layer + 1, n_types), config.wav_detail_bias))
        # learned bases (off by default): the signs plus a learned zero-sum correction per position
        self.basis_delta = nn.Parameter(torch.zeros(n_types, m)) if config.wav_learned_basis else None

    def basis(self, m):
        """Coefficients (n_types, m) of a block of m sublayers; every row sums to zero."""
        signs = torch.tensor(detail_signs(m, self.levels), device=self.detail_bias.device)
        if self.basis_delta is None:
            return signs
        delta = self.basis_delta[:, :m]
        return signs + delta - delta.mean(dim=1, keepdim=True)

    def begun(self, m, k):
        """The detail types of a block of m sublayers whose support has begun within its first k."""
        return [d for d, row in enumerate(detail_signs(m, self.levels)) if any(row[:k])]

    def match(self, detail, state):
        return rms_match(detail, state, self.rho)

    def summarize(self, updates, m):
        """The state C = sum_k u_k of a block of m sublayers (or of its first updates: PC) and its
        detail sources D~_d = match(sum_k coeff_dk u_k, C), with their types d."""
        state, coeffs, types = sum(updates), self.basis(m), self.begun(m, len(updates))
        details = [self.match(sum(c * u for c, u in zip(coeffs[d], updates)), state) for d in types]
        return state, details, types

    def forward(self, x, sublayers):
        L = len(sublayers)
        states, details, types = [x], [], []  # e, C_0, C_1, ...; the finished blocks' D~ and their types
        for start in range(0, L, self.block_len):
            block = sublayers[start:start + self.block_len]  # m sublayers; the last block may be shorter
            updates = []
            for k, f in enumerate(block):
                i = start + k
                if updates:  # the P terms only once the block has begun
                    partial, partial_details, partial_types = self.summarize(updates, len(block))
                    h = self.read(i, states + [partial], details + partial_details,
                                  self.detail_bias[i, types + partial_types])
                else:
                    h = self.read(i, states, details, self.detail_bias[i, types])
                updates.append(f(h))
            state, block_details, block_types = self.summarize(updates, len(block))
            states, details, types = states + [state], details + block_details, types + block_types
        if self.detail_readout:
            return self.read(L, states, details, self.detail_bias[L, types])
        return self.read(L, states)  # conservative readout: e and the block sums only


# ----------------------------------------------------------------------------- multi-stream

def copies(x, n):
    """The embedding x (B, T, C) copied into n streams (B, T, n, C), a view."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])


class HCConnections(nn.Module):
    """The connections of every sublayer i of HC (and of Frac-Connections) over the rows of a state H (n, d):
    width W (n, k) and depth B (n,), static, plus (dynamic) s_a tanh(Hn W_a) and s_b tanh(Hn W_b) of the
    RMS-normalised rows Hn, per token. HC: n streams of C channels, W = [A_m | A_r] (n, n+1); Frac-Connections:
    m fractions of C/m channels, W = [Gamma | A] (m, 2m). width: W's static start (L, n, k); B = 1."""

    def __init__(self, config, width, channels):
        super().__init__()
        L, n, k = width.shape
        self.width = nn.Parameter(width)  # rows = the state's rows
        self.depth = nn.Parameter(torch.ones(L, n))  # B = 1
        self.dynamic = config.hc_dynamic
        if self.dynamic:
            self.proj = nn.Parameter(torch.zeros(L, channels, k + 1))  # [W_a | W_b]
            self.width_scale = nn.Parameter(torch.full((L,), 0.01))  # s_a
            self.depth_scale = nn.Parameter(torch.full((L,), 0.01))  # s_b

    def forward(self, i, H):
        """W (n, k) and B (n,) of sublayer i, per token (B, T, n, k) and (B, T, n) when dynamic, for the
        state H (B, T, n, d)."""
        width, depth = self.width[i], self.depth[i]
        if self.dynamic:
            projected = rms_norm(H) @ self.proj[i]  # Hn [W_a | W_b] (B, T, n, k+1)
            width = width + self.width_scale[i] * torch.tanh(projected[..., :-1])
            depth = depth + self.depth_scale[i] * torch.tanh(projected[..., -1])
        return width, depth


class HyperConnections(nn.Module):
    """Hyper-Connections: n streams H (B, T, n, C); per sublayer the width connection gives the
    input h = A_m^T H and the mixed streams H' = A_r^T H, the depth connection H <- B^T f(h) + H'
    (Zhu et al., arXiv 2409.19606). Readout: the mean of the streams (the paper sums them; the final
    norm removes the factor n up to its eps, and the mean makes HC at init equal PreNorm exactly)."""
    sublayer_norm = True
    equals_at_init = 'prenorm'  # every stream is the PreNorm stream, and so is their mean

    def __init__(self, config):
        super().__init__()
        n, L = config.hc_streams, 2 * config.n_layer
        width = torch.zeros(L, n, n + 1)  # rows = streams
        width[torch.arange(L), torch.arange(L) % n, 0] = 1.0  # A_m = e_{i mod n}
        width[:, :, 1:] = torch.eye(n)  # A_r = I
        self.n = n
        self.connections = HCConnections(config, width, config.n_embd)

    def mix(self, i, H):
        """Sublayer i's input h = A_m^T H, the mixed streams H' = A_r^T H, and B."""
        width, depth = self.connections(i, H)
        mixed = width.transpose(-1, -2) @ H  # row 0: h; rows 1..n: H'
        return mixed[..., 0, :], mixed[..., 1:, :], depth

    def readout(self, H):
        return H.mean(dim=-2)

    def forward(self, x, sublayers):
        H = copies(x, self.n)
        for i, f in enumerate(sublayers):
            h, H, depth = self.mix(i, H)
            H = H + depth.unsqueeze(-1) * f(h).unsqueeze(-2)  # H <- H' + B^T f(h)
        return self.readout(H)


class ManifoldCoefficients(nn.Module):
    """The mHC family's H_pre, H_post and H_res of every sublayer, per token, from x' = RMSNorm of the
    flattened streams (mHC, arXiv 2512.24880):

        H_pre = sigmoid(a_pre x' W_pre + b_pre)      H_post = 2 sigmoid(a_post x' W_post + b_post)
        H_res = h_res(a_res x' W_res + b_res)        doubly stochastic: each subclass's own h_res

    W = 0 and a = 0.01; b_pre, b_post: +1 on stream i mod n, -1 elsewhere; b_res (res_bias, the
    subclass's) starts H_res at or next to the identity. H_res is computed in float32 under half
    precision autocast too: its rows and columns sum to 1 to float32's precision, not bfloat16's."""

    def __init__(self, config, res_bias):
        super().__init__()
        n, L, C = config.hc_streams, 2 * config.n_layer, config.n_embd
        self.n, K = n, 2 * n + len(res_bias)
        self.proj = nn.Parameter(torch.zeros(L, n * C, K))  # [W_pre | W_post | W_res]
        self.alpha = nn.Parameter(torch.full((L, 3), 0.01))  # a_pre, a_post, a_res
        bias = torch.full((L, K), -1.0)
        bias[torch.arange(L), torch.arange(L) % n] = 1.0  # b_pre: +1 on stream i mod n
        bias[torch.arange(L), n + torch.arange(L) % n] = 1.0  # b_post likewise
        bias[:, 2 * n:] = torch.tensor(res_bias)
        self.bias = nn.Parameter(bias)

    def h_res(self, logits):
        """H_res (..., n, n) from its logits (..., K - 2n)."""
        raise NotImplementedError

    def forward(self, i, x):
        """H_pre (B, T, n), H_post (B, T, n), H_res (B, T, n, n) of sublayer i for streams x (B, T, n, C)."""
        n = self.n
        flat = rms_norm(x.flatten(-2)) @ self.proj[i]  # x' [W_pre | W_post | W_res] (B, T, K)
        a_pre, a_post, a_res = self.alpha[i]
        b = self.bias[i]
        h_pre = torch.sigmoid(a_pre * flat[..., :n] + b[:n])
        h_post = 2 * torch.sigmoid(a_post * flat[..., n:2 * n] + b[n:2 * n])
        with torch.autocast(x.device.type, enabled=False):
            h_res = self.h_res(upcast(a_res * flat[..., 2 * n:] + b[2 * n:]))
        return h_pre, h_post, h_res


class SinkhornCoefficients(ManifoldCoefficients):
    """mHC's H_pre, H_post and H_res, with H_res from M = exp(logits) (n x n) scaled by Sinkhorn-Knopp's
    alternate normalisations of the columns and the rows, M <- T_r(T_c(M)), ITERATIONS times (the paper's
    t_max = 20): rows sum to 1 exactly, columns to within the iterations' convergence. In the log domain (log M, which cannot
    overflow): a normalisation is log M - logsumexp(log M), a log_softmax; the backward differentiates through every
    iteration. b_res: 0 on the diagonal, -8 off it."""
    ITERATIONS = 20

    def __init__(self, config):
        n = config.hc_streams
        super().__init__(config, [0.0 if row == col else -8.0 for row in range(n) for col in range(n)])

    def h_res(self, logits):
        log_m = logits.unflatten(-1, (self.n, self.n))  # log M(0) = logits
        for _ in range(self.ITERATIONS):
            log_m = log_m.log_softmax(dim=-2)  # T_c: every column sums to 1
            log_m = log_m.log_softmax(dim=-1)  # T_r: every row sums to 1
        return log_m.exp()


class PermutationCoefficients(ManifoldCoefficients):
    """mHC-lite's H_pre, H_post and H_res, with H_res an exact convex mix of all n! permutation matrices P_p,
    sum_p softmax(logits)_p P_p (arXiv 2601.05732): doubly stochastic with no iterations. b_res: 0 for the
    identity, -8 for the others. (GPTConfig keeps n! within reach: hc_streams <= 6.)"""

    def __init__(self, config):
        n = config.hc_streams
        perms = torch.tensor(list(itertools.permutations(range(n))))  # the identity comes first
        super().__init__(config, [0.0] + [-8.0] * (len(perms) - 1))
        self.register_buffer('permutations', torch.eye(n)[perms], persistent=False)  # (n!, n, n)

    def h_res(self, logits):
        weights = torch.softmax(logits, dim=-1)
        return (weights @ self.permutations.flatten(1).to(weights.dtype)).unflatten(-1, (self.n, self.n))


def kron(A, B):
    """The Kronecker product A (x) B of the last two dimensions, batched over the others: block (a, b) of
    the result is A_ab B."""
    return (A[..., :, None, :, None] * B[..., None, :, None, :]).flatten(-4, -3).flatten(-2, -1)


class KroneckerCoefficients(ManifoldCoefficients):
    """KromHC's H_pre, H_post and H_res for n = 2^K streams, with H_res = U_1 (x) U_2 (x) ... (x) U_K, each
    factor U_k = w_k0 I + w_k1 S (I and the swap S of 2 x 2), w_k = softmax of its two logits (arXiv 2601.21579). A Kronecker product of
    doubly stochastic matrices is doubly stochastic, exactly, from 2K logits (mHC-lite: n!). b_res: 0 for
    each factor's identity, -8 for its swap."""

    def __init__(self, config):
        self.factors = config.hc_streams.bit_length() - 1  # (GPTConfig checks that hc_streams is a power of 2)
        super().__init__(config, [0.0, -8.0] * self.factors)
        self.register_buffer('identity_and_swap', torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]]),
                             persistent=False)

    def h_res(self, logits):
        weights = logits.unflatten(-1, (self.factors, 2)).softmax(dim=-1)
        U = (weights @ self.identity_and_swap.to(weights.dtype)).unflatten(-1, (2, 2))  # U_1..U_K (..., K, 2, 2)
        H = weights.new_ones(*weights.shape[:-2], 1, 1)  # the 1 x 1 identity, where the product starts
        for k in range(self.factors):
            H = kron(H, U[..., k, :, :])  # 1 (x) U_1 (x) ... (x) U_k
        return H


class MHC(nn.Module):
    """mHC: x <- H_res x + H_post^T f(H_pre x) over n streams, H_res projected onto the doubly stochastic
    matrices by Sinkhorn-Knopp (Xie et al., DeepSeek, arXiv 2512.24880). Readout: the sum of the streams.
    Its variants change H_res alone (Coefficients)."""
    sublayer_norm = True
    equals_at_init = None  # H_pre = 0.73 on one stream and 0.27 on the others mixes the streams at once
    Coefficients = SinkhornCoefficients

    def __init__(self, config):
        super().__init__()
        self.n = config.hc_streams
        self.coefficients = self.Coefficients(config)

    def mix(self, i, x):
        """Sublayer i's input H_pre x, the mixed streams H_res x, and H_post."""
        h_pre, h_post, h_res = self.coefficients(i, x)
        return (h_pre.unsqueeze(-2) @ x).squeeze(-2), h_res @ x, h_post

    def readout(self, x):
        return x.sum(dim=-2)

    def forward(self, x, sublayers):
        x = copies(x, self.n)
        for i, f in enumerate(sublayers):
            h, mixed, h_post = self.mix(i, x)
            x = mixed + h_post.unsqueeze(-1) * f(h).unsqueeze(-2)  # x <- H_res x + H_post^T f(H_pre x)
        return self.readout(x)


class MHCLite(MHC):
    """mHC-lite: mHC with H_res an exact convex mix of the n! permutation matrices, no Sinkhorn
    (Yang, Gao, arXiv 2601.05732)."""
    Coefficients = PermutationCoefficients


class KromHC(MHC):
    """KromHC: mHC with H_res a Kronecker product of 2 x 2 doubly stochastic factors (Zhou, Gu, Iacovides,
    Mandic, arXiv 2601.21579)."""
    Coefficients = KroneckerCoefficients


class FracConnections(nn.Module):
    """Frac-Connections: HC over m fractions of the state instead of n copies of it. The state H (m, C/m) is
    the C channels split in m; per sublayer the sublayer reads the fractions mixed by Gamma, the fractions
    are mixed by A, and each fraction of the output is added to its own fraction with weight beta:

        H <- A^T H + diag(beta) split(f(join(Gamma^T H)))     [Gamma | A], beta: HCConnections

    (Zhu et al., arXiv 2503.14125). Gamma = A = I and beta = 1 at init: prenorm exactly. Readout: H joined."""
    sublayer_norm = True
    equals_at_init = 'prenorm'

    def __init__(self, config):
        super().__init__()
        m, L = config.frac_parts, 2 * config.n_layer
        self.m = m
        self.connections = HCConnections(config, torch.eye(m).repeat(L, 1, 2), config.n_embd // m)  # [I | I]

    def forward(self, x, sublayers):
        H = x.unflatten(-1, (self.m, -1))  # the m fractions (B, T, m, C/m), a view of x
        for i, f in enumerate(sublayers):
            width, beta = self.connections(i, H)
            mixed = width.transpose(-1, -2) @ H  # rows 0..m-1: Gamma^T H, rows m..2m-1: A^T H
            update = f(mixed[..., :self.m, :].flatten(-2)).unflatten(-1, (self.m, -1))
            H = mixed[..., self.m:, :] + beta.unsqueeze(-1) * update
        return self.readout(H)

    def readout(self, H):
        return H.flatten(-2)


class StreamGates(nn.Module):
    """MGR's gates beta_j of gated sublayer j from each stream's own state, z_j = v_j . RMSNorm(s_j) / sqrt(C):
    independent beta = sigmoid(z + b), or competitive beta = softmax([b, z_1..z_n])[1:] (sum below 1).
    v zero-init; b set so that every gate starts at g = sigmoid(b_base) sqrt(L_base / L) (depth-scaled)."""

    def __init__(self, config, n_gated):
        super().__init__()
        n, C = config.mgr_streams, config.n_embd
        self.competitive, self.scale = config.mgr_gate == 'competitive', C ** -0.5
        self.queries = nn.Parameter(torch.zeros(n_gated, C))
        # (GPTConfig checks that g leaves the streams a keep weight)
        g = torch.sigmoid(torch.tensor(config.mgr_b_base)).item() * math.sqrt(config.mgr_L_base / n_gated)
        bias = math.log(1 / g - n) if self.competitive else math.log(g / (1 - g))
        self.bias = nn.Parameter(torch.full((n_gated,), bias))

    def forward(self, j, streams):
        """beta (n, B, T), float32, for the streams (n, B, T, C)."""
        z = rms_norm(upcast(streams)) @ (upcast(self.queries[j]) * self.scale)
        b = upcast(self.bias[j])
        if self.competitive:  # index 0 of the softmax is the keep logit
            return torch.softmax(torch.cat([b.expand_as(z[:1]), z]), dim=0)[1:]
        return torch.sigmoid(z + b)


class MultiGateResiduals(nn.Module):
    """Multi-Gate Residuals: n streams s_j; an AttnPool reads h_i = sum_j alpha_j s_j and every stream
    takes a convex step towards the update, s_j <- (1 - beta_j) s_j + beta_j f_i(h_i), with independent
    (sigmoid) or competitive (softmax with a keep logit) gates (arXiv 2605.23259)."""
    sublayer_norm = True
    equals_at_init = None  # the first n-1 updates start streams; gates near sigmoid(b)

    def __init__(self, config):
        super().__init__()
        n, L = config.mgr_streams, 2 * config.n_layer  # (GPTConfig checks that L > n - 1)
        self.n = n
        self.pool = DepthAttention(L + 1, config.n_embd, scale=config.n_embd ** -0.5)  # AttnPool; the last reads out
        self.gates = StreamGates(config, L - (n - 1))  # the first n-1 sublayers start the streams instead

    def forward(self, x, sublayers):
        streams = x.unsqueeze(0)  # s_1 = e; (n, B, T, C) once all have started
        for i, f in enumerate(sublayers):
            u = f(self.pool(i, streams))
            if i < self.n - 1:  # accumulation phase: the update starts a new stream
                streams = torch.cat([streams, u.unsqueeze(0)])
            else:
                beta = self.gates(i - (self.n - 1), streams).unsqueeze(-1).to(u.dtype)
                streams = streams + beta * (u - streams)  # (1 - beta_j) s_j + beta_j u
        return self.pool(len(sublayers), streams)


# ----------------------------------------------------------------------------- dense connections over layers

def layers(sublayers):
    """The sublayers as transformer layers: (attention, MLP) pairs."""
    return list(zip(sublayers[0::2], sublayers[1::2]))


class DepthWeightedAverage(nn.Module):
    """DenseFormer's DWA weights as one lower-triangular matrix alpha (R, R+1): row r-1 averages the
    states X_0..X_r after group r, reading only the states of r's residue mod the dilation k (every
    other entry is never read and gets no gradient). alpha_{r,r} = 1 and the rest 0 at init: identity."""

    def __init__(self, n_groups, dilation):
        super().__init__()
        alpha = torch.zeros(n_groups, n_groups + 1)
        alpha[torch.arange(n_groups), torch.arange(n_groups) + 1] = 1.0
        self.alpha = nn.Parameter(alpha)
        self.dilation = dilation

    def forward(self, r, states):
        """sum_{j <= r, j = r mod k} alpha_{r,j} X_j over the stored states X_0..X_r."""
        return sum(self.alpha[r - 1, j] * states[j] for j in range(r % self.dilation, r + 1, self.dilation))


class DenseFormer(nn.Module):
    """DenseFormer (Pagliardini et al., arXiv 2402.02622): pre-norm layers in R groups of p; after group
    r, with X_0 = e and X_r the group's output before averaging, the next group reads

        x <- DWA_r(X) = sum_{j <= r, j = r mod k} alpha_{r,j} X_j       (k: dilation, p: period)

    and the last average goes to the final norm. alpha_{r,r} = 1, the rest 0: prenorm exactly at init.
    The period as in the official experiments' model: only the groups' outputs are stored (the
    official DWA package also stores the outputs of the layers between two averages)."""
    sublayer_norm = True
    equals_at_init = 'prenorm'

    def __init__(self, config):
        super().__init__()
        self.period = config.denseformer_period
        self.dwa = DepthWeightedAverage(config.n_layer // self.period, config.denseformer_dilation)

    def forward(self, x, sublayers):
        states = [x]  # X_0 = e, then each group's output before its average (averages are not stored)
        for start in range(0, len(sublayers), 2 * self.period):
            for f in sublayers[start:start + 2 * self.period]:
                x = x + f(x)
            states.append(x)
            x = self.dwa(len(states) - 1, states)
        return x


class DynamicDenseWeights(nn.Module):
    """MUDD's weights after layer i, per token from its output X_{i+1}: w = W2 GELU(W1 RMSNorm(X_{i+1})) + b_i,
    one row per way over the states X_0..X_{i+1}. W1 normal(0, 1/sqrt(C)), W2 zero and b_i one-hot on X_{i+1}
    ("current only"): every way starts as the newest state. Hidden width: ways x (i+2), 4x at the last layer,
    rounded as the official code does, (h // 64 + 1) * 64; or mudd_hidden for every layer."""

    def __init__(self, config, ways):
        super().__init__()
        self.ways, C = ways, config.n_embd  # per layer: 4 (q, k, v, r) or 1 (r)
        self.generators, self.bias = nn.ModuleList(), nn.ParameterList()
        for i, c in enumerate(ways):
            n_states = i + 2
            hidden = config.mudd_hidden or (c * n_states * (4 if i == len(ways) - 1 else 1) // 64 + 1) * 64
            w1, w2 = nn.Linear(C, hidden, bias=False), nn.Linear(hidden, c * n_states, bias=False)
            nn.init.normal_(w1.weight, std=C ** -0.5)
            nn.init.zeros_(w2.weight)
            self.generators.append(nn.Sequential(w1, nn.GELU(), w2))
            bias = torch.zeros(c, n_states)
            bias[:, -1] = 1.0
            self.bias.append(nn.Parameter(bias))

    def forward(self, i, newest):
        """w (ways, B, T, i+2) for the output X_{i+1} (B, T, C) of layer i."""
        w = self.generators[i](rms_norm(newest)).unflatten(-1, (self.ways[i], i + 2)) + self.bias[i]
        return w.movedim(-2, 0)


class MUDDFormer(nn.Module):
    """MUDDFormer (Xiao et al., arXiv 2502.12170): X_0 = e, and layer i maps its ways to X_{i+1},

        y = x_r + attn(x_q, x_k, x_v),   X_{i+1} = y + mlp(y)          (layer 0: x_q = x_k = x_v = x_r = e)
        x_c = sum_{j <= i+1} w_{c,j} X_j,   w = W2 GELU(W1 RMSNorm(X_{i+1})) + b_i   (per token)

    for the ways c = q, k, v, r (multiway; one way, r, without), and one way after the last layer: the
    output. Prenorm at init (W2 = 0, b_i one-hot on X_{i+1}), up to the split projection's rounding."""
    sublayer_norm = True
    equals_at_init = 'prenorm'  # up to the split projection's rounding

    @staticmethod
    def attention_inputs(config, layer):
        return 3 if config.mudd_multiway and layer > 0 else 1  # layer 0 reads the embedding alone

    def __init__(self, config):
        super().__init__()
        ways = 4 if config.mudd_multiway else 1
        self.dense = DynamicDenseWeights(config, [ways] * (config.n_layer - 1) + [1])

    def forward(self, x, sublayers):
        states, ways = [x], (x,)  # X_0 = e, X_1, ...; the next layer's inputs: (x_q, x_k, x_v, x_r) or (x_r,)
        for i, (attn, mlp) in enumerate(layers(sublayers)):
            y = ways[-1] + attn(*ways[:3])
            states.append(y + mlp(y))
            w = self.dense(i, states[-1])
            ways = tuple(sum(w_c[..., j, None] * X for j, X in enumerate(states)) for w_c in w)
        return ways[0]


RESIDUALS = {
    'prenorm': PreNorm,
    'rezero': ReZero,
    'layerscale': LayerScale,
    'laurel_rw': LaurelRW,
    'laurel_lr': LaurelLR,
    'attnres': AttnRes,
    'block_attnres': BlockAttnRes,
    'delta_attnres': DeltaAttnRes,
    'wav': WAV,
    'hc': HyperConnections,
    'mhc': MHC,
    'mhc_lite': MHCLite,
    'kromhc': KromHC,
    'frac': FracConnections,
    'mgr': MultiGateResiduals,
    'denseformer': DenseFormer,
    'mudd': MUDDFormer,
}
