"""
DenseFormer and MUDD: the states in one buffer.

After each layer (DenseFormer: each group of layers), a mix of the states X_0..X_r so far: scalar
weights for DenseFormer's average, per-token weights of each way for MUDD:

    mix_c = sum_j w_cj X_j;   backward: dw_cj = g_c . X_j,   dX_j += sum_c w_cj g_c

(MUDD: per token, ways c; DenseFormer: one way, the w_j shared by every token). The twins copy
each state once into one buffer, and each mix is one product over it, in the states' precision
(float32 under autocast, as the classes' sums: the residual stream stays float32). DenseFormer:
PyTorch only (both backends), each average one GEMV. MUDD with Triton: each layer's ways one
kernel forward and one backward (below), which reads the ways' gradients as they come where the
batched product needs them stacked, and adds into the gradients' rows in the same pass. MUDD's
weights: the generator's RMSNorm moved past its first projection (RMSProjection).
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .common import accumulator, next_pow2, rms_inverse, token_tile, tl, triton


# ---------------------------------------------------------------------------- the PyTorch functions

class DenseStates:
    """The states X_0..X_R of one forward of a dense method, each copied once into one buffer, so
    that a mix of them is one matrix product instead of a pass per state: state by state (R+1, N, C)
    for DenseFormer's scalar weights (a GEMV), token by token (N, R+1, C) for MUDD's per-token
    weights (a product per token; `fused`: a Triton kernel, triton_mudd_mix). The buffer is in the
    precision of the class's products (the states' and the weights' promoted). Backward: every mix
    adds its states' gradients into a second buffer, again with one product; the first mix to run
    backward (the last one) makes that buffer from its product where it reads every state, and each
    state's first reader (the last to run backward) hands its row over as the state's gradient, a
    view, neither copied nor cleared: the first mix drops the buffer, so that the next backward
    through a retained graph makes a new one."""

    def __init__(self, n_states, x, dtype, per_token, fused=False):
        N, C = x.numel() // x.shape[-1], x.shape[-1]
        self.per_token, self.fused = per_token, fused
        self.values = x.new_empty((N, n_states, C) if per_token else (n_states, N, C), dtype=dtype)
        self.grads, self.count = None, 0

    def rows(self, buffer, index):
        """The states `index` (an int or a slice) of a buffer laid out as the values are."""
        return buffer[:, index] if self.per_token else buffer[index]

    def add(self, X):
        with torch.no_grad():
            self.rows(self.values, self.count).copy_(X.reshape(-1, X.shape[-1]))
        self.count += 1

    def takes_product(self, read):
        """Whether the backward product of a mix reading the rows `read` becomes the gradients'
        buffer: the first mix to run backward, where it reads every state (normally the last mix).
        Otherwise its product is added into the buffer's rows, zeros first where no mix has run
        backward yet (a backward from an inner sublayer)."""
        if self.grads is not None:
            return False
        if self.rows(self.values, read).shape == self.values.shape:
            return True
        self.grads = torch.zeros_like(self.values)
        return False


# ------------------------------------------------------------------- the Triton kernels: MUDD's mix
#
# One program per tile of tokens (token_tile) reads each state once for all the ways: forward, the
# ways' mixes sum_j w_cj X_j, each way its own tensor (one tensor of all four, unbound, would stack
# the ways' gradients in its backward); backward, grad_w_cj = g_c . X_j and dS_j (+)= sum_c w_cj g_c
# from the ways' gradients as they come, each read once. The states and their gradients are rows of
# the buffers, read through their tokens' stride (no copy of the rows a mix reads).

if triton is not None:
    @triton.jit
    def _pick(P0, P1, P2, P3, c: tl.constexpr):
        if c == 0:
            return P0
        elif c == 1:
            return P1
        elif c == 2:
            return P2
        else:
            return P3

    @triton.jit
    def _mudd_tile(J, N, C, stride_t, WAYS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        """This program's tile of BT tokens t: the ways and columns, the masks of (tokens, columns)
        and of the weights (tokens; it broadcasts over the ways), and the offsets of the weights
        (ways, tokens) and of the states' rows (tokens, columns)."""
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        ways, cols = tl.arange(0, WAYS), tl.arange(0, BC)
        tmask = t < N
        tc, w_mask = tmask[:, None] & (cols < C)[None, :], tmask[None, :]
        w_at = t[None, :] * WAYS * J + ways[:, None] * J
        s_at = t[:, None] * stride_t + cols[None, :]
        return t, ways, cols, tc, w_mask, w_at, s_at

    @triton.jit
    def _mudd_mix_fwd(W,      # (N, WAYS, J)
                      S,      # (N, J, C), tokens stride_t apart
                      O0,     # (N, C)
                      O1,     # (N, C), or empty past the ways
                      O2,     # (N, C), or empty
                      O3,     # (N, C), or empty
                      J, N, C, stride_t,
                      WAYS: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # a tile of BT tokens: (ways, tokens, channels) mixes, (ways, tokens) weights
        t, ways, cols, tc, w_mask, w_at, s_at = _mudd_tile(J, N, C, stride_t, WAYS, BT, BC)
        acc = tl.zeros((WAYS, BT, BC), ACC)
        for j in range(J):
            s = tl.load(S + s_at + j * C, mask=tc, other=0.).to(ACC)
            acc += tl.load(W + w_at + j, mask=w_mask, other=0.).to(ACC)[:, :, None] * s[None, :, :]
        for c in tl.static_range(WAYS):
            out = _pick(O0, O1, O2, O3, c)
            way = tl.sum(tl.where(ways[:, None, None] == c, acc, 0.), axis=0)
            tl.store(out + t[:, None] * C + cols[None, :], way.to(out.dtype.element_ty), mask=tc)

    @triton.jit
    def _mudd_mix_bwd(W,      # (N, WAYS, J)
                      S,      # (N, J, C), tokens stride_t apart
                      G0,     # (N, C)
                      G1,     # (N, C), or G0 again past the ways
                      G2,     # (N, C), or G0
                      G3,     # (N, C), or G0
                      DW,     # (N, WAYS, J)
                      DS,     # (N, J, C), tokens ds_stride_t apart
                      J, N, C, stride_t, ds_stride_t,
                      ADD: tl.constexpr, WAYS: tl.constexpr, ACC: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr):
        t, ways, cols, tc, w_mask, w_at, s_at = _mudd_tile(J, N, C, stride_t, WAYS, BT, BC)
        g = tl.zeros((WAYS, BT, BC), ACC)
        for c in tl.static_range(WAYS):  # the ways' gradients, each read once
            g_c = tl.load(_pick(G0, G1, G2, G3, c) + t[:, None] * C + cols[None, :],
                          mask=tc, other=0.).to(ACC)
            g = tl.where(ways[:, None, None] == c, g_c[None, :, :], g)
        for j in range(J):
            s = tl.load(S + s_at + j * C, mask=tc, other=0.).to(ACC)
            tl.store(DW + w_at + j, tl.sum(g * s[None, :, :], axis=2).to(DW.dtype.element_ty),
                     mask=w_mask)
            d = tl.sum(tl.load(W + w_at + j, mask=w_mask, other=0.).to(ACC)[:, :, None] * g, axis=0)
            ds_at = t[:, None] * ds_stride_t + j * C + cols[None, :]
            if ADD:
                d += tl.load(DS + ds_at, mask=tc, other=0.).to(ACC)
            tl.store(DS + ds_at, d.to(DS.dtype.element_ty), mask=tc)


# ----------------------------------------------------------------------------------- the custom ops

@torch.library.custom_op('resroute::mudd_mix', mutates_args=())
def triton_mudd_mix(weights: Tensor, states: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ways' mixes of weights (N, ways, J) over states (N, J, C), rows of the buffer (its
    tokens' stride as given): a tensor (N, C) a way, then empty tensors up to four (a fixed number
    of outputs, each counted). A PyTorch twin: DenseMix's bmm."""
    N, ways, J = weights.shape
    C = states.shape[-1]
    out = [states.new_empty((N, C) if c < ways else 0) for c in range(4)]
    BT, acc = token_tile(ways, C, N), accumulator(states.dtype)[1]
    _mudd_mix_fwd[(triton.cdiv(N, BT),)](
        W=weights.contiguous(),     # (N, ways, J)
        S=states,                   # (N, J, C), rows of the buffer
        O0=out[0],                  # (N, C)
        O1=out[1],                  # (N, C), or empty past the ways
        O2=out[2],
        O3=out[3],
        J=J,
        N=N,
        C=C,
        stride_t=states.stride(0),
        WAYS=ways, ACC=acc, BT=BT, BC=next_pow2(C))
    return tuple(out)


@triton_mudd_mix.register_fake
def _(weights, states):
    return tuple(states.new_empty((weights.shape[0], states.shape[-1])
                                  if c < weights.shape[1] else 0)
                 for c in range(4))


@torch.library.custom_op('resroute::mudd_mix_backward', mutates_args=('grads',))
def triton_mudd_mix_backward(weights: Tensor, states: Tensor, grad_ways: List[Tensor],
                             grads: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The weights' gradient (N, ways, J) from the ways' gradients, and the states' w^T g added into
    `grads` (rows of the gradients' buffer, laid out as the states are; then an empty tensor is
    returned), or where it is None written to a new tensor (N, J, C), returned. A PyTorch twin:
    DenseMix's bmm."""
    N, ways, J = weights.shape
    C = states.shape[-1]
    g = [x.contiguous() for x in grad_ways]
    grad_w = torch.empty_like(weights)
    written = states.new_empty(states.shape) if grads is None else states.new_empty(0)
    dS = written if grads is None else grads
    BT, acc = token_tile(ways, C, N), accumulator(states.dtype)[1]
    G = g + g[:1] * (4 - ways)  # four pointers: the first way's again past the ways (not read)
    _mudd_mix_bwd[(triton.cdiv(N, BT),)](
        W=weights.contiguous(),     # (N, ways, J)
        S=states,                   # (N, J, C), rows of the buffer
        G0=G[0],                    # (N, C), the ways' gradients
        G1=G[1],
        G2=G[2],
        G3=G[3],
        DW=grad_w,                  # (N, ways, J)
        DS=dS,                      # (N, J, C)
        J=J,
        N=N,
        C=C,
        stride_t=states.stride(0),
        ds_stride_t=dS.stride(0),
        ADD=grads is not None, WAYS=ways, ACC=acc, BT=BT, BC=next_pow2(C))
    return grad_w, written


@triton_mudd_mix_backward.register_fake
def _(weights, states, grad_ways, grads):
    return torch.empty_like(weights), states.new_empty(states.shape if grads is None else 0)


# ------------------------------------------------------------------------------------ the Functions

class DenseMix(torch.autograd.Function):
    """One mix of the buffer's states `read` (a slice): weights (J,) give sum_j w_j X_j (N, C);
    weights (N, ways, J) give, per token, the ways' mixes (N, ways, C), or (fused) a tuple of the
    ways' (N, C). The autograd inputs are the weights and the states this mix is the first to read
    (`owned`, buffer indices): it returns their gradients."""

    @staticmethod
    def forward(ctx, weights, states, read, owned, last, *owned_states):
        S = states.rows(states.values, read)  # (J, N, C), or (N, J, C) per token
        w = weights.to(S.dtype)
        # the class's multiply-adds run in the buffer's precision
        with torch.autocast(S.device.type, enabled=False):
            if states.fused:
                mixed = triton_mudd_mix(w, S)[:w.shape[1]]
            else:
                mixed = (torch.bmm(w, S) if states.per_token
                         else (w @ S.flatten(1)).view(S.shape[1:]))
        # the last mix saves the buffer (full by then), so that memory accounting sees it
        ctx.save_for_backward(weights, states.values if last else None)
        ctx.states, ctx.read, ctx.owned = states, read, owned
        ctx.owned_like = [(X.shape, X.dtype) for X in owned_states]
        return mixed

    @staticmethod
    def backward(ctx, *grad_mixed):
        weights, _ = ctx.saved_tensors
        states = ctx.states
        S = states.rows(states.values, ctx.read)
        g, w = [g.to(S.dtype) for g in grad_mixed], weights.to(S.dtype)
        first = states.takes_product(ctx.read)
        dS = None if first else states.rows(states.grads, ctx.read)
        with torch.autocast(S.device.type, enabled=False):
            if states.fused:  # grad_w and dS (+)= w^T g in one pass
                grad_w, product = triton_mudd_mix_backward(w, S, g, dS)
            elif states.per_token:  # grad_w = g S^T, dS += w^T g, token by token
                grad_w = torch.bmm(g[0], S.transpose(1, 2))
                # (baddbmm_ into the strided rows loops over tokens)
                product = torch.bmm(w.transpose(1, 2), g[0])
                if not first:
                    dS.add_(product)
            else:
                grad_w, g = S.flatten(1) @ g[0].flatten(), g[0].flatten()
                product = torch.outer(w, g).view(S.shape) if first else dS.flatten(1).addr_(w, g)
        if first:
            states.grads = product
        # complete: every later reader has added its share
        owned = [states.rows(states.grads, j).to(dtype).view(shape)
                 for j, (shape, dtype) in zip(ctx.owned, ctx.owned_like)]
        if 1 in ctx.owned:  # the first mix, the last to run backward
            states.grads = None
        return grad_w.to(weights.dtype), None, None, None, None, *owned


class RMSProjection(torch.autograd.Function):
    """MUDD's first projection in its weights' generator, W (X / RMS(X)) per token, computed as
    r (W X), r = 1/RMS(X): X is read once for r and once by the product (in autocast's dtype, as a
    Linear under autocast takes it), and no normalised copy is written. Backward, with p = W X:
    dX = W^T (r dh) + c X, c = -(dh . p) r^3 / C (one multiply-add beside the product),
    dW = (r dh)^T X."""

    @staticmethod
    def forward(ctx, X, weight):
        device = X.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else torch.promote_types(X.dtype, weight.dtype))
        r = rms_inverse(X, keepdim=True)
        X_low, W_low = X.to(dtype), weight.to(dtype)
        with torch.autocast(device, enabled=False):
            p = X_low @ W_low.t()
            h = p * r.to(dtype)
        ctx.save_for_backward(X, X_low, W_low, p, r)
        ctx.weight_dtype = weight.dtype
        return h

    @staticmethod
    def backward(ctx, grad_h):
        X, X_low, W_low, p, r = ctx.saved_tensors
        with torch.autocast(X.device.type, enabled=False):
            grad_p = grad_h.to(p.dtype) * r.to(p.dtype)
            c = (grad_h.to(r.dtype) * p.to(r.dtype)).sum(-1, keepdim=True) * r.pow(3) / -X.shape[-1]
            grad_X = torch.addcmul(grad_p @ W_low, X, c).to(X.dtype)
            grad_W = (grad_p.t() @ X_low).to(ctx.weight_dtype)
        return grad_X, grad_W


# ------------------------------------------------------------------------------------ the schedules

def denseformer(module, x, sublayers, backend):
    """DenseFormer with its states in one buffer: each average is one GEMV over the states it reads.
    Compiled, the class's forward (the compiler fuses its multiply-adds)."""
    if torch.compiler.is_compiling():
        return module(x, sublayers)
    group, k, alpha = 2 * module.period, module.dwa.dilation, module.dwa.alpha
    R = len(sublayers) // group
    states = DenseStates(R + 1, x, torch.promote_types(x.dtype, alpha.dtype), per_token=False)
    states.add(x)
    e = x
    for r in range(1, R + 1):
        for f in sublayers[(r - 1) * group:r * group]:
            x = x + f(x)
        states.add(x)
        read = slice(r % k, r + 1, k)
        # X_r, and e where the first average reads it
        first = [(r, x)] + ([(0, e)] if r == k else [])
        x = DenseMix.apply(alpha[r - 1, read], states, read, [j for j, _ in first], r == R,
                           *[X for _, X in first]).view(x.shape)
    return x


def mudd_weights(dense, i, X):
    """The weights (N, ways, i+2) of layer i's ways from its output X_{i+1}, as DynamicDenseWeights
    makes them, with the RMSNorm moved past the first projection (RMSProjection)."""
    w1, act, w2 = dense.generators[i]
    h = act(RMSProjection.apply(X.reshape(-1, X.shape[-1]), w1.weight))
    return w2(h).unflatten(-1, (dense.ways[i], i + 2)) + dense.bias[i]


def mudd(module, x, sublayers, backend):
    """MUDDFormer with its states in one buffer: each layer's ways are one product per token over
    the states. Compiled, the class's forward."""
    if torch.compiler.is_compiling():
        return module(x, sublayers)
    dense, n_layer = module.dense, len(sublayers) // 2
    states = DenseStates(n_layer + 1, x, torch.promote_types(x.dtype, dense.bias[0].dtype),
                         per_token=True, fused=backend == 'triton')
    states.add(x)
    ways, e = (x,), x
    for i, (attn, mlp) in enumerate(zip(sublayers[0::2], sublayers[1::2])):
        y = ways[-1] + attn(*ways[:3])
        X = y + mlp(y)
        states.add(X)
        w = mudd_weights(dense, i, X)  # (N, ways, i+2)
        first = [(0, e), (1, X)] if i == 0 else [(i + 1, X)]
        mixed = DenseMix.apply(w, states, slice(0, i + 2), [j for j, _ in first], i == n_layer - 1,
                               *[X for _, X in first])
        ways = (tuple(way.view(x.shape) for way in mixed) if states.fused
                else mixed.view(*x.shape[:-1], w.shape[1], x.shape[-1]).unbind(-2))
    return ways[0]
