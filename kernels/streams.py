"""
HC and the mHC family: recomputed streams.

n streams H (B, T, n, C). Per sublayer i, connections from the streams give its input h = A_m^T H,
the mixed streams H' = A_r^T H and post, and H <- H' + post^T f(h) (HC: [A_m | A_r] and post = B,
static plus tanh of a projection of the RMS-normalised streams; mHC-lite: A_m = H_pre,
A_r = H_res^T, post = H_post, from the flattened streams' projection). The readout: HC's mean,
mHC-lite's sum of the streams. The twins save no streams: a segment of about sqrt(L) sublayers
keeps its input streams and a few numbers per token, from which the backward rebuilds the streams.
Backward of a sublayer: the update's, d H' = d H, d u = sum_s post_s d H_s, d post_s = d H_s . u;
the mixing's, d H += A d(A^T H), d A = H d(A^T H)^T per token; then the connections' own (HCStep,
MHCStep: through the projection and the RMS of the streams). The Triton kernels of HC's and
mHC-lite's step are in stream_kernels.py.
"""
import functools
import math

import torch
from torch import Tensor

from residuals import upcast

from .common import GradPool, rms_inverse
from .stream_kernels import (HC, HC_STATIC, MANIFOLD, MHC, MHC_LITE, _triton_advance_backward, _triton_stream_mix,
                             _triton_stream_mix_backward)


# ---------------------------------------------------------------------------- the PyTorch functions

def stream_mixing(A, H):
    """A^T H per token for streams H (N, n, C): A (N, n, m), or (n, m) for all tokens
    -> (N, m, C)."""
    return torch.bmm(A.mT, H) if A.dim() == 3 else torch.matmul(A.mT, H)


def rows_of(update, C):
    """The update f(h) as rows of C (..., k, C): HC's one row for every stream (k = 1), or
    Frac-Connections' m fractions (k = m), one for each row of the state."""
    return update.view(*update.shape[:-1], -1, C)


def advance(mixed, post, update):
    """The next state H' + diag(post) f(h) per row (HC: f(h) in every stream; Frac: its fractions);
    post (..., n), or (..., n, 1) as the kernels write it."""
    return torch.addcmul(mixed, post if post.dim() == mixed.dim() else post.unsqueeze(-1),
                         rows_of(update, mixed.shape[-1]))


def advance_backward(grad, update, post):
    """advance's backward per token, in batched products (the kernels' twin:
    _triton_advance_backward) -> d update, d post. HC: d u = sum_s post_s G_s, d post_s = G_s . u;
    Frac: d u_s = post_s G_s, d post_s = G_s . u_s."""
    n, C = grad.shape[-2:]
    U = rows_of(update, C)
    if post.dim() == 1:  # static post (n,), the same for every token
        if U.shape[-2] == 1:
            d_update = torch.matmul(post.to(grad.dtype), grad)
        else:
            d_update = (grad * post.to(grad.dtype).unsqueeze(-1)).view(update.shape)
        d_post = (grad * U.to(grad.dtype)).sum_to_size(post.shape + (1,)).squeeze(-1)
        return d_update, d_post
    G = grad.reshape(-1, n, C)
    if U.shape[-2] == 1:
        d_update = torch.bmm(post.reshape(-1, 1, n).to(G.dtype), G).view(update.shape)
        # (as a row: 5x faster on a CPU)
        d_post = torch.bmm(update.reshape(-1, 1, C).to(G.dtype), G.mT).view(post.shape)
    else:
        d_update = (G * post.reshape(-1, n, 1).to(G.dtype)).view(update.shape)
        d_post = torch.bmm(G.reshape(-1, 1, C), U.reshape(-1, C, 1).to(G.dtype)).view(post.shape)
    return d_update, d_post


def flat_streams(H):
    """Streams (..., n, C) as (N, n, C)."""
    return H.view(-1, *H.shape[-2:])


class StreamSegment:
    """A run of consecutive sublayers of a multi-stream method (HC, mHC-lite): the streams entering
    it, what each sublayer's step saved (a few numbers per token, from which it computes its
    connections A and post again: HC's T, the mHC family's H_res, post and 1/RMS, or the kernels'
    XW)
    and each update f(h). Every stream state inside it is rebuilt from these by the forward's own
    ops: H_{j+1} = A_j^T H_j (rows 1..n) + post_j f_j. The streams as the step takes them: H (the
    PyTorch twin), or the kernels' (H, post, u) (see streams)."""

    def __init__(self, start, streams, replay):
        detach = lambda t: None if t is None else t.detach()
        self.streams = (detach(streams) if isinstance(streams, Tensor)
                        else tuple(map(detach, streams)))
        # replay(streams, j, saved, update) -> the streams after sublayer j
        self.start, self.replay = start, replay
        # saved[j - start], updates[j - start]: what sublayer j's step saved, and its update
        self.saved, self.updates, self.rebuilt = [], [], {}

    def streams_at(self, i, autocast):
        """The streams entering sublayer i. The first call rebuilds the segment up to i once; each
        later call (the backward goes down the sublayers) takes its own."""
        if i not in self.rebuilt:
            H = self.streams.contiguous() if isinstance(self.streams, Tensor) else self.streams
            with torch.no_grad(), torch.autocast(**autocast):  # the forward's precision
                for j in range(self.start, i + 1):
                    self.rebuilt[j] = H
                    if j < i:
                        H = self.replay(H, j, self.saved[j - self.start],
                                        self.updates[j - self.start])
        return self.rebuilt.pop(i)


