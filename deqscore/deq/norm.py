"""Weight normalisations that make a fixed-point map contractive.

* :func:`frobenius_scale` / :class:`FrobeniusScale`: ``W / (c * (||W||_F + eps))``; the norm bounds the
  spectral norm of a dense ``W``, so with a 1-Lipschitz activation the map is ``1/c``-Lipschitz. The norm
  may be differentiated or treated as a constant (``grad_through_norm``), as the reference models differ.
* :func:`spectral_normalize`: divides a Linear or Conv weight by its largest singular value, estimated by
  power iteration. For a convolution with a known ``input_shape`` the operator norm of the convolution itself
  is estimated (not the norm of the reshaped kernel).

>>> import torch
>>> from torch import nn
>>> lin = nn.Linear(8, 8)
>>> _ = spectral_normalize(lin, n_power_iterations=50)
>>> bool(abs(torch.linalg.matrix_norm(lin.weight, ord=2) - 1.0) < 1e-3)
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize


def frobenius_scale(
    weight: torch.Tensor, c: float = 1.0, eps: float = 1e-6, grad_through_norm: bool = True
) -> torch.Tensor:
    """Return ``weight / (c * (||weight||_F + eps))``."""
    norm = weight.norm()
    if not grad_through_norm:
        norm = norm.detach()
    return weight / (c * (norm + eps))


class FrobeniusScale(nn.Module):
    """Parametrisation applying :func:`frobenius_scale`; register with ``torch.nn.utils.parametrize``."""

    def __init__(self, c: float = 1.0, eps: float = 1e-6, grad_through_norm: bool = True):
        super().__init__()
        self.c, self.eps, self.grad_through_norm = c, eps, grad_through_norm

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return frobenius_scale(weight, self.c, self.eps, self.grad_through_norm)


class _SpectralScale(nn.Module):
    """Power-iteration spectral normalisation of a Linear weight or a stride/padding-aware convolution."""

    def __init__(self, weight: torch.Tensor, n_power_iterations: int, eps: float, conv: dict | None):
        super().__init__()
        self.n_power_iterations, self.eps, self.conv = n_power_iterations, eps, conv
        # the vector lives in the operator's input space: in*k*k for a kernel read as a matrix [out, in*k*k]
        shape = (weight[0].numel(),) if conv is None else (int(torch.tensor(conv["input_shape"]).prod()),)
        v = F.normalize(torch.randn(shape, dtype=weight.dtype, device=weight.device), dim=0)
        self.register_buffer("v", v)
        self._power_iterate(weight.reshape(weight.shape[0], -1) if conv is None else weight, 15)

    def _op(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.conv is None:
            return w @ x
        c = self.conv
        y = F.conv2d(x.view(1, *c["input_shape"]), w, None, c["stride"], c["padding"], c["dilation"])
        return y.flatten()

    def _op_t(self, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.conv is None:
            return w.t() @ y
        x = torch.zeros(1, *self.conv["input_shape"], dtype=w.dtype, device=w.device, requires_grad=True)
        with torch.enable_grad():
            out = self._op(w.detach(), x)
            (g,) = torch.autograd.grad(out, x, y)
        return g.flatten()

    @torch.no_grad()
    def _power_iterate(self, w: torch.Tensor, n: int) -> None:
        v = self.v
        for _ in range(n):
            u = F.normalize(self._op(w, v), dim=0, eps=self.eps)
            v = F.normalize(self._op_t(w, u), dim=0, eps=self.eps)
        self.v.copy_(v)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        w = weight.reshape(weight.shape[0], -1) if self.conv is None else weight
        if self.training:  # eval mode reuses the stored vector, so it computes a fixed function
            self._power_iterate(w, self.n_power_iterations)
        # a copy: the buffer is updated in place at the next read of the weight (a DEQ reads it many times
        # within one graph), which must not invalidate tensors saved for backward
        v = self.v.clone()
        sigma = torch.dot(F.normalize(self._op(w, v).detach(), dim=0, eps=self.eps), self._op(w, v))
        return weight / sigma.clamp_min(self.eps)


def spectral_normalize(
    module: nn.Module,
    n_power_iterations: int = 1,
    input_shape: tuple[int, int, int] | None = None,
    eps: float = 1e-12,
) -> nn.Module:
    """Parametrise ``module.weight`` (Linear or Conv2d) to spectral norm 1; for a convolution, ``input_shape=(C, H, W)``
    normalises its true operator norm (else the reshaped kernel's, a heuristic). The power-iteration vector persists
    across calls, so one iteration per forward converges during training."""
    if not isinstance(module, nn.Linear | nn.Conv2d):
        raise TypeError(f"spectral_normalize supports nn.Linear and nn.Conv2d, got {type(module).__name__}")
    conv = None
    if isinstance(module, nn.Conv2d) and input_shape is not None:
        if isinstance(module.padding, str):
            raise ValueError("spectral_normalize needs numeric padding on Conv2d")
        conv = {
            "input_shape": tuple(input_shape),
            "stride": module.stride,
            "padding": module.padding,
            "dilation": module.dilation,
        }
    parametrize.register_parametrization(
        module, "weight", _SpectralScale(module.weight.detach(), n_power_iterations, eps, conv)
    )
    return module


class SpectralCap(nn.Module):
    """Parametrisation ``W * min(1, bound / ||W||_2)`` with the exact spectral norm (a singular value
    decomposition per call: for the small dense matrices of studies, where a power-iteration estimate's error
    would blur the bound being studied). Below the bound the weight is untouched; above it, scaled onto it."""

    def __init__(self, bound: float):
        super().__init__()
        if not bound > 0:
            raise ValueError(f"a spectral bound must be positive, got {bound}")
        self.bound = bound

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.matrix_norm(weight, ord=2)
        return weight * torch.clamp(self.bound / norm.clamp_min(1e-30), max=1.0)


def spectral_cap(module: nn.Linear, bound: float) -> nn.Linear:
    """Parametrise ``module.weight`` (a Linear) to have spectral norm at most ``bound`` (:class:`SpectralCap`).
    With a 1-Lipschitz activation, a fixed-point map ``act(W z + u)`` with ``bound < 1`` is then a contraction.

    >>> lin = spectral_cap(nn.Linear(6, 6), 0.5)
    >>> with torch.no_grad():
    ...     _ = lin.parametrizations.weight.original.mul_(100.0)
    >>> round(float(torch.linalg.matrix_norm(lin.weight, ord=2)), 6)
    0.5
    """
    if not isinstance(module, nn.Linear):
        raise TypeError(f"spectral_cap supports nn.Linear, got {type(module).__name__}")
    parametrize.register_parametrization(module, "weight", SpectralCap(bound))
    return module
