"""Property tests (hypothesis): any mix of dtypes, shapes, views and shared storages,
modules with tied weights, optimizers, grads present or not, any number of cycles:
the round trip is bit-exact and every tensor object keeps its identity."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from torchferry import Ferry, Residency

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
          torch.int64, torch.bool, torch.complex64] + [
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN payloads included), as a flat uint8 tensor."""
    return t.detach().clone().contiguous().reshape(-1).view(torch.uint8).clone()


@st.composite
def tensor_sets(draw):
    """Base tensors of random dtype/shape, plus views of them (slices, transposes, strided)."""
    bases = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
        raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size(),),
                            dtype=torch.uint8, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
        bases.append(raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape))
    tensors = list(bases)
    for _ in range(draw(st.integers(0, 4))):
        b = draw(st.sampled_from(bases))
        kind = draw(st.sampled_from(["slice", "t", "step", "flat"]))
        if kind == "slice" and b.dim() and b.shape[0] > 1:
            tensors.append(b[1:])
        elif kind == "t" and b.dim() >= 2:
            tensors.append(b.transpose(0, 1))
        elif kind == "step" and b.dim() and b.shape[-1] > 2:
            tensors.append(b[..., ::2])
        elif kind == "flat" and b.is_contiguous():
            tensors.append(b.reshape(-1))
    if len(tensors) > len(bases) and draw(st.booleans()):
        tensors = tensors[len(bases):]  # only views: their whole base storage still moves
    order = draw(st.permutations(range(len(tensors))))
    return [tensors[i] for i in order]


@SETTINGS
@given(tensor_sets(), st.integers(1, 3))
def test_any_tensor_set_round_trips_bit_exact(tensors, cycles):
    want = [bits(t) for t in tensors]
    ids = [id(t) for t in tensors]
    meta = [(t.shape, t.stride(), t.dtype) for t in tensors]
    ferry = Ferry(*tensors)
    for _ in range(cycles):
        ferry.offload().wait()
        assert ferry.residency is Residency.HOST
        assert all(torch.equal(a, bits(t)) for a, t in zip(want, tensors))  # host copies
        ferry.reload().wait()
        assert all(torch.equal(a, bits(t)) for a, t in zip(want, tensors))
    assert [id(t) for t in tensors] == ids
    assert [(t.shape, t.stride(), t.dtype) for t in tensors] == meta
    ferry.close()


class Net(nn.Module):
    def __init__(self, width: int, tied: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, width, dtype=dtype)
        self.hidden = nn.Linear(width, width, dtype=dtype)
        self.out = nn.Linear(width, 11, bias=False, dtype=dtype)
        if tied:
            self.out.weight = self.emb.weight
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, ids):
        self.count += 1
        return self.out(torch.tanh(self.hidden(self.emb(ids)))).float().logsumexp(-1).mean()


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_loop": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}


def _train(m, opt, ids, steps, ferry=None, grads_none=True):
    losses = []
    for _ in range(steps):
        if ferry is not None:
            ferry.offload().wait()
            ferry.reload().wait()
        loss = m(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=grads_none)
        losses.append(loss.detach())
    return losses


@SETTINGS
@given(st.integers(1, 9), st.booleans(), st.sampled_from([torch.float32, torch.bfloat16]),
       st.sampled_from(sorted(OPTIMIZERS)), st.booleans(), st.integers(1, 3))
def test_training_with_cycles_is_bit_identical_to_training_without(width, tied, dtype, opt_name, grads_none, steps):
    if opt_name == "adam_fused" and dtype is torch.bfloat16:
        dtype = torch.float32
    ids = torch.tensor([[1, 3, 5, 7], [2, 4, 6, 10]])
    runs = []
    for with_ferry in (False, True):
        torch.manual_seed(0)
        m = Net(width, tied, dtype)
        opt = OPTIMIZERS[opt_name](m.parameters())
        ferry = Ferry(m, opt) if with_ferry else None
        ident = [id(p) for p in m.parameters()]
        losses = _train(m, opt, ids, steps, ferry, grads_none)
        if ferry is not None:
            ferry.offload()  # end offloaded: the host copy must equal the reference too
            assert [id(p) for p in m.parameters()] == ident
            if tied:
                assert m.out.weight is m.emb.weight
        state = [bits(p) for p in m.parameters()] + [bits(b) for b in m.buffers()] + [
            bits(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        runs.append((torch.stack(losses), state))
    (l0, s0), (l1, s1) = runs
    assert torch.equal(l0, l1)
    assert len(s0) == len(s1) and all(torch.equal(a, b) for a, b in zip(s0, s1))
