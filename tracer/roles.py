"""Dimension roles, propagated through the captured program from its inputs and parameters.

Seeds:
- token inputs (input_ids, labels, attention masks, decoder ids) are (sample, attribute);
  pixel_values are (sample, none, attribute, attribute); a 1-D label vector is (sample,);
- every dimension of a parameter, buffer or parameter-derived tensor is parameter.
Rules, per op (the first that applies):
- views/reshapes align input and output dims by running size products; a merged group takes token
  when it merges a sample and an attribute dim ([batch * seq]: HF flattens logits and labels for the
  loss, MoE layers their tokens), its strongest role otherwise (token > sample > attribute >
  parameter > none); a split dim passes its role to its first part, and the remaining parts get
  attribute when it was sample, none when it was token (MoE's [tokens * top_k] -> [tokens, top_k]),
  its own role otherwise;
- transpose/permute/movedim permute roles; unsqueeze inserts none; squeeze/select/reductions drop the
  dim (or make it none with keepdim); slice/narrow keep roles;
- contractions: rows from the first operand, columns from the second operand's last dim, batch dims the
  stronger of the two operands' (a token-batched bmm against gathered expert weights stays sample);
- weights gathered by token indices (MoE experts) take the indices' roles on their leading dims;
- embedding: the index roles plus parameter for the embedding dim;
- copies that keep the rank (cat, pad, repeat, gather) keep their first input's roles;
- attention: the query's roles (the last dim from the value);
- anything else aligns dims from the right with the inputs (broadcasting) and takes the strongest role
  among same-sized input dims.
Dimensions of size 1 are none, except a sample dim (a batch of 1 keeps its sample dim). A dim with no
source gets token if it is the leading dim, of batch * seq_len, of a tensor of 2+ dims (the loss's
log-probabilities over flattened tokens), sample if it is the leading dim of the batch's size,
attribute if it is the sequence length, parameter otherwise.
"""

from __future__ import annotations

from tracer.capture import RawOp, Value
from tracer.ir import DimRole
from tracer.oprules import KIND_BY_NAME, base_name, tensor_args
from tracer.ir import OpKind

S, A, P, N, T = DimRole.SAMPLE, DimRole.ATTRIBUTE, DimRole.PARAMETER, DimRole.NONE, DimRole.TOKEN
_STRENGTH = {T: 4, S: 3, A: 2, P: 1, N: 0}
Roles = tuple[DimRole, ...]


def _strongest(roles: list[DimRole]) -> DimRole:
    return max(roles, key=_STRENGTH.__getitem__) if roles else N


