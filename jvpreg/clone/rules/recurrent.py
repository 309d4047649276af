"""Fused recurrent modules (nn.RNN / nn.LSTM / nn.GRU) unrolled through their cell equations.

The fused kernels hide their nonlinearities, so in clone mode the sequence is run step by step
with the cell equations below; each op goes through its own clone rule (relu/tanh/sigmoid
from the primal block, products by the Leibniz rule):

* RNN: ``h' = act(x W_ih^T + b_ih + h W_hh^T + b_hh)``
* LSTM: ``i, f, g, o = split(x W_ih^T + b_ih + h W_hh^T + b_hh)``; ``c' = s(f) c + s(i) tanh(g)``;
  ``h' = s(o) tanh(c')`` (then ``h' W_hr^T`` with projections)
* GRU: ``r = s(.), z = s(.)``, ``n = tanh(x_n + r * (h W_hn^T + b_hn))``, ``h' = (1 - z) n + z h``

The Elman RNN, the LSTM and the GRU run these equations directly on the physical blocks, with hand-written
tangents (:func:`_on_blocks`) when only the input carries tangents; with
parameter tangents every op goes through its rule. Packed sequences (``torch.nn.utils.rnn``) run the same cell
equations step by step on the rows each step holds (:func:`_run_packed`); packing and unpadding move rows, so every
block is packed alike (:func:`pack_padded`, :func:`pad_packed`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torch._C import DisableTorchFunctionSubclass

from jvpreg.clone.core.registry import register_op
from jvpreg.clone.core.tensor import compiling, is_clone, raw, wrap
from jvpreg.clone.rules.blocks import as_batch, assemble, split
from jvpreg.clone.rules.kinds import composite


def _cell(mode, x_proj, h, w_hh, b_hh, w_hr=None):
    if mode == "lstm":
        hh, cc = h
        gates = x_proj + F.linear(hh, w_hh, b_hh)
        i, f, g, o = gates.chunk(4, -1)
        c2 = torch.sigmoid(f) * cc + torch.sigmoid(i) * torch.tanh(g)
        h2 = torch.sigmoid(o) * torch.tanh(c2)
        if w_hr is not None:
            h2 = F.linear(h2, w_hr)
        return h2, (h2, c2)
    if mode == "gru":
        gh = F.linear(h, w_hh, b_hh)
        xr, xz, xn = x_proj.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        h2 = (1 - z) * n + z * h
        return h2, h2
    pre = x_proj + F.linear(h, w_hh, b_hh)
    h2 = torch.relu(pre) if mode == "rnn_relu" else torch.tanh(pre)
    return h2, h2


def _weights(params, layer: int, d: int, dirs: int, per: int, has_biases: bool, mode: str):
    """``(index, w_ih, w_hh, b_ih, b_hh, w_hr)`` of one layer and direction in the flat weight list."""
    idx = layer * dirs + d
    w = params[idx * per:(idx + 1) * per]
    b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
    w_hr = w[-1] if mode == "lstm" and per in (3, 5) else None
    return idx, w[0], w[1], b_ih, b_hh, w_hr


def _run(mode, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    if batch_first:
        input = input.transpose(0, 1)
    unbatched = input.dim() == 2
    if unbatched:
        input = input.unsqueeze(1)
        hx = tuple(h.unsqueeze(1) for h in hx) if mode == "lstm" else hx.unsqueeze(1)
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    layer_in = input
    h_n, c_n = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            idx, w_ih, w_hh, b_ih, b_hh, w_hr = _weights(params, layer, d, dirs, per, has_biases, mode)
            state = (hx[0][idx], hx[1][idx]) if mode == "lstm" else hx[idx]
            x_proj = F.linear(layer_in, w_ih, b_ih)  # all steps at once
            steps = range(x_proj.shape[0] - 1, -1, -1) if d == 1 else range(x_proj.shape[0])
            seq = [None] * x_proj.shape[0]
            for t in steps:
                y, state = _cell(mode, x_proj[t], state, w_hh, b_hh, w_hr)
                seq[t] = y
            outs.append(torch.stack(seq, 0))
            if mode == "lstm":
                h_n.append(state[0])
                c_n.append(state[1])
            else:
                h_n.append(state)
        layer_in = torch.cat(outs, -1) if dirs == 2 else outs[0]
        if dropout and train and layer < num_layers - 1:
            layer_in = F.dropout(layer_in, dropout, True)
    output = layer_in
    hn = torch.stack(h_n, 0)
    cn = torch.stack(c_n, 0) if mode == "lstm" else None
    if unbatched:
        output = output.squeeze(1)
        hn = hn.squeeze(1)
        cn = cn.squeeze(1) if cn is not None else None
    if batch_first:
        output = output.transpose(0, 1)
    return (output, hn, cn) if mode == "lstm" else (output, hn)


def _slope_sigmoid(p0):
    """``(sigmoid(a), sigmoid'(a))`` of a primal pre-activation."""
    sg = torch.sigmoid(p0)
    return sg, sg * (1 - sg)


def _lstm_step(gates, c, w_hr):
    """One LSTM step on physical blocks (``gates``: ``(K, B, 4H)``, ``c``: ``(K, B, H)``), every nonlinearity
    linearised at the primal block: ``c' = s(f) c + s(i) tanh(g)``, ``h' = s(o) tanh(c')`` and their tangents
    ``dc' = s'(f) df c + s(f) dc + s'(i) di tanh(g) + s(i) tanh'(g) dg``, ``dh' = s'(o) do tanh(c') + s(o) tanh'(c') dc'``."""
    g0, d = split(gates, nonfinite=False)
    sg, dsg = _slope_sigmoid(g0)
    si, sf, _, so = sg.chunk(4, -1)
    dsi, dsf, _, dso = dsg.chunk(4, -1)
    di, df, dg, do = d.chunk(4, -1)
    tg = torch.tanh(g0[..., 2 * c.shape[-1]:3 * c.shape[-1]])
    c0, dc = split(c, nonfinite=False)
    c0n = sf * c0 + si * tg
    dcn = (dsf * c0) * df + sf * dc + (dsi * tg) * di + (si * (1 - tg * tg)) * dg
    tc = torch.tanh(c0n)
    h0n = so * tc
    dhn = (dso * tc) * do + (so * (1 - tc * tc)) * dcn
    h = assemble(h0n, dhn)
    return (h if w_hr is None else F.linear(h, w_hr)), assemble(c0n, dcn)


def _gru_step(xp, h, w_hh, b_hh):
    """One GRU step on physical blocks: ``r, z = s(.)``, ``n = tanh(x_n + r (h W_hn^T + b_hn))``,
    ``h' = (1 - z) n + z h``, linearised at the primal block."""
    gh = F.linear(h, w_hh, b_hh)
    xr, xz, xn = xp.chunk(3, -1)
    hr, hz, hn = gh.chunk(3, -1)
    (pr0, dpr), (pz0, dpz) = split(xr + hr, nonfinite=False), split(xz + hz, nonfinite=False)
    r0, dr0 = _slope_sigmoid(pr0)
    z0, dz0 = _slope_sigmoid(pz0)
    dr, dz = dr0 * dpr, dz0 * dpz
    (hn0, dhn0), (xn0, dxn) = split(hn, nonfinite=False), split(xn, nonfinite=False)
    pn0 = xn0 + r0 * hn0
    n0 = torch.tanh(pn0)
    dn = (1 - n0 * n0) * (dxn + dr * hn0 + r0 * dhn0)
    h0, dh = split(h, nonfinite=False)
    h0n = (1 - z0) * n0 + z0 * h0
    return assemble(h0n, dz * (h0 - n0) + (1 - z0) * dn + z0 * dh)


def _elman_step(pre, mode):
    """One Elman step on physical blocks: relu through its fused backward kernel (mask of the primal block),
    tanh linearised at the primal block."""
    a, d = split(pre, nonfinite=False)
    if mode == "rnn_relu":
        return assemble(every_block=torch.ops.aten.threshold_backward(pre, a.expand_as(pre), 0))
    o = torch.tanh(a)
    return assemble(o, (1 - o * o) * d)


def _rows(t: torch.Tensor) -> tuple:
    """``(K-1, T, B, G)`` -> ``T`` matrices ``((K-1) B, G)``: a tangent recurrence runs on 2-D rows, so the input
    part and the recurrent product of a step are one ``addmm``."""
    return t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[-1]).unbind(0)


