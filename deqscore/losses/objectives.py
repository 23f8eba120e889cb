"""Configurable loss objects, chosen in a config by a short name or a ``class_path``.

Each loss is a small object holding its options, callable on a score function and a batch and returning the
per-sample loss ``[B]``. Two kinds, because the networks differ:

* :class:`ScoreLoss` ``loss(score_fn, x)`` for a score ``s(x)`` (density/energy networks, score networks);
* :class:`AnnealedLoss` ``loss(score_fn, x, sigmas)`` for a noise-conditional score ``s(x, sigma)``.

``input_derivatives`` counts the derivatives the loss takes of the score with respect to ``x``: with a score
obtained by autograd from a density, one more passes through the network. A DEQ layer with
``backward="ift"`` is exact only when none does (docs/method.md section 2.5).

A new loss is a subclass registered under a short name::

    @register_loss("my_loss")
    class MyLoss(ScoreLoss):
        def __call__(self, score_fn, x): ...

>>> import torch
>>> loss = build_loss("ssm_vr")
>>> loss
SSMVR(n_projections=1, projection='rademacher')
>>> loss(lambda x: -x, torch.randn(5, 3)).shape
torch.Size([5])
>>> build_loss(DSM(sigma=0.1, weighting="none")).weighting
'none'
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch

from ..errors import ConfigError, check_count, check_real, choice_error
from .annealed import annealed_dsm, annealed_fd_ssm, annealed_ssm_vr
from .score_matching import (
    DSM_WEIGHTINGS,
    PROJECTIONS,
    denoising_score_matching,
    exact_score_matching,
    sliced_score_matching,
)

Tensor = torch.Tensor

_LOSSES: dict[str, type[Loss]] = {}


def register_loss(name: str) -> Callable[[type[Loss]], type[Loss]]:
    """Class decorator: make a loss selectable in configs by ``name``."""

    def add(cls: type[Loss]) -> type[Loss]:
        if name in _LOSSES:
            raise ValueError(f"a loss named {name!r} is already registered")
        cls.name = name
        _LOSSES[name] = cls
        return cls

    return add


def loss_names(*kinds: type[Loss]) -> tuple[str, ...]:
    """Registered short names of the losses that are subclasses of ``kinds`` (all losses without ``kinds``)."""
    return tuple(n for n, cls in _LOSSES.items() if not kinds or issubclass(cls, kinds))


def build_loss(spec: str | Loss, *kinds: type[Loss], key: str = "loss") -> Loss:
    """The loss named ``spec`` (built with its defaults) or ``spec`` itself, if one of ``kinds``; otherwise a
    :class:`~deqscore.errors.ConfigError` naming ``key`` and the accepted names."""
    kinds = kinds or (Loss,)
    if isinstance(spec, str):
        if spec not in loss_names(*kinds):
            raise choice_error(key, spec, loss_names(*kinds))
        return _LOSSES[spec]()
    if not isinstance(spec, kinds):
        accepted = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{key}: a {type(spec).__name__} does not fit here; give a {accepted} "
                          f"(short names: {', '.join(loss_names(*kinds))})", key=key)
    return spec


class Loss:
    """Base of all configurable losses: options are the constructor's arguments, shown by ``repr``."""

    name: ClassVar[str] = ""
    #: derivatives of the score with respect to x that the loss takes
    input_derivatives: ClassVar[int] = 0

    def options(self) -> dict[str, Any]:
        """The constructor arguments with their current values."""
        params = inspect.signature(type(self).__init__).parameters
        return {p: getattr(self, p) for p in params if p != "self"}

    def config(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}``: the config that rebuilds this loss."""
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "init_args": self.options()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options().items())})"


def _check_projections(n_projections: int, projection: str) -> None:
    check_count("n_projections", n_projections)
    if projection not in PROJECTIONS:
        raise choice_error("projection", projection, PROJECTIONS)


class ScoreLoss(Loss):
    """A loss of a score function ``score_fn(x) -> s(x)``: ``loss(score_fn, x) -> [B]``."""

    def __call__(self, score_fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        raise NotImplementedError


@register_loss("exact")
class ExactSM(ScoreLoss):
    """Exact score matching ``0.5 ||s||^2 + tr(grad_x s)`` (D backward passes, batched)."""

    input_derivatives = 1

    def __init__(self) -> None:
        pass

    def __call__(self, score_fn, x):
        return exact_score_matching(score_fn, x)


@register_loss("ssm")
class SSM(ScoreLoss):
    """Sliced score matching ``0.5 (v.s)^2 + v.grad_x(v.s)``, averaged over ``n_projections`` vectors v."""

    input_derivatives = 1

    def __init__(
        self,
        n_projections: int = 1,  # projection vectors per sample
        projection: Literal["rademacher", "gaussian", "sphere"] = "rademacher",  # distribution of v
    ) -> None:
        _check_projections(n_projections, projection)
        self.n_projections, self.projection = n_projections, projection

    def __call__(self, score_fn, x):
        return sliced_score_matching(score_fn, x, self.n_projections, self.projection, variance_reduction=False)


@register_loss("ssm_vr")
class SSMVR(SSM):
    """Sliced score matching with variance reduction ``0.5 ||s||^2 + v.grad_x(v.s)``."""

    def __call__(self, score_fn, x):
        return sliced_score_matching(score_fn, x, self.n_projections, self.projection, variance_reduction=True)


@register_loss("dsm")
class DSM(ScoreLoss):
    """Denoising score matching at one noise level, ``x~ = x + sigma eps``.

    ``weighting`` multiplies the unweighted loss ``0.5 ||s(x~) + eps/sigma||^2`` by 1 (``none``), sigma^2
    (``sigma2``: ``0.5 ||sigma s(x~) + eps||^2``, the usual scale) or sigma^4 (``sigma4``: the paper's reference
    code). With Adam the constant hardly matters; it changes reported values, clipping and SGD steps.
    """

    def __init__(
        self,
        sigma: float = 0.16,  # noise level
        weighting: Literal["none", "sigma2", "sigma4"] = "sigma2",  # power of sigma multiplying the loss
    ) -> None:
        check_real("DSM sigma", sigma)
        if weighting not in DSM_WEIGHTINGS:
            raise choice_error("DSM weighting", weighting, DSM_WEIGHTINGS)
        self.sigma, self.weighting = sigma, weighting

    def __call__(self, score_fn, x):
        return denoising_score_matching(score_fn, x, self.sigma, self.weighting)


class AnnealedLoss(Loss):
    """A loss of a noise-conditional score ``score_fn(x, sigma) -> s``, each sample at a random level of
    ``sigmas``, weighted by sigma^2: ``loss(score_fn, x, sigmas) -> [B]``."""

    def __call__(self, score_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, sigmas: Tensor) -> Tensor:
        raise NotImplementedError


@register_loss("annealed_dsm")
class AnnealedDSM(AnnealedLoss):
    """Annealed denoising score matching ``0.5 ||s(x~, sigma) + eps/sigma||^2 sigma^2``."""

    def __init__(self) -> None:
        pass

    def __call__(self, score_fn, x, sigmas):
        return annealed_dsm(score_fn, x, sigmas)


@register_loss("annealed_ssm_vr")
class AnnealedSSMVR(AnnealedLoss):
    """Annealed SSM-VR ``(0.5 ||s||^2 + v.grad(v.s)) sigma^2`` with Gaussian v."""

    input_derivatives = 1

    def __init__(self, n_projections: int = 1) -> None:  # projection vectors per sample
        _check_projections(n_projections, "gaussian")
        self.n_projections = n_projections

    def __call__(self, score_fn, x, sigmas):
        return annealed_ssm_vr(score_fn, x, sigmas, n_projections=self.n_projections)


@register_loss("annealed_fd_ssm")
class AnnealedFDSSM(AnnealedLoss):
    """Finite-difference SSM-VR: forward evaluations at ``x~ +- v``, ``||v|| = fd_eps``."""

    def __init__(self, fd_eps: float = 0.1) -> None:  # length of the finite-difference step
        check_real("fd_eps", fd_eps)
        self.fd_eps = fd_eps

    def __call__(self, score_fn, x, sigmas):
        return annealed_fd_ssm(score_fn, x, sigmas, fd_eps=self.fd_eps)
