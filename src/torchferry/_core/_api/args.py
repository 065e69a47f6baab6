"""Checks of the public entries' arguments: a wrong value is refused in one torchferry line.

Without them a wrong type reached torch or Python deep inside and came back in
their words (``'str' object has no attribute 'device'``, torch's list of
device types; found by trying the API as a new user would). Each check raises
before anything is touched, so the caller's state is intact. Lowest layer:
imports torch only.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["check_bool", "check_bytes", "check_callable", "check_device", "check_optional_bool", "check_stream",
           "shown"]


def shown(value: object) -> str:
    """``value`` for a one-line message: its type (a NumPy scalar's as ``numpy.bool``, not ``bool``), and its
    repr when short and simple (a number, a string, a NumPy scalar)."""
    numpy_scalar = _is_numpy_scalar(value)
    kind = f"numpy.{type(value).__name__}" if numpy_scalar else type(value).__name__
    if isinstance(value, (str, bytes, int, float, complex, type(None))) or numpy_scalar:
        text = repr(value)
        return f"{kind} {text}" if len(text) <= 60 else kind
    return kind


def _is_numpy_scalar(value: object) -> bool:
    numpy = sys.modules.get("numpy")  # imported by whoever made a NumPy value
    return numpy is not None and isinstance(value, numpy.generic)


def _one_cpu(device: torch.device | None, what: str, accepted: str) -> torch.device | None:
    """``cpu:0`` as ``cpu`` (what CPU tensors report); another CPU index refused: there is one host."""
    if device is None or device.type != "cpu" or device.index is None:
        return device
    if device.index != 0:
        raise ValueError(f"torchferry: {what}: {str(device)!r} is not a device (the host is 'cpu'); "
                         f"accepted: {accepted}")
    return torch.device("cpu")


def check_device(device: object, what: str, accepted: str | None = None) -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` kept).

    Args:
        device: a ``torch.device``, a device string or index as ``torch.device`` takes it, or ``None``.
        what: where it was given, for the message (``"Ferry(device=...)"``).
        accepted: what the message says is accepted (default: what ``Ferry(device=...)`` takes).

    Raises:
        TypeError: not a ``torch.device``, str, int or ``None``.
        ValueError: a string or index ``torch.device`` does not accept (``"gpu"``), or a CPU index other than 0
            (``"cpu:0"`` is taken as ``"cpu"``).
    """
    accepted = accepted or "'cpu', 'cuda', 'cuda:N', a torch.device, or None (inferred from the tensors)"
    if device is None or isinstance(device, torch.device):
        return _one_cpu(device, what, accepted)
    if not isinstance(device, (str, int)) or isinstance(device, bool):
        raise TypeError(f"torchferry: {what} takes {accepted}; got {shown(device)}")
    try:
        return _one_cpu(torch.device(device), what, accepted)
    except RuntimeError:
        if isinstance(device, int) and device < 0:
            raise ValueError(f"torchferry: {what}: device index {device} is negative; accepted: {accepted}") from None
        if isinstance(device, int):  # torch.device(0) is the accelerator's device 0
            raise ValueError(f"torchferry: {what}: device index {device} needs an accelerator, and none is "
                             f"available; accepted: {accepted}") from None
        raise ValueError(f"torchferry: {what}: {device!r} is not a device; accepted: {accepted}") from None


def check_bytes(value: object, what: str) -> None:
    """Refuses a byte count that is not an int >= 0 or ``None``.

    Raises:
        ValueError: a negative number, a float, a bool, a string.
    """
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"torchferry: {what} must be an int >= 0 (bytes) or None, got {shown(value)}")


def check_bool(value: object, what: str) -> None:
    """Refuses a flag that is not ``True`` or ``False`` (``"no"`` is truthy: refuse rather than guess).

    Raises:
        TypeError: anything but a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"torchferry: {what} must be True or False, got {shown(value)}")


def check_optional_bool(value: object, what: str) -> None:
    """Refuses a setting that is not ``True``, ``False`` or ``None`` (``None``: the default or environment).

    Raises:
        TypeError: anything else.
    """
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"torchferry: {what} must be True, False or None, got {shown(value)}")


def check_callable(value: object, what: str) -> None:
    """Refuses a callback that cannot be called (it would fail later, far from the mistake).

    Raises:
        TypeError: ``value`` is not callable.
    """
    if not callable(value):
        raise TypeError(f"torchferry: {what} must be callable, got {shown(value)}")


def check_stream(value: object, what: str) -> None:
    """Refuses what is not a stream (``torch.cuda.Stream`` and ``torch.Stream`` are).

    Raises:
        TypeError: ``value`` is not a stream.
    """
    if not isinstance(value, (torch.Stream, torch.cuda.Stream)):  # a CPU build's cuda.Stream is no torch.Stream
        raise TypeError(f"torchferry: {what} must be a torch.cuda.Stream, got {shown(value)}")