def _step_rows(t: torch.Tensor, k1: int) -> tuple:
    """``(T, B, G)`` primal slopes -> ``T`` matrices ``((K-1) B, G)`` matching :func:`_rows` (block-major rows)."""
    return (t.repeat(1, k1, 1) if k1 > 1 else t).unbind(0)


def _unrows(steps: list, k1: int) -> torch.Tensor:
    """``T`` matrices ``((K-1) B, H)`` -> ``(K-1, T, B, H)``."""
    out = torch.stack(steps, 0)
    return out.reshape(out.shape[0], k1, -1, out.shape[-1]).transpose(0, 1)


def _lstm_layer(x, h, c, w_ih, w_hh, b_ih, b_hh, w_hr, reverse):
    """One LSTM layer and direction on physical blocks (``x``: ``(K, T, B, F)``, ``h``, ``c``: ``(K, B, .)``):
    the primal by torch's fused kernel, its gates for every step in two products, and only the tangent run step
    by step, ``dg_t = dX_t + dh_{t-1} W_hh^T``, ``dc_t = [A_i, A_f, A_g] . dg_t + s(f_t) dc_{t-1}``,
    ``dh_t = A_o do_t + s(o_t) tanh'(c_t) dc_t`` with the slopes ``A`` of every step computed at once."""
    if reverse:
        x = x.flip(1)
    (x0, dx_in), (h0, dh), (c0, dc) = (split(t, nonfinite=False) for t in (x, h, c))
    weights = [w for w in (w_ih, w_hh, b_ih, b_hh, w_hr) if w is not None]
    out0, hT, cT = torch.lstm(x0, (h0[None], c0[None]), weights, b_ih is not None, 1, 0.0, False, False, False)
    # (1, B, H) -> (B, H) by shape, not by index: torch 2.11's pre-dispatch tracer records the final states of a
    # projected LSTM with one dimension too many, which an index would bake into the program
    hT, cT = hT.reshape(h0.shape), cT.reshape(c0.shape)
    hs = torch.cat([h0[None], out0[:-1]])                                        # h_{t-1}, every step
    gates = F.linear(x0, w_ih, b_ih) + F.linear(hs, w_hh, b_hh)                   # (T, B, 4H)
    sg = torch.sigmoid(gates)
    si, sf, _, so = sg.chunk(4, -1)
    hid = c0.shape[-1]
    tg = torch.tanh(gates[..., 2 * hid:3 * hid])
    itg = si * tg
    cs, cc = [], c0
    sfs = sf.unbind(0)
    for itg_t, sf_t in zip(itg.unbind(0), sfs):  # the primal cell states (the fused kernel keeps them to itself)
        cc = torch.addcmul(itg_t, sf_t, cc)
        cs.append(cc)
    c_seq = torch.stack(cs)
    c_prev = torch.cat([c0[None], c_seq[:-1]])
    tc = torch.tanh(c_seq)
    dsg = sg * (1 - sg)
    dsi, dsf, _, dso = dsg.chunk(4, -1)
    slopes = torch.cat([dsi * tg, dsf * c_prev, si * (1 - tg * tg), dso * tc], -1)  # per gate, every step
    carry = so * (1 - tc * tc)
    dx = F.linear(dx_in, w_ih)                                                   # (K-1, T, B, 4H)
    k1, w_t = dx.shape[0], w_hh.t()
    dh, dc = dh.reshape(-1, h0.shape[-1]), dc.reshape(-1, hid)
    dhs = []
    per_step = (_rows(dx), *(_step_rows(t, k1) for t in (slopes, sf, carry)))
    for dx_t, slope_t, sf_t, carry_t in zip(*per_step):
        m = torch.addmm(dx_t, dh, w_t) * slope_t
        mi, mf, mg, mo = m.chunk(4, -1)
        dc = torch.addcmul(mi + mf + mg, sf_t, dc)
        dh = torch.addcmul(mo, carry_t, dc)
        if w_hr is not None:
            dh = F.linear(dh, w_hr)
        dhs.append(dh)
    out = assemble(out0, _unrows(dhs, k1))
    if reverse:
        out = out.flip(1)
    return out, assemble(hT, dh.view(k1, *hT.shape)), assemble(cT, dc.view(k1, *cT.shape))


