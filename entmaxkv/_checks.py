"""Argument checks shared by the public functions and the command line.

One module decides what counts as a number, so that every entry point
accepts and rejects the same values:

- Python ints and floats and NumPy scalars (``np.int64``, ``np.float32``,
  ...) are numbers. ``bool`` (and ``np.bool_``) never is, although Python
  lets ``True`` stand for 1.
- An int argument takes integral types only: ``1024.0`` is not an int.
- A tensor is not accepted where a Python number is expected, not even a
  0-d one: reading a CUDA tensor's value on the host is a synchronisation
  that the decode step promises not to make. Pass ``t.item()``.
- NaN never passes, and neither does inf unless ``finite=False``.

Every failure is a ValueError whose message starts with the argument's name
and says what was expected, e.g. ``budget: expected an int >= 1, got 0``.
The ``*_flag`` factories turn the same rules into ``argparse`` types (their
errors are reported by argparse as ``argument --flag: expected ...``).
"""
from __future__ import annotations

import argparse
import math
import numbers
from typing import Any, Callable, Iterable, Optional, Tuple

import torch

__all__ = [
    "as_bool", "as_choice", "as_device", "as_ids", "as_dim", "as_dtype", "as_float", "as_float_tensor", "as_int",
    "check_reduced_shape", "describe", "is_int", "is_number",
    "device_flag", "float_flag", "int_flag",
]


def describe(value: Any) -> str:
    """A short description of ``value`` for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_bool(value: Any) -> bool:
    # np.bool_ is not registered with the numbers ABCs, but say so explicitly:
    # a flag must never pass as 0 or 1.
    t = type(value)
    return isinstance(value, bool) or (t.__module__ == "numpy" and t.__name__ in ("bool_", "bool"))


def is_number(value: Any) -> bool:
    """True for Python and NumPy real numbers, False for bool and tensors."""
    return isinstance(value, numbers.Real) and not _is_bool(value) and not isinstance(value, torch.Tensor)


def is_int(value: Any) -> bool:
    """True for Python and NumPy integers, False for bool."""
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _fmt(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {_fmt(lo)}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {_fmt(hi)}"
    return ""


def _in_range(x, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    if lo is not None and (x <= lo if lo_open else x < lo):
        return False
    if hi is not None and (x >= hi if hi_open else x > hi):
        return False
    return True


def _tensor_hint(value: Any) -> str:
    return " (pass a Python number, e.g. t.item())" if isinstance(value, torch.Tensor) else ""


def _int_problem(value: Any, lo, hi) -> Tuple[Optional[int], str]:
    """(the int, "") or (None, what was expected)."""
    want = f"an int{_range_text(lo, hi, False, False)}"
    if is_int(value):
        v = int(value)
        if _in_range(v, lo, hi, False, False):
            return v, ""
    return None, want


def as_int(value: Any, name: str, *, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """``value`` as a Python int in [lo, hi] (either bound optional), else ValueError."""
    v, want = _int_problem(value, lo, hi)
    if v is None:
        raise ValueError(f"{name}: expected {want}, got {describe(value)}{_tensor_hint(value)}")
    return v


def _float_problem(value: Any, lo, hi, lo_open, hi_open, finite) -> Tuple[Optional[float], str]:
    kind = "a finite number" if finite else "a number"
    want = kind + _range_text(lo, hi, lo_open, hi_open)
    if is_number(value):
        v = float(value)
        ok = not math.isnan(v) and not (finite and math.isinf(v)) and _in_range(v, lo, hi, lo_open, hi_open)
        if ok:
            return v, ""
    return None, want


def as_float(
    value: Any,
    name: str,
    *,
    lo: Optional[float] = None,
    hi: Optional[float] = None,
    lo_open: bool = False,
    hi_open: bool = False,
    finite: bool = True,
) -> float:
    """``value`` as a Python float, else ValueError.

    ``lo``/``hi`` bound it (closed unless ``lo_open``/``hi_open``); NaN is
    always rejected, inf unless ``finite=False``.
    """
    v, want = _float_problem(value, lo, hi, lo_open, hi_open, finite)
    if v is None:
        raise ValueError(f"{name}: expected {want}, got {describe(value)}{_tensor_hint(value)}")
    return v


def as_bool(value: Any, name: str) -> bool:
    """``value`` (a bool or np.bool_) as a Python bool; 0/1, strings and None are refused."""
    if not _is_bool(value):
        raise ValueError(f"{name}: expected True or False, got {describe(value)}")
    return bool(value)


def as_choice(value: Any, name: str, choices: Iterable) -> Any:
    """``value`` itself when it is one of ``choices``, else ValueError listing them."""
    choices = tuple(choices)
    if not isinstance(value, (str, int)) or isinstance(value, bool) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}: expected one of {listed}, got {describe(value)}")
    return value


def as_dtype(value: Any, name: str, choices: Iterable[torch.dtype]) -> torch.dtype:
    """``value`` when it is one of the torch dtypes ``choices``, else ValueError."""
    choices = tuple(choices)
    if not isinstance(value, torch.dtype) or value not in choices:
        listed = ", ".join(str(c) for c in choices)
        raise ValueError(f"{name}: expected one of {listed}, got {describe(value)}")
    return value


def as_device(value: Any, name: str) -> torch.device:
    """A usable CPU or CUDA device from a ``torch.device`` or a string ("cpu",
    "cuda", "cuda:1"); ValueError for anything else, and for CUDA when this
    build or machine has none (or fewer devices than the index asks for)."""
    try:
        dev = value if isinstance(value, torch.device) else torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name}: expected 'cpu', 'cuda' or 'cuda:N', got {describe(value)}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a cpu or cuda device, got {describe(value)}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: {describe(value)} requested but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{name}: {describe(value)} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return dev


def as_float_tensor(value: Any, name: str, *, min_dim: int = 0) -> torch.Tensor:
    """``value`` when it is a floating-point tensor with at least ``min_dim``
    dimensions, else ValueError. Only the shape and dtype are read (works on
    meta tensors, never synchronises)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() < min_dim:
        what = "a floating-point tensor" + (f" with at least {min_dim} dimension(s)" if min_dim else "")
        raise ValueError(f"{name}: expected {what}, got {describe(value)}")
    return value