class TorchStreamStep:
    """One sublayer's step in PyTorch, derivatives by hand, for one forward: the stacked connection
    parameters (L, ...) in the forms the step computes with, made once without autograd, and the
    backward's gradient rows, one per sublayer, put in a GradPool, which sublayer 0 (the last to run
    backward) turns into the parameters' gradients (each sublayer's own rows through autograd would
    cost zero-filled full-size gradients and about 70 operators a sublayer). A subclass holds one
    method's maths: __call__(H, i, saved) -> h, H', post and what the replay and the backward need
    (a few numbers per token); backward(...) -> d H, its parameter rows put under i; take() -> the
    parameters' gradients."""

    def __init__(self, params):
        self.params, self.pool = params, GradPool()

    @staticmethod
    def streams(module, x):
        """The state the method starts from: the embedding x copied into n streams (residuals.copies),
        a stride-0 view."""
        return x.unsqueeze(-2).expand(*x.shape[:-1], module.n, x.shape[-1])

    def post_again(self, saved, i):
        """None: Advance saves post."""
        return None

    def rows(self):
        """The rows of every sublayer, stacked, and taken (GradPool.take_stacked)."""
        return self.pool.take_stacked(self.params[0].shape[0])


class HCStep(TorchStreamStep):
    """HC in the forms [A | post] = [width | depth] + [s_a .. s_a, s_b] T, T = tanh(P) (n, n + 2)
    per token, P = rms_norm(H) W per stream. Saves T (as many numbers as A and post); the backward
    takes 1/RMS again from the rebuilt streams. The same step is Frac-Connections' (FracStep), whose
    A = [Gamma | A] has m columns that read h, where HC's has one (A_m)."""

    def __init__(self, module):
        c = module.connections
        super().__init__([c.width, c.depth]
                         + ([c.width_scale, c.depth_scale, c.proj] if c.dynamic else []))
        self.h = c.width.shape[-1] - c.width.shape[-2]  # the columns that read h: 1 (HC) or m (Frac)
        with torch.no_grad():
            self.base, self.W_t = torch.cat([c.width, c.depth.unsqueeze(-1)], -1), None
            if c.dynamic:
                L, n, k = c.width.shape
                self.scale = torch.cat([c.width_scale.unsqueeze(1).expand(L, k),
                                        c.depth_scale.unsqueeze(1)], 1)
                # W^T (L, K, C): on a CPU, X W with W's few columns in rows is a 2-3x slower GEMM
                # (likewise d W)
                self.W_t = c.proj.mT.contiguous()

    @staticmethod
    def connect(module, i, H):
        """A = [A_m | A_r] and post = B of sublayer i as the class computes them (compiled_streams)."""
        return module.connections(i, H)

    @functools.cached_property
    def W_scaled_t(self):
        """(W s)^T, the backward's, made at its first use: a forward without a backward (decoding)
        makes none."""
        with torch.no_grad():
            return self.W_t * self.scale.unsqueeze(-1)

    def __call__(self, H, i, saved=None):
        """h, H', post of sublayer i and (T,) (static HC: ()) for the streams H (N, n, C); the
        replay gives the forward's saved and takes H' and post only."""
        (N, n, C), Ap, replay = H.shape, self.base[i], saved is not None
        if self.W_t is not None:
            if not replay:  # T = tanh(r (H W)), r = 1/RMS per stream
                P = (torch.mm(H.view(-1, C), self.W_t[i].t()).view(N, n, -1)
                     * rms_inverse(H, keepdim=True))
                saved = (torch.tanh(P),)
            Ap = torch.addcmul(Ap, saved[0], self.scale[i])
        mixed = stream_mixing(Ap[..., self.h:-1], H)  # H' = A_r^T H
        if replay:
            return None, mixed, Ap[..., -1], saved
        # h = A_m^T H, a product of its own (in one product with H', f would keep all n + 1 rows
        # alive); post: Advance computes it again (static HC's: a copy)
        h = stream_mixing(Ap[..., :self.h], H).view(N, self.h * C)
        return h, mixed, Ap[..., -1].clone() if self.W_t is None else Ap[..., -1], saved or ()

    def post_again(self, saved, i):
        """A function giving sublayer i's post again from its saved T (Advance's backward: saving
        post would keep n numbers a token more than the segment's T), or None (static HC)."""
        if not saved:
            return None
        return functools.partial(torch.addcmul, self.base[i][:, -1], saved[0][..., -1],
                                 self.scale[i][-1])

    def backward(self, H, i, saved, grad_h, grad_mixed, grad_post):
        (N, n, C), K = H.shape, self.base.shape[-1]
        G = torch.cat([grad_h.view(N, self.h, C), grad_mixed], 1)  # d (A^T H): rows of h, then H'
        if not saved:  # static: one A and post for all tokens
            grad_H = torch.matmul(self.base[i][:, :-1], G).to(H.dtype)
            d_Ap = torch.cat([torch.bmm(H, G.mT).sum(0), grad_post.unsqueeze(-1)], -1)
            self.pool.put(i, (d_Ap,))
            return grad_H
        T = saved[0]
        Ap = torch.addcmul(self.base[i], T, self.scale[i])
        grad_H = torch.bmm(Ap[..., :-1], G).to(H.dtype)
        # d [A | post]
        d_Ap = torch.cat([torch.bmm(H, G.mT), grad_post.unsqueeze(-1)], -1).to(T.dtype)
        # d P = scale D: the scale is W_scaled's and d W's
        D = torch.ops.aten.tanh_backward(d_Ap, T)
        r = rms_inverse(H, keepdim=True)
        Hn = H * r
        # P = r (H W): d rms_norm(H) = M = D W_scaled^T, and d H = r (M - (Hn . M) Hn / C); the dots
        # Hn_s . M_s as the diagonal of each token's (n, n) products (on a CPU 2x faster than
        # N n dots)
        M = torch.mm(D.view(-1, K), self.W_scaled_t[i]).view(N, n, C).to(Hn.dtype)
        dot = torch.bmm(M, Hn.mT).diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
        grad_H.addcmul_(M.addcmul_(dot, Hn, value=-1 / C), r)
        # d [width | depth], d [s_a .. s_b] (the sums of d_Ap T per column: a diagonal of one small
        # GEMM), d W^T / scale
        self.pool.put(i, (d_Ap.sum(0), torch.mm(d_Ap.view(-1, K).t(), T.view(-1, K)).diagonal(),
                          torch.mm(D.view(-1, K).t().to(Hn.dtype), Hn.view(-1, C))))
        return grad_H

    def take(self):
        """The gradients of width, depth (and s_a, s_b, W)."""
        rows = self.rows()
        grads = [rows[0][..., :-1].contiguous(), rows[0][..., -1].contiguous()]
        if self.W_t is not None:
            grads += [rows[1][:, :-1].sum(1), rows[1][:, -1].contiguous(),
                      (rows[2] * self.scale.unsqueeze(-1)).mT.contiguous()]
        return [g.to(p.dtype) for g, p in zip(grads, self.params)]