def _elman_layer(x, h, w_ih, w_hh, b_ih, b_hh, reverse):
    """One tanh RNN layer and direction on physical blocks, as :func:`_lstm_layer`: the primal by torch's fused
    kernel, then only the tangent step by step, ``dh_t = (1 - h_t^2) (dX_t + dh_{t-1} W_hh^T)``."""
    if reverse:
        x = x.flip(1)
    (x0, dx_in), (h0, dh) = split(x, nonfinite=False), split(h, nonfinite=False)
    weights = [w for w in (w_ih, w_hh, b_ih, b_hh) if w is not None]
    out0, hT = torch.rnn_tanh(x0, h0[None], weights, b_ih is not None, 1, 0.0, False, False, False)
    dx = F.linear(dx_in, w_ih)                                                   # (K-1, T, B, H)
    k1, w_t = dx.shape[0], w_hh.t()
    dh, dhs = dh.reshape(-1, h0.shape[-1]), []
    for dx_t, slope_t in zip(_rows(dx), _step_rows(1 - out0 * out0, k1)):
        dh = torch.addmm(dx_t, dh, w_t) * slope_t
        dhs.append(dh)
    out = assemble(out0, _unrows(dhs, k1))
    if reverse:
        out = out.flip(1)
    return out, assemble(hT[0], dh.view(k1, *hT[0].shape))