def as_dim(value: Any, name: str, ndim: int) -> int:
    """``value`` as a dimension index of a tensor with ``ndim`` dimensions
    (negative counts from the end), else ValueError."""
    if not is_int(value) or not -ndim <= int(value) < ndim:
        raise ValueError(f"{name}: expected an int in [{-ndim}, {ndim - 1}] (a dimension of the "
                         f"{ndim}-d input), got {describe(value)}")
    return int(value)


def check_reduced_shape(value: Any, name: str, x: torch.Tensor, dim: int, xname: str = "x") -> torch.Tensor:
    """``value`` when it is a tensor of ``x``'s shape with ``dim`` removed (the
    shape of a per-row threshold), else ValueError."""
    want = tuple(s for i, s in enumerate(x.shape) if i != dim % x.dim())
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
        raise ValueError(f"{name}: expected a tensor of shape {want} ({xname}'s shape without dim {dim}), "
                         f"got {describe(value)}")
    return value


# ------------------------------------------------------------ argparse types
def as_ids(value: Any, name: str, want: str) -> Optional[Tuple[int, ...]]:
    """Row / slot ids: a sequence of ints (list, tuple, 1-d NumPy array) or
    a 1-d int32/int64 tensor, as a tuple of Python ints; None for a tensor on
    a GPU (reading it would synchronise). ``want`` says what was expected in
    the error (ValueError naming ``name``)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected {want}, got shape {tuple(value.shape)} dtype {value.dtype}")
        return tuple(value.tolist()) if value.device.type == "cpu" else None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
        raise ValueError(f"{name}: expected {want}, got {describe(value)}")
    if getattr(value, "ndim", 1) != 1:
        raise ValueError(f"{name}: expected {want}, got an array of shape {value.shape}")
    out = []
    for i, s in enumerate(value):
        if not is_int(s):
            raise ValueError(f"{name}: expected {want}, got {describe(s)} at position {i}")
        out.append(int(s))
    return tuple(out)


def int_flag(lo: Optional[int] = None, hi: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type`` parsing an int in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = text
        v, want = _int_problem(value, lo, hi)
        if v is None:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return v

    parse.__name__ = "int"
    return parse


def float_flag(
    lo: Optional[float] = None,
    hi: Optional[float] = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Callable[[str], float]:
    """An argparse ``type`` parsing a finite float within the bounds."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = text
        v, want = _float_problem(value, lo, hi, lo_open, hi_open, True)
        if v is None:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return v

    parse.__name__ = "float"
    return parse


def device_flag(text: str) -> str:
    """An argparse ``type`` for --device: the text, once ``as_device`` accepts it."""
    try:
        as_device(text, "device")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None
    return text