class FracStep(HCStep):
    """Frac-Connections' step: HC's, over the m fractions of x (B, T, m, C/m) instead of n copies,
    with m columns of A reading h and each fraction of f(h) added to its own row (advance)."""

    @staticmethod
    def streams(module, x):
        return x.unflatten(-1, (module.m, -1))


class ManifoldStep(TorchStreamStep):
    """The mHC family's step (MHCStep, MHCLiteStep, KromHCStep: each its own H_res) with the alphas
    per column a = [a_pre .. a_post .. a_res ..] (K = 2n + H_res's logits): logits a x' W + b, x' =
    rms_norm of the flattened streams; H_res from its logits in float32 (as the class), forward and
    backward by hand. Saves H_res, post and 1/RMS r (n^2 + n + 1 numbers a token); the backward
    takes the logits again."""

    def __init__(self, n, alpha, bias, proj):
        super().__init__([alpha, bias, proj])
        L, K = bias.shape
        with torch.no_grad():
            self.alpha = torch.cat([alpha[:, :1].expand(L, n), alpha[:, 1:2].expand(L, n),
                                    alpha[:, 2:].expand(L, K - 2 * n)], 1)
            self.bias, self.W = bias.detach(), proj.detach()
        self.n, self.split = n, [n, n, K - 2 * n]

    @staticmethod
    def connect(module, i, H):
        """A = [H_pre | H_res^T] and post = H_post of sublayer i as the class computes them
        (compiled_streams)."""
        h_pre, post, h_res = module.coefficients(i, H)
        return torch.cat([h_pre.unsqueeze(-1), h_res.transpose(-1, -2).to(h_pre.dtype)], -1), post

    @functools.cached_property
    def W_scaled_t(self):
        """(W a)^T (L, K, n C), the backward's, made at its first use: a forward without a backward
        (decoding) makes none. On a CPU, a GEMM with W^T's rows is 1.7x faster than with W's
        columns."""
        with torch.no_grad():
            return (self.W * self.alpha.unsqueeze(1)).mT.contiguous()

    def logits(self, X, r, i):
        """x' W and a x' W + b of the flattened streams X (N, n C)."""
        P = torch.mm(X, self.W[i]) * r
        return P, torch.addcmul(self.bias[i], P, self.alpha[i])

    def __call__(self, H, i, saved=None):
        """h, H', post of sublayer i and (H_res, post, r) for the streams H (N, n, C); the replay
        gives these and only mixes."""
        if saved is not None:
            return None, torch.bmm(saved[0], H), saved[1], saved
        (N, n, C), X = H.shape, H.view(H.shape[0], -1)
        r = rms_inverse(X, keepdim=True)
        logits = self.logits(X, r, i)[1]
        gates = torch.sigmoid(logits[:, :2 * n])  # H_pre, H_post / 2
        with torch.autocast(H.device.type, enabled=False):  # H_res in float32, as the class
            H_res = self.h_res(upcast(logits[:, 2 * n:]))
        post = 2 * gates[:, n:]
        return (torch.bmm(gates[:, None, :n], H).view(N, C), torch.bmm(H_res, H), post,
                (H_res, post, r))

    def backward(self, H, i, saved, grad_h, grad_mixed, grad_post):
        (H_res, _, r), (N, n, C) = saved, H.shape
        X = H.view(N, -1)
        P, logits = self.logits(X, r, i)
        gates = torch.sigmoid(logits[:, :2 * n])
        grad_H = torch.bmm(H_res.mT, grad_mixed).to(H.dtype)
        grad_H.addcmul_(gates[:, :n, None], grad_h.unsqueeze(1))  # h = H_pre H
        # (a row times H^T: on a CPU 9x faster than H g)
        d_pre = torch.bmm(grad_h.unsqueeze(1), H.mT).view(N, n)
        d_H_res = torch.bmm(grad_mixed, H.mT).view(N, -1)
        with torch.autocast(H.device.type, enabled=False):
            d_res = self.h_res_backward(upcast(logits[:, 2 * n:]), H_res, upcast(d_H_res))
        d_gates = torch.ops.aten.sigmoid_backward(torch.cat([d_pre, 2 * grad_post], -1), gates)
        d_logits = torch.cat([d_gates, d_res], -1)
        # P = r (X W): d X = r (d_P W^T) - (r^2 / (n C)) (d_P . P) X, d W = X^T (r d_P),
        # d_P = a d_logits (the a in W_scaled_t and in take()); d_P . P from the per-column products
        # d_logits P, which d a sums too
        dP_P = d_logits * P
        G = d_logits * r
        grad_H.view(N, -1).addmm_(G.to(grad_H.dtype), self.W_scaled_t[i].to(grad_H.dtype))
        grad_H.view(N, -1).addcmul_(torch.mv(dP_P, self.alpha[i]).unsqueeze(-1) * r.square(),
                                    X, value=-1 / (n * C))
        # d b, d a per column, d W / a
        self.pool.put(i, (d_logits.sum(0), dP_P.sum(0), torch.mm(X.t(), G.to(X.dtype))))
        return grad_H

    def take(self):
        """The gradients of alpha, bias and W."""
        d_bias, d_alpha, d_W = self.rows()
        d_alpha = torch.stack([part.sum(1) for part in d_alpha.split(self.split, 1)], 1)
        return [g.to(p.dtype)
                for g, p in zip([d_alpha, d_bias, d_W * self.alpha.unsqueeze(1)], self.params)]