def _gru_layer(x, h, w_ih, w_hh, b_ih, b_hh, reverse):
    """One GRU layer and direction on physical blocks, as :func:`_lstm_layer`: the primal by torch's fused kernel,
    ``r, z, n`` of every step at once, then only the tangent step by step: ``dr, dz = s'(.) (dX_{r,z} + dh W_{h r,z}^T)``,
    ``dn = tanh'(.) (dX_n + dr (h W_hn^T + b_hn) + r (dh W_hn^T))``, ``dh' = dz (h - n) + (1 - z) dn + z dh``."""
    if reverse:
        x = x.flip(1)
    (x0, dx_in), (h0, dh) = split(x, nonfinite=False), split(h, nonfinite=False)
    weights = [w for w in (w_ih, w_hh, b_ih, b_hh) if w is not None]
    out0, hT = torch.gru(x0, h0[None], weights, b_ih is not None, 1, 0.0, False, False, False)
    hs = torch.cat([h0[None], out0[:-1]])
    gx, gh = F.linear(x0, w_ih, b_ih), F.linear(hs, w_hh, b_hh)                  # (T, B, 3H)
    hid = h0.shape[-1]
    rz = torch.sigmoid(gx[..., :2 * hid] + gh[..., :2 * hid])
    r, z = rz[..., :hid], rz[..., hid:]
    ghn = gh[..., 2 * hid:]
    n = torch.tanh(gx[..., 2 * hid:] + r * ghn)
    drz, dn0, hmn, omz = rz * (1 - rz), 1 - n * n, hs - n, 1 - z
    dx = F.linear(dx_in, w_ih)                                                   # (K-1, T, B, 3H)
    k1, w_rz, w_n = dx.shape[0], w_hh[:2 * hid].t(), w_hh[2 * hid:].t()
    dh, dhs = dh.reshape(-1, hid), []
    per_step = (_rows(dx[..., :2 * hid]), _rows(dx[..., 2 * hid:]),
                *(_step_rows(t, k1) for t in (drz, r, ghn, dn0, hmn, omz, z)))
    for dx_rz, dx_n, drz_t, r_t, ghn_t, dn0_t, hmn_t, omz_t, z_t in zip(*per_step):
        drz_s = torch.addmm(dx_rz, dh, w_rz) * drz_t
        dr, dz = drz_s[:, :hid], drz_s[:, hid:]
        dn = torch.addcmul(torch.addcmul(dx_n, r_t, dh @ w_n), dr, ghn_t) * dn0_t
        dh = torch.addcmul(torch.addcmul(dz * hmn_t, omz_t, dn), z_t, dh)
        dhs.append(dh)
    out = assemble(out0, _unrows(dhs, k1))
    if reverse:
        out = out.flip(1)
    return out, assemble(hT[0], dh.view(k1, *hT[0].shape))


