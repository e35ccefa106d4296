"""``from_torch``'s callbacks on the device where JAX's arrays are, on XLA's own buffers.

Where JAX has ``jax.experimental.buffer_callback`` (0.6 on), each callback
hands torch the buffers XLA computes with, through DLPack: on a GPU, CUDA
tensors sharing the arrays' memory, run on XLA's stream
(``torch.cuda.ExternalStream``); on the CPU, CPU tensors sharing it. Torch's
outputs are copied into the output buffers XLA hands the callback, on the
same device (and stream). Where JAX lacks it (0.4.38 to 0.5), the callback
is the core's ``jax.pure_callback`` (``_host.pure_callback``): host arrays in and out.

The host function (``callback.py``'s ``_host_forward`` and friends) is the
same on both paths: it takes DLPack-able inputs and returns its outputs
through ``callback.py``'s ``_to_numpy``, which asks ``keeps_tensors`` here
whether they leave as NumPy arrays (for ``pure_callback``) or stay torch
tensors (to be written into XLA's buffers).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

from .._host import pure_callback
from .._jax_internals import buffer_callback_api

__all__ = ["as_output", "host_callbacks", "keeps_tensors", "torch_callback"]

_DLPACK_GPUS = (2, 10)  # DLPack's device types kDLCUDA and kDLROCM


class _State(threading.local):
    tensors = False  # inside a buffer callback: torch's outputs stay tensors
    host_only = False  # while tracing: pure_callback even where buffer_callback exists


_state = _State()


def keeps_tensors() -> bool:
    """Whether the running callback writes torch's outputs into XLA's buffers (else they leave as NumPy)."""
    return _state.tensors


@contextlib.contextmanager
def host_callbacks() -> Iterator[None]:
    """Calls traced inside take ``jax.pure_callback``'s path, host arrays in and out (benchmarks, tests)."""
    before, _state.host_only = _state.host_only, True
    try:
        yield
    finally:
        _state.host_only = before


def torch_callback(torch: Any, host: Callable, out_struct: Sequence[Any], *arrays: Any, vmap_method: str) -> Any:
    """``host(*inputs)``'s outputs (one per ``out_struct``), computed where the arrays are.

    ``host`` takes one DLPack-able input per array (a buffer or a NumPy
    array) and returns one output per ``out_struct`` entry (``None`` for
    zeros).
    """
    buffer_callback = buffer_callback_api()
    if buffer_callback is None or _state.host_only:
        return pure_callback(host, out_struct, *arrays, vmap_method=vmap_method)

    def on_buffers(ctx: Any, outs: Sequence[Any], *buffers: Any) -> None:
        with _on_xla_stream(torch, ctx, [*buffers, *outs]):
            before, _state.tensors = _state.tensors, True
            try:
                results = host(*buffers)
            finally:
                _state.tensors = before
            with torch.no_grad():
                for out, result in zip(outs, results, strict=True):
                    _write(torch, out, result)

    return buffer_callback(on_buffers, list(out_struct), vmap_method=vmap_method)(*arrays)


def _on_xla_stream(torch: Any, ctx: Any, buffers: Sequence[Any]) -> Any:
    """On a GPU: torch's current device and stream are the buffers' device and XLA's stream."""
    device = next((b.__dlpack_device__() for b in buffers), None)
    if device is None or device[0] not in _DLPACK_GPUS:
        return contextlib.nullcontext()  # the CPU: XLA's thread, nothing to order
    stream = torch.cuda.ExternalStream(ctx.stream, device=torch.device("cuda", device[1]))
    return torch.cuda.stream(stream)


def _write(torch: Any, out: Any, result: Any) -> None:
    """Torch's output into XLA's output buffer, on its device: a copy, converting dtype and broadcasting."""
    target = torch.from_dlpack(out)
    if result is None:  # an absent gradient: zeros
        target.zero_()
        return
    if result.is_conj() or result.is_neg():  # lazy conjugation: the values written out
        result = result.resolve_conj().resolve_neg()
    target.copy_(result)


def as_output(t: Any) -> Any:
    """A torch output as the callback hands it to ``_write``: detached; ``None`` (zeros) kept."""
    return t.detach() if t is not None and t.requires_grad else t