class MHCStep(ManifoldStep):
    """mHC's H_res: 20 Sinkhorn iterations in the log domain, each normalisation one log_softmax. Its
    backward computes the 40 normalised iterates again from the logits (40 x n^2 numbers a token,
    for the length of one sublayer's backward) and steps back through them, each normalisation's
    backward one operator (_log_softmax_backward_data): 3 operators a normalisation in all, the
    floor of the iterations written as PyTorch operators. The iterates keep the tokens last."""

    def __init__(self, module):
        c = module.coefficients
        super().__init__(c.n, c.alpha, c.bias, c.proj)
        self.iterations = c.ITERATIONS

    def iterates(self, logits):
        """The 40 normalised iterates log M of Sinkhorn-Knopp, columns first, with the tokens last
        (n, n, N): each normalisation reduces over a dimension of n with the N tokens contiguous,
        which a CPU vectorises (5-15x faster than over the last dimension of (N, n, n))."""
        n = self.n
        log_m, out = logits.t().reshape(n, n, -1), []
        for _ in range(self.iterations):
            out.append(torch.log_softmax(log_m, 0))  # T_c: every column sums to 1
            log_m = torch.log_softmax(out[-1], 1)  # T_r: every row sums to 1
            out.append(log_m)
        return out

    def h_res(self, logits):
        """H_res (N, n, n) from its logits (N, K - 2n), float32 logits (tokens first again: a
        batched product with a batch stride of 1 runs matrix by matrix, 2x the step's time)."""
        return self.iterates(logits)[-1].exp().permute(2, 0, 1).contiguous()

    def h_res_backward(self, logits, H_res, grad):
        """The gradient of H_res's logits (N, K - 2n) from H_res's, grad (N, n n), float32."""
        n, iterates = self.n, self.iterates(logits)
        g = grad.t().reshape(n, n, -1) * H_res.permute(1, 2, 0)  # exp's
        for k in reversed(range(len(iterates))):  # T_r at odd k, T_c at even k
            g = torch.ops.aten._log_softmax_backward_data(g, iterates[k], k % 2, g.dtype)
        return g.view(n * n, -1).t()