def _on_blocks(mode, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """The RNN, LSTM and GRU written directly on the physical blocks (:func:`_elman_step`, :func:`_lstm_step`,
    :func:`_gru_step`): the cell equations with hand-written tangents instead of one clone rule per op and step
    (the per-step dispatch of every op made the op-by-op path many times a fused forward)."""
    x = raw(input)  # (K, *logical)
    k = x.shape[0]
    if batch_first:
        x = x.transpose(1, 2)
    unbatched = x.dim() == 3
    if unbatched:
        x = x.unsqueeze(2)
    states = hx if mode == "lstm" else (hx,)
    phys = []
    for st in states:  # (K, L*dirs, B, H); a plain initial state is the same in every block
        st = raw(st) if is_clone(st) else as_batch(st, k)
        phys.append(st.unsqueeze(-2) if unbatched else st)
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    layer_in, h_n, c_n = x, [], []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            idx, w_ih, w_hh, b_ih, b_hh, w_hr = _weights(params, layer, d, dirs, per, has_biases, mode)
            h = phys[0][:, idx]
            c = phys[1][:, idx] if mode == "lstm" else None
            # fewest ops: the fused primal and a tangent-only recurrence, except for the relu RNN, whose per-step
            # form is already three kernels (one product for every block); Inductor fuses the per-step form better
            if mode != "rnn_relu" and not compiling():
                if mode == "lstm":
                    seq, h, c = _lstm_layer(layer_in, h, c, w_ih, w_hh, b_ih, b_hh, w_hr, d == 1)
                elif mode == "gru":
                    seq, h = _gru_layer(layer_in, h, w_ih, w_hh, b_ih, b_hh, d == 1)
                else:
                    seq, h = _elman_layer(layer_in, h, w_ih, w_hh, b_ih, b_hh, d == 1)
                outs.append(seq)
                h_n.append(h)
                c_n.append(c)
                continue
            xp = F.linear(layer_in, w_ih, b_ih)  # (K, T, B, G): every step at once
            steps = range(xp.shape[1] - 1, -1, -1) if d == 1 else range(xp.shape[1])
            seq = [None] * xp.shape[1]
            for t in steps:  # the per-step form
                if mode == "lstm":
                    h, c = _lstm_step(xp[:, t] + F.linear(h, w_hh, b_hh), c, w_hr)
                elif mode == "gru":
                    h = _gru_step(xp[:, t], h, w_hh, b_hh)
                else:
                    h = _elman_step(xp[:, t] + F.linear(h, w_hh, b_hh), mode)
                seq[t] = h
            outs.append(torch.stack(seq, 1))
            h_n.append(h)
            c_n.append(c)
        layer_in = torch.cat(outs, -1) if dirs == 2 else outs[0]
        if dropout and train and layer < num_layers - 1:
            keep = F.dropout(torch.ones_like(split(layer_in, differences=False)[0]), dropout, True)
            layer_in = layer_in * keep
    output, hn = layer_in, torch.stack(h_n, 1)
    cn = torch.stack(c_n, 1) if mode == "lstm" else None
    if unbatched:
        output, hn = output.squeeze(2), hn.squeeze(-2)
        cn = cn.squeeze(-2) if cn is not None else None
    if batch_first:
        output = output.transpose(1, 2)
    return (wrap(output), wrap(hn), wrap(cn)) if mode == "lstm" else (wrap(output), wrap(hn))


def _steps(batch_sizes: torch.Tensor) -> tuple:
    """``(sizes, starts)``: the rows of step ``t`` of a packed sequence are ``starts[t] : starts[t] + sizes[t]``."""
    sizes = batch_sizes.tolist()
    starts = [0]
    for b in sizes[:-1]:
        starts.append(starts[-1] + b)
    return sizes, starts


def _packed_layers(mode, x, initial, batch_sizes, params, has_biases, num_layers, dropout, train, bidirectional,
                   step, dim, drop):
    """The layers and directions of a recurrent op on a packed sequence, whose rows run along ``dim`` of ``x`` (the
    rows of step ``t`` being the first ``batch_sizes[t]`` sequences, longest first). ``initial(idx)``: the initial
    states of layer-direction ``idx`` (a list, the hidden state first); ``step(x_rows, states, w_hh, b_hh, w_hr)``:
    the states after one step (the output first); ``drop``: dropout between layers. Step ``t`` updates the first
    ``batch_sizes[t]`` states; a sequence's final state is the one after its last step (rows leave the batch as
    their sequences end, and join it in the same order, from their initial states, when a direction runs
    backward). Returns the last layer's rows and the final states, a list per layer-direction."""
    sizes, starts = _steps(batch_sizes)

    def rows(t, a, b):
        return t[(slice(None),) * dim + (slice(a, b),)]

    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    finals = []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            idx, w_ih, w_hh, b_ih, b_hh, w_hr = _weights(params, layer, d, dirs, per, has_biases, mode)
            first = initial(idx)
            xp = F.linear(x, w_ih, b_ih)  # every row at once
            seq = [None] * len(sizes)
            if d == 0:
                state, done = [rows(st, 0, sizes[0]) for st in first], []
                for t, (start, n) in enumerate(zip(starts, sizes)):
                    have = state[0].shape[dim]
                    if n < have:  # the shortest sequences ended at step t - 1
                        done.append([rows(st, n, have) for st in state])
                        state = [rows(st, 0, n) for st in state]
                    state = step(rows(xp, start, start + n), state, w_hh, b_hh, w_hr)
                    seq[t] = state[0]
                finals.append([torch.cat(parts, dim) for parts in zip(state, *reversed(done))])
            else:
                state = [rows(st, 0, sizes[-1]) for st in first]
                for t in range(len(sizes) - 1, -1, -1):
                    start, n = starts[t], sizes[t]
                    have = state[0].shape[dim]
                    if n > have:  # sequences whose last step is t join
                        state = [torch.cat([st, rows(f, have, n)], dim) for st, f in zip(state, first)]
                    state = step(rows(xp, start, start + n), state, w_hh, b_hh, w_hr)
                    seq[t] = state[0]
                finals.append(list(state))
            outs.append(torch.cat(seq, dim))
        x = torch.cat(outs, -1) if dirs == 2 else outs[0]
        if dropout and train and layer < num_layers - 1:
            x = drop(x)
    return x, finals


def _run_packed(mode, data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    """A recurrent op on a packed sequence (``data``: ``(N, F)``) through the cell equations of :func:`_cell`, every op
    through its rule (:func:`_packed_layers`)."""
    def initial(idx):
        return [hx[0][idx], hx[1][idx]] if mode == "lstm" else [hx[idx]]

    def step(x_rows, state, w_hh, b_hh, w_hr):
        _, new = _cell(mode, x_rows, tuple(state) if mode == "lstm" else state[0], w_hh, b_hh, w_hr)
        return list(new) if mode == "lstm" else [new]

    out, finals = _packed_layers(mode, data, initial, batch_sizes, params, has_biases, num_layers, dropout, train,
                                 bidirectional, step, 0, lambda h: F.dropout(h, dropout, True))
    hn = torch.stack([f[0] for f in finals], 0)
    return (out, hn, torch.stack([f[1] for f in finals], 0)) if mode == "lstm" else (out, hn)


def _packed_on_blocks(mode, data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    """:func:`_run_packed` on the physical blocks (``data``: ``(K, N, F)``), each step through the hand-written
    tangents of :func:`_lstm_step`, :func:`_gru_step` and :func:`_elman_step`, as :func:`_on_blocks` does."""
    x = raw(data)
    k = x.shape[0]
    states = hx if mode == "lstm" else (hx,)
    init = [raw(st) if is_clone(st) else as_batch(st, k) for st in states]

    def step(x_rows, state, w_hh, b_hh, w_hr):
        if mode == "lstm":
            return list(_lstm_step(x_rows + F.linear(state[0], w_hh, b_hh), state[1], w_hr))
        if mode == "gru":
            return [_gru_step(x_rows, state[0], w_hh, b_hh)]
        return [_elman_step(x_rows + F.linear(state[0], w_hh, b_hh), mode)]

    def drop(h):  # one mask for every block
        return h * F.dropout(torch.ones_like(split(h, differences=False)[0]), dropout, True)

    out, finals = _packed_layers(mode, x, lambda idx: [st[:, idx] for st in init], batch_sizes, params, has_biases,
                                 num_layers, dropout, train, bidirectional, step, 1, drop)
    hn = wrap(torch.stack([f[0] for f in finals], 1))
    return (wrap(out), hn, wrap(torch.stack([f[1] for f in finals], 1))) if mode == "lstm" else (wrap(out), hn)


def _packed(args) -> bool:
    """``torch.lstm(data, batch_sizes, hx, ...)``: the second argument is the packed sequence's integer batch sizes
    (a padded call has the initial state there)."""
    return len(args) > 1 and isinstance(args[1], torch.Tensor) and not args[1].is_floating_point()


def _recurrent(mode):
    def rule(*args, **kwargs):
        if _packed(args):
            if is_clone(args[0]) and not kwargs and not any(is_clone(p) for p in args[3]):
                with DisableTorchFunctionSubclass():
                    return _packed_on_blocks(mode, *args)
            return _run_packed(mode, *args, **kwargs)
        if is_clone(args[0]) and not kwargs and not any(is_clone(p) for p in args[2]):
            with DisableTorchFunctionSubclass():
                return _on_blocks(mode, *args)
        return _run(mode, *args, **kwargs)

    rule.__name__ = rule.__qualname__ = mode
    rule.__doc__ = (f"torch.{mode}: the cell equations on the physical blocks where only the input and the initial "
                    "state carry tangents (:func:`_on_blocks`), else every op through its rule (:func:`_run`).")
    return rule


for _mode in ("rnn_relu", "rnn_tanh", "lstm", "gru"):
    composite(getattr(torch, _mode), own_primal=False)(_recurrent(_mode))


@register_op(torch._pack_padded_sequence)
def pack_padded(func, input, lengths, batch_first):
    """``torch.nn.utils.rnn.pack_padded_sequence``: moves rows, the same in every block. The blocks ride in a
    feature dim, ``(K, T, B, *F)`` -> ``(T, B, K, *F)``, so one call packs them all; the batch sizes are state."""
    if not is_clone(input):
        return func(input, lengths, batch_first)
    with DisableTorchFunctionSubclass():
        data, sizes = func(raw(input).movedim(0, 2), lengths, batch_first)
        return wrap(data.movedim(1, 0)), sizes


@register_op(torch._pad_packed_sequence)
def pad_packed(func, data, batch_sizes, batch_first, padding_value, total_length):
    """``torch.nn.utils.rnn.pad_packed_sequence``: moves rows and pads with a constant, the same in every block."""
    if not is_clone(data):
        return func(data, batch_sizes, batch_first, padding_value, total_length)
    with DisableTorchFunctionSubclass():
        out, lengths = func(raw(data).movedim(0, 1), batch_sizes, batch_first, padding_value, total_length)
        return wrap(out.movedim(2, 0)), lengths
