"""DeepSpeed's `OnDevice`: build a module's tensors on a given device (often "meta") and dtype."""

from __future__ import annotations

from types import TracebackType

import torch


class OnDevice:
    """`with OnDevice(dtype=torch.bfloat16, device="meta"): model = Model()`.

    torch's device context puts every factory call on `device`; floating-point tensors made
    inside take `dtype` through the default dtype.
    """

    def __init__(
        self, dtype: torch.dtype, device: str | torch.device = "meta", enabled: bool = True
    ) -> None:
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._device_context: torch.device | None = None
        self._previous_dtype: torch.dtype | None = None

    def __enter__(self) -> None:
        if not self.enabled:
            return
        self._previous_dtype = torch.get_default_dtype()
        if self.dtype is not None and self.dtype.is_floating_point:
            torch.set_default_dtype(self.dtype)
        self._device_context = torch.device(self.device)
        self._device_context.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if not self.enabled or self._device_context is None:
            return
        self._device_context.__exit__(kind, error, trace)
        torch.set_default_dtype(self._previous_dtype)
