"""Serialization: out-of-band tensors, views, by-value functions; no sockets."""

from __future__ import annotations

import operator

import pytest
import torch

from nbrpc.errors import SerializationError
from nbrpc.serialize import dumps, loads


def _roundtrip(obj):
    payload, buffers = dumps(obj)
    # what the receiver gets: private writable copies of each buffer frame
    return loads(payload, [bytearray(b.raw()) for b in buffers]), payload, buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bool,
                                   torch.bfloat16, torch.complex64, torch.uint8])
def test_tensor_dtypes_roundtrip(dtype: torch.dtype) -> None:
    x = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    y, _, buffers = _roundtrip(x)
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)
    assert len(buffers) == 1


def test_tensor_travels_out_of_band_without_copy() -> None:
    x = torch.randn(1000)
    payload, buffers = dumps(x)
    assert len(payload) < 500  # the 4000 data bytes are not in the pickle
    assert buffers[0].raw().nbytes == 4000
    # zero-copy: the buffer aliases the tensor's memory
    x[0] = 123.0
    assert torch.frombuffer(bytearray(buffers[0].raw()), dtype=torch.float32)[0] == 123.0


def test_slice_sends_only_its_elements() -> None:
    base = torch.arange(1_000_000, dtype=torch.float32)
    view = base[10:20]
    y, _, buffers = _roundtrip(view)
    assert buffers[0].raw().nbytes == 40
    assert torch.equal(y, view)


def test_strided_view_sends_only_its_elements() -> None:
    base = torch.arange(10_000, dtype=torch.float32).reshape(100, 100)
    view = base[:, ::10].t()
    y, _, buffers = _roundtrip(view)
    assert buffers[0].raw().nbytes == view.numel() * 4
    assert torch.equal(y, view)


def test_non_contiguous_view_keeps_its_layout() -> None:
    # As PyTorch's RPC (test_non_cont_tensors): only the view's 10 elements travel,
    # and it arrives with its strides, not contiguous.
    view = torch.rand(5, 5).narrow(1, 2, 2)
    y, _, buffers = _roundtrip(view)
    assert buffers[0].raw().nbytes == view.numel() * 4
    assert torch.equal(y, view) and y.stride() == view.stride() and not y.is_contiguous()
    grad_view = torch.rand(4, 6, requires_grad=True)[:, 1:4]
    z, _, _ = _roundtrip(grad_view)
    assert z.stride() == grad_view.stride() and z.requires_grad


def test_sparse_view_of_a_big_tensor_arrives_contiguous() -> None:
    # Its layout would need 100x its own elements (4 MB) on arrival: it comes compact.
    view = torch.rand(10_000, 100)[:, 3]
    y, _, _ = _roundtrip(view)
    assert torch.equal(y, view) and y.is_contiguous()


def test_same_tensor_twice_is_one_buffer() -> None:
    x = torch.ones(5)
    (a, b), _, buffers = _roundtrip((x, x))
    assert a is b and len(buffers) == 1


def test_requires_grad_and_parameter_kept() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    t = torch.zeros(3, requires_grad=True)
    (p2, t2), _, _ = _roundtrip((p, t))
    assert isinstance(p2, torch.nn.Parameter) and p2.requires_grad
    assert t2.requires_grad and t2.is_leaf


def test_empty_and_scalar_tensors() -> None:
    (e, s), _, _ = _roundtrip((torch.empty(0, 3), torch.tensor(2.5)))
    assert e.shape == (0, 3) and s.item() == 2.5


def _sparse(layout: str) -> torch.Tensor:
    dense = torch.tensor([[0.0, 2.0, 0.0, 0.0], [1.0, 0.0, 0.0, 3.0]])
    if layout == "coo-uncoalesced":  # (index [0, 1] twice: its values add up)
        return torch.sparse_coo_tensor([[0, 1, 0, 1], [1, 0, 1, 3]], [1.5, 1.0, 0.5, 3.0],
                                       (2, 4), check_invariants=True)
    if layout == "bsr":
        return dense.to_sparse_bsr((1, 2))
    return getattr(dense, f"to_sparse_{layout}" if layout != "coo" else "to_sparse")()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "coo-uncoalesced", "csr", "csc", "bsr"])
def test_sparse_tensors_travel_as_their_parts_and_keep_requires_grad(layout: str) -> None:
    """Torch's own pickling of a sparse tensor drops requires_grad (and so
    distributed autograd never saw one): each part travels out of band, and
    the tensor is rebuilt with its layout, values and autograd flag."""
    x = _sparse(layout).requires_grad_()
    y, _, buffers = _roundtrip(x)
    assert y.layout == x.layout and y.shape == x.shape and y.requires_grad and y.is_leaf
    assert torch.equal(y.detach().to_dense(), x.detach().to_dense())
    assert len(buffers) == (2 if x.layout is torch.sparse_coo else 3)
    if x.layout is torch.sparse_coo:
        assert y.is_coalesced() == x.is_coalesced()
    plain, _, _ = _roundtrip(_sparse(layout))
    assert not plain.requires_grad


def test_main_functions_by_value_importable_by_reference() -> None:
    def local_fn(a):  # a closure is not importable: pickled by value
        return a + 1

    payload, _ = dumps(local_fn)
    assert loads(payload, [])(1) == 2
    payload, _ = dumps(operator.add)
    assert len(payload) < 40 and b"operator" in payload  # by reference


def test_unpicklable_argument_names_the_problem() -> None:
    import threading

    with pytest.raises(SerializationError, match="could not pickle"):
        dumps({"lock": threading.Lock()})