class RoleInference:
    def __init__(self, batch: int, seq_len: int) -> None:
        self.batch = batch
        self.seq_len = seq_len
        self.roles: dict[int, Roles] = {}

    def guess(self, shape: tuple[int, ...]) -> Roles:
        out = []
        for i, s in enumerate(shape):
            if i == 0 and s == self.batch * self.seq_len and len(shape) > 1 and self.seq_len > 1:
                out.append(T)
            elif i == 0 and s == self.batch and (len(shape) > 1 or s > 1):
                out.append(S)
            elif s == 1:
                out.append(N)
            elif s == self.seq_len:
                out.append(A)
            else:
                out.append(P)
        return tuple(out)

    def seed(self, v: Value, weight_like: bool) -> Roles:
        if v.vid in self.roles:
            return self.roles[v.vid]
        if v.param is not None or weight_like:
            r = tuple(N if s == 1 else P for s in v.shape)
        elif v.input_name == "pixel_values" and len(v.shape) == 4:
            r = (S, N, A, A)
        elif v.input_name is not None:
            r = tuple(S if i == 0 else (N if s == 1 else A) for i, s in enumerate(v.shape))
        else:
            r = self.guess(v.shape)
        self.roles[v.vid] = _clean(v.shape, r)
        return self.roles[v.vid]

    def of(self, v: Value) -> Roles:
        return self.roles.get(v.vid) or self.seed(v, False)

    def infer(self, op: RawOp, weight_like: set[int]) -> None:
        for o in op.outputs:
            if o.vid in weight_like:
                gathered = self._gathered(op, o)
                if gathered is not None:
                    self.roles[o.vid] = gathered
                else:
                    self.seed(o, True)
        pending = [o for o in op.outputs if o.vid not in self.roles]
        if not pending:
            return
        ins = tensor_args(op)
        first = pending[0]
        roles = self._rule(op, ins, first.shape)
        self.roles[first.vid] = _clean(first.shape, roles if roles is not None else self._broadcast(ins, first.shape))
        for o in pending[1:]:
            self.roles[o.vid] = _clean(o.shape, self._broadcast(ins, o.shape))

    def _gathered(self, op: RawOp, out: Value) -> Roles | None:
        """Weights gathered by token-dependent indices (MoE experts): leading dims follow the indices."""
        if base_name(op.target) not in ("index", "index_select", "gather"):
            return None
        idx = next((t for t in tensor_args(op) if t.dtype in ("int64", "int32") and t.param is None), None)
        if idx is None or len(idx.shape) >= len(out.shape):
            return None
        rest = out.shape[len(idx.shape):]
        return _clean(out.shape, self.of(idx) + tuple(N if s == 1 else P for s in rest))

    def _rule(self, op: RawOp, ins: list[Value], shape: tuple[int, ...]) -> Roles | None:
        name = base_name(op.target)
        kind = KIND_BY_NAME.get(name)
        if not ins:
            return self.guess(shape)
        x = ins[0]
        xr = self.of(x)
        if name in ("transpose", "swapaxes") and len(op.args) >= 3:
            d0, d1 = (int(d) % max(len(xr), 1) for d in op.args[1:3])
            r = list(xr)
            r[d0], r[d1] = r[d1], r[d0]
            return tuple(r)
        if name == "t":
            return tuple(reversed(xr))
        if name in ("permute",):
            dims = op.args[1]
            return tuple(xr[int(d) % len(xr)] for d in dims)
        if name == "movedim" and len(xr) == len(shape):
            return None
        if name in ("view", "_unsafe_view", "reshape", "_reshape_alias", "flatten", "unflatten", "view_as",
                    "unsqueeze", "squeeze", "expand", "expand_as") or (kind is OpKind.VIEW and name not in ("slice", "select", "narrow", "split", "chunk", "unbind", "split_with_sizes", "diagonal", "as_strided", "unfold")):
            if name in ("expand", "expand_as"):
                return tuple(xr[i - (len(shape) - len(xr))] if i >= len(shape) - len(xr) and x.shape[i - (len(shape) - len(xr))] == s
                             else self.guess(shape)[i] for i, s in enumerate(shape))
            return _reshape_roles(x.shape, xr, shape)
        if name in ("slice", "narrow", "split", "chunk", "split_with_sizes", "unbind", "select"):
            if len(shape) == len(xr):
                return xr
            if name in ("select", "unbind"):
                d = int(op.args[1]) % len(xr) if len(op.args) > 1 else 0
                return xr[:d] + xr[d + 1:]
            return None
        if kind is OpKind.MATMUL and name not in ("einsum",) and len(ins) >= 2:
            a, b = (ins[1], ins[2]) if name in ("addmm", "baddbmm", "addbmm") else (ins[0], ins[1])
            if name.startswith("conv"):
                return None
            ar, br = self.of(a), self.of(b)
            col = br[0] if name == "linear" else (br[-1] if len(br) >= 2 else N)
            rows = list(ar[:-1]) if len(ar) >= 2 else []
            if name != "linear":  # batched operands: each batch dim takes the stronger of the two roles
                b_batch = br[:-2]
                for k in range(1, min(len(rows) - 1, len(b_batch)) + 1):
                    rows[-1 - k] = _strongest([rows[-1 - k], b_batch[-k]])
            r = tuple(rows) + (col,)
            return r if len(r) == len(shape) else None
        if kind is OpKind.EMBEDDING:
            idx = next((t for t in ins if t.dtype in ("int64", "int32")), None)
            return (self.of(idx) + (P,)) if idx is not None and len(idx.shape) + 1 == len(shape) else None
        if kind is OpKind.ATTENTION:
            q, v = ins[0], ins[2] if len(ins) > 2 else ins[0]
            qr = self.of(q)
            return qr[:-1] + (self.of(v)[-1],) if len(qr) == len(shape) else None
        if kind in (OpKind.REDUCTION, OpKind.LOSS) and len(shape) < len(xr):
            return _reduced(op, x.shape, xr, shape)
        if kind is OpKind.COPY and len(shape) == len(xr):  # cat, pad, repeat, gather: dims keep their meaning
            return xr
        return None

    def _broadcast(self, ins: list[Value], shape: tuple[int, ...]) -> Roles:
        guessed = self.guess(shape)
        out = []
        for i, s in enumerate(shape):
            cands = []
            back = len(shape) - i
            for t in ins:
                if len(t.shape) >= back and t.shape[-back] == s:
                    cands.append(self.of(t)[-back])
            out.append(_strongest(cands) if cands else guessed[i])
        return tuple(out)


def _clean(shape: tuple[int, ...], roles: Roles) -> Roles:
    if len(roles) != len(shape):
        roles = tuple(N if s == 1 else P for s in shape)
    return tuple(N if s == 1 and r is not S else r for s, r in zip(shape, roles))


def _reduced(op: RawOp, in_shape: tuple[int, ...], xr: Roles, shape: tuple[int, ...]) -> Roles | None:
    dims = op.args[1] if len(op.args) > 1 and isinstance(op.args[1], (list, tuple, int)) else None
    if dims is None:
        return tuple(N for _ in shape)
    dims = [dims] if isinstance(dims, int) else list(dims)
    keep = [r for i, r in enumerate(xr) if i not in {int(d) % len(xr) for d in dims}]
    return tuple(keep) if len(keep) == len(shape) else None


def _reshape_roles(src: tuple[int, ...], src_roles: Roles, dst: tuple[int, ...]) -> Roles:
    """Align dims by running products; merged dims take their strongest role, split dims pass theirs on.

    Size-1 dims pair up with size-1 dims (so a batch of 1 keeps its sample dim through reshapes)."""
    out: list[DimRole] = []
    i = j = 0
    while j < len(dst):
        if dst[j] == 1:
            paired = i < len(src) and src[i] == 1
            out.append(src_roles[i] if paired else N)
            i += 1 if paired else 0
            j += 1
            continue
        group: list[int] = []
        prod_s = 1
        while i < len(src) and (prod_s < dst[j] or (src[i] == 1 and prod_s == 1)):
            group.append(i)
            prod_s *= src[i]
            i += 1
        group_d, prod_d = [j], dst[j]
        while prod_d < prod_s and j + 1 < len(dst):
            j += 1
            group_d.append(j)
            prod_d *= dst[j]
        while prod_s < prod_d and i < len(src):
            group.append(i)
            prod_s *= src[i]
            i += 1
        merged = [src_roles[k] for k in group if k < len(src_roles)]
        role = T if len(group_d) == 1 and S in merged and A in merged else _strongest(merged)
        for n, _ in enumerate(group_d):
            out.append(role if n == 0 else A if role is S else N if role is T else role)
        j += 1
    return tuple(out[: len(dst)])
