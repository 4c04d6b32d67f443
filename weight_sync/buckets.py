"""Buckets of named tensors and SGLang's ``flattened_bucket`` wire format. Pure functions over tensors.

``flattened_bucket`` (SGLang ``weight_sync/tensor_bucket.py``), which both sides must agree on byte for byte:
the tensors in ``names`` order, each ``t.flatten().view(torch.uint8)``, concatenated with no padding. The
receiver allocates one uint8 buffer of the total size and cuts it back into views; a tensor whose byte offset
is not a multiple of its dtype's itemsize cannot be viewed and is refused ("Unaligned received tensor"). The
packer here therefore starts a new bucket rather than produce a misaligned offset (mixed dtypes only).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: SGLang resolves dtypes with ``getattr(torch, s)``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, field_name: str = "dtypes") -> torch.dtype:
    """The inverse of ``dtype_name``; a clear error names the field and the value."""
    value = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("torch.") else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{field_name}: {name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return value


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver needs to allocate one tensor: HF name, dtype, full (unsharded) shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, tensor.dtype, tuple(tensor.shape))


@dataclass
class Bucket:
    """Named tensors sent together: one HTTP update call and one broadcast (or one per tensor)."""

    metas: list[TensorMeta] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    # The packed payload once packed (then ``tensors`` may be dropped), and the pooled buffer it is a view of.
    flat: torch.Tensor | None = None
    storage: torch.Tensor | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        meta = TensorMeta.of(name, tensor)
        self.metas.append(meta)
        self.tensors.append(tensor)
        self.nbytes += meta.nbytes

    def __len__(self) -> int:
        return len(self.metas)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(m.dtype) for m in self.metas]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(m.shape) for m in self.metas]

    def flatten(self) -> torch.Tensor:
        """The ``flattened_bucket`` payload: uint8 ``[nbytes]`` on the tensors' device."""
        return flatten_tensors(self.tensors)


def fits(bucket: Bucket, meta: TensorMeta, bucket_bytes: int) -> bool:
    """Whether ``meta`` may join ``bucket``: within the size budget and at an aligned byte offset.

    An empty bucket takes any tensor, so a tensor larger than the budget travels alone.
    """
    if not bucket.metas:
        return True
    aligned = bucket.nbytes % meta.dtype.itemsize == 0
    return aligned and bucket.nbytes + meta.nbytes <= bucket_bytes


class BucketBuilder:
    """Packs ``(name, tensor)`` pairs, in order, into buckets of at most ``bucket_bytes`` (a lone tensor may
    exceed it). Incremental, so tensors can be gathered lazily and a full bucket shipped while the next fills."""

    def __init__(self, bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes = {bucket_bytes} must be positive")
        self.bucket_bytes = bucket_bytes
        self._current = Bucket()

    def add(self, name: str, tensor: torch.Tensor) -> Bucket | None:
        """Add one tensor; returns the previous bucket when this tensor did not fit in it."""
        done = None
        if not fits(self._current, TensorMeta.of(name, tensor), self.bucket_bytes):
            done, self._current = self._current, Bucket()
        self._current.add(name, tensor)
        return done

    def flush(self) -> Bucket | None:
        """The last, partly filled bucket (None when empty)."""
        done, self._current = self._current, Bucket()
        return done if done.metas else None


def make_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """All buckets at once (tests, small models)."""
    builder = BucketBuilder(bucket_bytes)
    buckets = [b for name, t in named if (b := builder.add(name, t)) is not None]
    last = builder.flush()
    return buckets + ([last] if last else [])


def flatten_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``cat([t.flatten().view(uint8) for t in tensors])``: uint8 ``[sum of nbytes]``, no padding."""
    if not tensors:
        raise ValueError("Cannot create empty tensor bucket")
    return torch.cat([t.detach().flatten().view(torch.uint8) for t in tensors])


def flatten_into(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``flatten_tensors`` written into the front of a reusable uint8 buffer; returns the filled view."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if out.dtype != torch.uint8 or out.numel() < nbytes:
        raise ValueError(
            f"pack buffer: need uint8 of at least {nbytes} bytes, got {out.dtype} [{out.numel()}]"
        )
    view = out[:nbytes]
    torch.cat([t.detach().flatten().view(torch.uint8) for t in tensors], out=view)
    return view


def layout(metas: Sequence[TensorMeta]) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of each tensor in the flat buffer; raises on a misaligned offset."""
    ranges, offset = [], 0
    for meta in metas:
        if any(dim < 0 for dim in meta.shape):
            raise ValueError(f"Negative dimension in received tensor {meta.name}: {list(meta.shape)}")
        if offset % meta.dtype.itemsize:
            raise ValueError(
                f"Unaligned received tensor {meta.name}: byte offset {offset}, dtype {meta.dtype}"
            )
        ranges.append((offset, offset + meta.nbytes))
        offset += meta.nbytes
    return ranges


def empty_flat(metas: Sequence[TensorMeta], device: torch.device | str = "cpu") -> torch.Tensor:
    """The receive buffer for a flattened bucket: uint8 ``[total bytes]`` (checks alignment first)."""
    if not metas:
        raise ValueError("Cannot create empty tensor bucket")
    ranges = layout(metas)
    return torch.empty(ranges[-1][1], dtype=torch.uint8, device=device)


def unflatten(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Cut a flattened bucket back into named tensors (views of ``flat``, no copy)."""
    ranges = layout(metas)
    total = ranges[-1][1] if ranges else 0
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flattened bucket: expected uint8 [{total}], got {flat.dtype} {list(flat.shape)}")
    return [
        (m.name, flat[start:end].view(m.dtype).reshape(m.shape))
        for m, (start, end) in zip(metas, ranges, strict=True)
    ]


def metas_from_request(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[TensorMeta]:
    """Validate the three parallel lists of an update request into ``TensorMeta``s."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"names, dtypes, shapes must have equal lengths, got {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    metas = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"names[{i}] = {name!r} must be a non-empty string")
        if not isinstance(shape, list | tuple) or not all(isinstance(d, int) for d in shape):
            raise ValueError(f"shapes[{i}] = {shape!r} must be a list of ints")
        metas.append(TensorMeta(name, parse_dtype(dtype, f"dtypes[{i}]"), tuple(shape)))
    return metas