class MHCLiteStep(ManifoldStep):
    """mHC-lite's H_res = softmax(logits_res) @ permutations, and its backward, by hand."""

    def __init__(self, module):
        c = module.coefficients
        super().__init__(c.n, c.alpha, c.bias, c.proj)
        self.perms = c.permutations.flatten(1)

    def h_res(self, logits):
        return torch.mm(torch.softmax(logits, -1), self.perms.to(logits.dtype)).view(-1, self.n, self.n)

    def h_res_backward(self, logits, H_res, grad):
        w = torch.softmax(logits, -1)
        return torch.ops.aten._softmax_backward_data(torch.mm(grad, self.perms.t().to(grad.dtype)), w,
                                                     -1, w.dtype)


def kron_as_permutations(c):
    """KromHC's coefficients c as mHC-lite's: H_res = U_1 (x) .. (x) U_K, U_k = w_k0 I + w_k1 S, is
    a convex mix of n permutations, sum_e c_e P_e (e = 0..n-1, P_e maps stream a to a XOR e: the
    product of the factors' I or S by the bits of e, the first factor's the highest), and c_e =
    prod_k w_k,bit_k(e) = softmax(logits B)_e, B the bits (2K, n) (the product of the factors'
    softmaxes is the softmax of the summed logits). So its res logits are taken through B once per
    forward, its projection's and bias's columns (autograd takes their gradients back through B),
    and every step is mHC-lite's with n permutations. Returns the bias (L, 3n), the projection
    (L, n C, 3n) (both times [I 0; 0 B], one product each), the permutations (n, n, n) and their
    stream indices (n, n): row a of P_e reads stream a XOR e."""
    n, K = c.n, c.factors
    like = dict(dtype=c.bias.dtype, device=c.bias.device)
    bits = [[float((e >> (K - 1 - k)) & 1 == x) for e in range(n)] for k in range(K) for x in (0, 1)]
    basis = torch.tensor([[float(row == col) for col in range(2 * n)] + [0.0] * n for row in range(2 * n)]
                         + [[0.0] * 2 * n + b for b in bits], **like)  # [I 0; 0 B] (2n + 2K, 3n)
    index = [[a ^ e for a in range(n)] for e in range(n)]
    perms = torch.tensor([[[float(b == row[a]) for b in range(n)] for a in range(n)] for row in index], **like)
    return (c.bias @ basis, c.proj @ basis, perms,
            torch.tensor(index, dtype=torch.int32, device=c.bias.device))


class KromHCStep(MHCLiteStep):
    """KromHC's step: mHC-lite's, with n permutations (kron_as_permutations)."""

    def __init__(self, module):
        c = module.coefficients
        bias, proj, perms, _ = kron_as_permutations(c)
        ManifoldStep.__init__(self, c.n, c.alpha, bias, proj)
        self.perms = perms.flatten(1)


# ------------------------------------------------------------------------------------ the Functions

class TorchStreamMix(torch.autograd.Function):
    """(h, H', post) of sublayer i with a TorchStreamStep, saving no streams: the segment keeps what
    the step saves, from which the backward's replay rebuilds the streams. The step sees the tokens
    flattened (N, ...): its products are plain (batched) matrix products."""

    @staticmethod
    def forward(ctx, H, segment, i, maths, *params):
        # (e's n copies: a stride-0 view, kept as such; the products take a dense copy)
        h, mixed, post, saved = maths(flat_streams(H.contiguous()), i)
        # post.detach(), not the output itself: its grad_fn would hold this ctx, which holds the
        # segment: a cycle through autograd's graph that the garbage collector cannot free (27 MB a
        # step leaked)
        saved = tuple(t.detach() if t is post else t for t in saved)
        segment.saved.append(saved)
        # saved here too, so that autograd checks them for in-place changes and memory accounting
        # sees them
        ctx.save_for_backward(H if i == segment.start else None, *saved)
        device = H.device.type
        ctx.autocast = dict(device_type=device, dtype=torch.get_autocast_dtype(device),
                            enabled=torch.is_autocast_enabled(device))
        ctx.segment, ctx.i, ctx.maths = segment, i, maths
        lead = H.shape[:-2]
        return (h.view(*lead, -1), mixed.view(H.shape),
                post if post.dim() == 1 else post.view(*lead, -1))

    @staticmethod
    def backward(ctx, grad_h, grad_mixed, grad_post):
        _, *saved = ctx.saved_tensors
        H = ctx.segment.streams_at(ctx.i, ctx.autocast)
        n, C = H.shape[-2:]
        with torch.autocast(**ctx.autocast):  # the forward's precision for the products
            grad_H = ctx.maths.backward(
                flat_streams(H), ctx.i, saved, grad_h.reshape(-1, C),
                grad_mixed.reshape(-1, n, C),
                grad_post if grad_post.dim() == 1 else grad_post.reshape(-1, n))
        grads = ctx.maths.take() if ctx.i == 0 else [None] * len(ctx.maths.params)
        return grad_H.view(H.shape), None, None, None, *grads


class Advance(torch.autograd.Function):
    """H' + post^T f(h) (advance), its backward by `backward` (advance_backward, or the kernel's).
    With post_again (a function), post is computed again in the backward instead of saved."""

    @staticmethod
    def forward(ctx, mixed, post, update, backward, post_again=None):
        ctx.save_for_backward(None if post_again else post, update)
        ctx.backward_of, ctx.post_again, ctx.post_shape = backward, post_again, post.shape
        return advance(mixed, post, update)

    @staticmethod
    def backward(ctx, grad):
        post, update = ctx.saved_tensors
        if ctx.post_again:
            post = ctx.post_again().view(ctx.post_shape)
        d_update, d_post = ctx.backward_of(grad, update, post)
        return grad, d_post, d_update, None, None


class StreamParams:
    """The stacked connection parameters (L, ...) of one forward with the Triton kernels, mHC-lite's
    projection rearranged for the update's share, and the parameters' gradients: sublayer i's
    backward sums its programs' partial sums into its row, put in a GradPool,
    and sublayer 0, the last to run backward, stacks the L rows and hands out the parameters'
    gradients as slices of them; the others return None. (Per sublayer one sum, where each
    sublayer's own gradients cost five slices and autograd a stack of L of them per parameter.)"""

    def __init__(self, kind, params, W, n):
        self.kind, self.params, self.W, self.n, self.pool = kind, params, W, n, GradPool()
        self.W_t = self.W_s = self.W_s_t = None

    def put(self, i, parts):
        self.pool.put(i, (parts.sum(0),))

    def by_stream(self, i):
        """[W_1 | .. | W_n] (C, n K) of mHC-lite's sublayer i, W_s its rows of stream s (the stack
        rearranged once per forward, not once per sublayer): u [W_1 | .. | W_n] projects an update
        u."""
        if self.W_s is None:
            (L, nC, K), n = self.W.shape, self.n
            stack = (self.W.detach().view(L, n, nC // n, K).transpose(1, 2)
                     .reshape(L, nC // n, n * K))
            self.W_s = stack, stack.unbind()
        return self.W_s[1][i]

    def by_stream_transposed(self, i):
        """[W_1 | .. | W_n]^T (n K, C) of mHC-lite's sublayer i, which d u's share through the
        projection multiplies (the rearranged stack transposed once per backward, not once per
        sublayer)."""
        if self.W_s_t is None:
            self.by_stream(i)
            self.W_s_t = self.W_s[0].mT.unbind()
        return self.W_s_t[i]

    def transposed(self, i):
        """W_i^T of mHC-lite's sublayer i (the stack transposed once per backward, not once per
        sublayer)."""
        if self.W_t is None:
            self.W_t = self.W.mT.unbind()
        return self.W_t[i]

    def take(self):
        """The gradients of the parameters (and of HC's W): [width | depth | s_a, s_b | W] or
        [alpha | bias]."""
        L = self.params[0].shape[0]
        rows, = self.pool.take_stacked(L)
        self.W_t = self.W_s = self.W_s_t = None
        params = [p for p in self.params + ([self.W] if self.kind == HC else [])
                  if p.is_floating_point()]
        # (mHC-lite's permutations: none)
        grads = rows.split([p.numel() // L for p in params], dim=1)
        # (autograd keeps a contiguous gradient as it is; a slice it would copy in two operators)
        return [(g if g.shape == p.shape else g.view(p.shape)).to(p.dtype).contiguous()
                for g, p in zip(grads, params)]


class TritonStreamMix(torch.autograd.Function):
    """TorchStreamMix's twin with the Triton kernels: (h, H', post) of sublayer i from the streams
    (H, post_in, u_in) (H itself, or the last sublayer's H' + post_in^T u_in: see TritonStreams),
    the projection W (HC: the stacked (L, C, n + 2), or None (static); mHC-lite: sublayer i's) and
    the stacked connection parameters, saving XW (and mHC-lite's u [W_1 | .. | W_n]: a few numbers
    per token) and no streams; the backward rebuilds the streams from the segment, and gives the
    last sublayer's H', post and u their gradients. HC's projection is the kernels' (forward and
    backward); mHC-lite's is GEMMs beside them. The parameters' gradients gather in a
    StreamParams."""

    @staticmethod
    def forward(ctx, H, post_in, u_in, W, segment, i, grads, *params):
        kind = grads.kind
        if kind in MANIFOLD:  # mHC-lite's projection by cuBLAS: XW (N, K) of the rows (N, n C), of
            # H' + post^T u as H' W and u W_s; H' W at the streams' precision (under autocast, a
            # half-precision copy of H' moved more)
            with torch.autocast(H.device.type, enabled=False):
                XW = torch.mm(H.reshape(-1, W.shape[0]), W.to(H.dtype))
            UW = None if u_in is None else torch.mm(u_in.reshape(-1, u_in.shape[-1]),
                                                    grads.by_stream(i))
            h, mixed, post, combined = _triton_stream_mix(H, post_in, u_in, XW, UW, None,
                                                          list(params), i, kind, False)
            XW = XW if UW is None else combined
        else:  # HC's by the kernel (static HC: none)
            h, mixed, post, XW = _triton_stream_mix(H, post_in, u_in, None, None, W, list(params),
                                                    i, kind, False)
            XW, UW = None if W is None else XW, None
        segment.saved.append(XW)  # the replay's kernel computes post again from XW
        start = (H, post_in, u_in) if i == segment.start else (None,) * 3
        # (mHC-lite's UW: d post_in's share through XW)
        ctx.save_for_backward(*start, W, XW, UW, *params)
        device = H.device.type
        ctx.autocast = dict(device_type=device, dtype=torch.get_autocast_dtype(device),
                            enabled=torch.is_autocast_enabled(device))
        ctx.segment, ctx.i, ctx.grads = segment, i, grads
        return h, mixed, post

    @staticmethod
    def backward(ctx, grad_h, grad_mixed, grad_post):
        _, _, _, W, XW, UW, *params = ctx.saved_tensors
        (H, post_in, u_in), kind = ctx.segment.streams_at(ctx.i, ctx.autocast), ctx.grads.kind
        # mHC-lite's streams for W's gradient in autocast's dtype (float32 streams): its product at
        # the precision of autocast's
        low = (ctx.autocast['dtype'] if ctx.autocast['enabled'] and H.dtype == torch.float32
               else None)
        d_H, d_XW, parts, d_last = _triton_stream_mix_backward(H, post_in, u_in, XW, UW,
                                                               W if kind == HC else None, params,
                                                               ctx.i, kind, grad_h, grad_mixed,
                                                               grad_post, low)
        ctx.grads.put(ctx.i, parts)
        d_u, d_post, grad_W = *(d_last[:2] if d_last else (None, None)), None
        # XW = rows W: rows get d_XW W^T, W gets rows^T d_XW (rows: the streams as the kernel formed
        # them)
        if kind in MANIFOLD:
            d_XW = d_XW[0]
            if d_last:
                rows = d_last[2]
            else:
                rows = H.reshape(-1, W.shape[0])  # (e's n copies: a dense copy)
            d_H.view(rows.shape).addmm_(d_XW.to(d_H.dtype),
                                        ctx.grads.transposed(ctx.i).to(d_H.dtype))
            grad_W = (rows.t() @ d_XW.to(rows.dtype)).to(W.dtype)
            if d_last:  # d u's share through XW: sum_s post_s d_XW W_s^T, one GEMM of post^T d_XW
                # (N, n K)
                d_uw = d_last[3]
                d_u.view(-1, d_u.shape[-1]).addmm_(d_uw, ctx.grads.by_stream_transposed(ctx.i).to(
                    d_uw.dtype))
        if ctx.i > 0:
            return d_H, d_post, d_u, grad_W, None, None, None, *[None] * len(params)
        grads = ctx.grads.take()
        if kind == HC:
            grad_W = grads.pop()
        rest = grads + [None] * (len(params) - len(grads))
        return d_H, d_post, d_u, grad_W, None, None, None, *rest


# ------------------------------------------------------------------------------------ the schedules

def rebuilt(step, kernel, module, x, sublayers, backend):
    """HC and the mHC family with the streams rebuilt in the backward instead of saved: the
    sublayers are cut into segments of about sqrt(L); a segment keeps its input streams, what each
    step saved for the replay (a few numbers per token) and the updates (which the update's
    backward needs anyway), and the backward rebuilds each segment's streams once. `step`: the
    class's step by hand (HCStep, MHCStep, MHCLiteStep); `kernel`: its Triton kernel's parameters
    (hc_kernel, mhc_lite_kernel), or None where it has no kernel (the step by hand runs on every
    backend); kernels.FAST names both for each class. Compiled, compiled_streams runs instead (the
    compiler plans its own memory)."""
    H = step.streams(module, x)
    if torch.compiler.is_compiling():
        return compiled_streams(module, step, H, sublayers)
    length = max(1, round(math.sqrt(len(sublayers))))
    # the family's one choice of backend
    plan = (TritonStreams(kernel(module), H) if backend == 'triton' and kernel is not None
            else TorchStreams(step(module), H))
    state = plan.start
    for i, f in enumerate(sublayers):
        if i % length == 0:
            segment = StreamSegment(i, state, plan.replay)
        h, mixed, post = plan.mix(state, i, segment)
        update = f(h)
        segment.updates.append(update.detach())
        state = plan.join(mixed, post, update, i, segment)
    return module.readout(plan.last(state))


class TorchStreams:
    """The PyTorch twin's schedule of one forward: the streams as one tensor (start), each
    sublayer's step (mix, by TorchStreamMix), the update (join, by Advance), the replay's step, and
    the streams the readout takes (last)."""

    def __init__(self, maths, H):
        self.maths, self.start = maths, H

    def mix(self, H, i, segment):
        return TorchStreamMix.apply(H, segment, i, self.maths, *self.maths.params)

    def join(self, mixed, post, u, i, segment):
        post_again = self.maths.post_again(segment.saved[-1], i)
        return Advance.apply(mixed, post, u, advance_backward, post_again)

    def replay(self, H, i, saved, u):
        """The streams after sublayer i, from the streams before it, what its step saved and its
        update."""
        _, mixed, post, _ = self.maths(flat_streams(H), i, saved)
        return advance(mixed, post, u.view(-1, u.shape[-1])).view(H.shape)

    def last(self, H):
        return H


def hc_kernel(module):
    """HC's kind of kernel step, the stacked parameters (L, ...) the kernels read sublayer i's rows
    of ([width, depth, s_a, s_b]; static: [width, depth]) and its projection W."""
    c = module.connections
    if c.dynamic:
        return HC, [c.width, c.depth, c.width_scale, c.depth_scale], c.proj
    return HC_STATIC, [c.width, c.depth], None


def mhc_lite_kernel(module):
    """mHC-lite's, as hc_kernel: [alpha, bias, the permutations as stream indices] and the
    projections, one per sublayer."""
    c = module.coefficients
    return MHC_LITE, [c.alpha, c.bias, c.permutations.argmax(-1).to(torch.int32)], c.proj


def mhc_kernel(module):
    """mHC's, as mhc_lite_kernel: [alpha, bias] (H_res by the kernel's Sinkhorn iterations)."""
    c = module.coefficients
    return MHC, [c.alpha, c.bias], c.proj


def kromhc_kernel(module):
    """KromHC's: mHC-lite's kernel with its n XOR permutations (kron_as_permutations)."""
    c = module.coefficients
    bias, proj, _, index = kron_as_permutations(c)
    return MHC_LITE, [c.alpha, bias, index], proj


class TritonStreams:
    """As TorchStreams with the kernels, which carry the streams as (H, post, u): the last
    sublayer's H' and post and its update f(h), from which each step's kernels (forward, replay and
    backward) form the streams H' + post^T u as they read them, so that the n streams are never
    written between two sublayers; only the readout's streams are formed outside, by Advance. The
    first sublayer's: (e's n copies, a stride-0 stream dimension, None, None). `kernel`: the kind,
    the parameters and the projection (hc_kernel, mhc_lite_kernel, mhc_kernel, kromhc_kernel)."""

    def __init__(self, kernel, H):
        self.kind, self.params, W = kernel
        self.grads = StreamParams(self.kind, self.params, W, H.shape[-2])
        # mHC-lite's projections one per sublayer: one backward node gathers their gradients
        self.projections = [self.grads.W] * len(self.params[0])
        if self.kind in MANIFOLD:
            self.projections = W.unbind()
        self.start = H, None, None

    def mix(self, state, i, segment):
        return TritonStreamMix.apply(*state, self.projections[i], segment, i, self.grads,
                                     *self.params)

    def join(self, mixed, post, u, i, segment):
        return mixed, post, u

    def replay(self, state, i, XW, u):
        _, mixed, post, _ = _triton_stream_mix(*state, XW, None, None, self.params, i, self.kind,
                                               True)
        return mixed, post, u

    def last(self, state):
        if state[1] is None:
            return state[0]
        return Advance.apply(*state, _triton_advance_backward)


def compiled_streams(module, step, H, sublayers):
    """The class's maths for the compiler from the streams H, with the mixing written as n broadcast
    multiply-adds (inductor fuses them with the update into one loop; A^T H would stay a batched
    GEMM of tiny per-token matrices). The compiler plans the memory."""
    for i, f in enumerate(sublayers):
        A, post = step.connect(module, i, H)
        # (..., h + n, C): rows 0..h-1 are h (HC: 1 row, Frac: m), the others H'
        mixed = (A.unsqueeze(-1) * H.unsqueeze(-2)).sum(-3)
        h = A.shape[-1] - A.shape[-2]
        H = advance(mixed[..., h:, :], post, f(mixed[..., :h, :].flatten(-2)))
    return module.readout(H)
