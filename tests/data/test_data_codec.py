"""ImageCodec: model space back to images, bits/dim, and its plain-dict form for checkpoints."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import pytest
import torch

from deqscore.data import TRANSFORMS, ImageCodec, preprocess

SHAPE = (1, 16, 16)  # 256 pixels: one of each 8-bit value per image


def _images(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` uint8 images of SHAPE, each a random permutation of all 256 pixel values."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(256, generator=g) for _ in range(n)]).to(torch.uint8).reshape(n, *SHAPE)


def _round_trip(transform: str, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels k as float64 [B, *SHAPE], to_images(preprocess(k)) as float64)."""
    images = _images(64)
    codec = ImageCodec(transform, alpha, SHAPE)
    x = preprocess(images.reshape(64, -1), transform, alpha, torch.Generator().manual_seed(1))
    decoded = codec.to_images(x)
    assert decoded.shape == (64, *SHAPE)
    return images.double(), decoded.double()


@pytest.mark.parametrize(("transform", "alpha"), [("logit", 1e-3), ("unit", 1e-3), ("unit", 0.0)])
def test_clamp_pipelines_decode_within_half_a_level(transform, alpha):
    pixels, decoded = _round_trip(transform, alpha)
    # x = k/255 + (U - 0.5)/256 (clamped towards k): |255 x - k| <= 255/512 < 0.5, so rounding recovers k
    assert (decoded * 255 - pixels).abs().max() <= 255 / 512 + 1e-4
    assert torch.equal(torch.round(decoded * 255), pixels)
    assert decoded.min() >= 0 and decoded.max() <= 1


@pytest.mark.parametrize("alpha", [1e-3, 0.05])
def test_squeeze_pipeline_decodes_into_the_pixel_bin(alpha):
    pixels, decoded = _round_trip("logit_squeeze", alpha)
    offset = decoded * 256 - pixels  # (k + U)/256 * 256 - k = U: inside the bin [k/256, (k+1)/256)
    assert offset.min() >= -1e-4 and offset.max() <= 1 + 1e-4
    assert (decoded * 255 - pixels).abs().max() <= 1 + 1e-4
    # the decoded noise is the uniform dequantisation noise, not a constant (std of U(0, 1) is 0.2887)
    assert offset.std().item() == pytest.approx(1 / math.sqrt(12), abs=0.01)


def test_to_images_clamps_and_checks_shapes():
    codec = ImageCodec("logit_squeeze", 0.05, SHAPE)
    extreme = torch.tensor([[-50.0] * 256, [50.0] * 256])  # beyond the squeezed range on both sides
    images = codec.to_images(extreme)
    assert images.shape == (2, *SHAPE)
    assert torch.equal(images[0], torch.zeros(SHAPE)) and torch.equal(images[1], torch.ones(SHAPE))
    assert codec.to_images(torch.zeros(3, 16, 16)).shape == (3, *SHAPE)  # any [B, ...] with 256 values each
    for bad in (torch.zeros(256), torch.zeros(2, 255)):
        with pytest.raises(ValueError, match="256 values per sample"):
            codec.to_images(bad)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_dict_round_trip_is_plain_python(transform):
    codec = ImageCodec(transform, 0.01, SHAPE)
    d = codec.as_dict()
    assert d == {"transform": transform, "alpha": 0.01, "image_shape": [1, 16, 16]}
    assert ImageCodec.from_dict(d) == codec
    assert ImageCodec.from_dict(json.loads(json.dumps(d))) == codec
    # a checkpoint loaded with weights_only=True accepts only plain types
    buffer = io.BytesIO()
    torch.save({"codec": d}, buffer)
    buffer.seek(0)
    assert ImageCodec.from_dict(torch.load(buffer, weights_only=True)["codec"]) == codec


def test_fields_are_normalised_and_frozen():
    codec = ImageCodec("unit", 0, [3, 4, 4])  # as a YAML or JSON file would give them
    assert codec.image_shape == (3, 4, 4) and codec.dim == 48
    assert type(codec.alpha) is float and codec == ImageCodec("unit", 0.0, (3, 4, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.alpha = 0.1


def test_unknown_transform_names_the_accepted_ones():
    d = ImageCodec("logit", 1e-3, SHAPE).as_dict() | {"transform": "gaussian"}
    with pytest.raises(ValueError) as info:
        ImageCodec.from_dict(d)
    assert str(info.value) == "unknown transform 'gaussian'; choose one of 'logit', 'unit', 'logit_squeeze', 'pixels'"


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"alpha": 0.0}, r"alpha must lie in \(0, 0.5\) for transform 'logit'"),
        ({"alpha": 0.5}, "alpha must lie in"),
        ({"image_shape": []}, "image_shape"),
        ({"image_shape": [1, 0, 4]}, "image_shape"),
        ({"extra": 1}, r"unknown \['extra'\]"),
    ],
)
def test_from_dict_rejects_invalid_dicts(changes, match):
    d = ImageCodec("logit", 1e-3, SHAPE).as_dict() | changes
    with pytest.raises(ValueError, match=match):
        ImageCodec.from_dict(d)
    del d["alpha"]
    with pytest.raises(ValueError, match=r"missing \['alpha'\]"):
        ImageCodec.from_dict(d)


def test_only_the_squeeze_gives_exact_bits_per_dim():
    assert {t: ImageCodec(t, 1e-3, SHAPE).exact_bits_per_dim for t in TRANSFORMS} == {
        "logit": False,
        "unit": False,
        "logit_squeeze": True,
        "pixels": False,
    }


def test_pixels_are_k_over_255_without_noise_and_have_no_bits_per_dim():
    images = _images(3).reshape(3, -1)
    codec = ImageCodec("pixels", 0.0, SHAPE)
    x = preprocess(images, "pixels", 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(x, images.float() / 255) and torch.equal(preprocess(images, "pixels"), x)  # no noise drawn
    assert torch.equal(codec.to_images(x), (images.float() / 255).reshape(3, *SHAPE))
    with pytest.raises(ValueError, match="discrete"):
        codec.bits_per_dim(torch.zeros(3), x)


def test_bits_per_dim_of_the_uniform_density_is_eight():
    alpha = 0.01
    codec = ImageCodec("logit_squeeze", alpha, SHAPE)
    y = preprocess(_images(4).reshape(4, -1), codec.transform, alpha).double()
    x = torch.sigmoid(y)
    # log-density of y when x~ = (x - alpha)/(1 - 2 alpha) is uniform on the unit cube
    log_prob = (torch.log(x) + torch.log1p(-x)).sum(dim=1) - 256 * math.log1p(-2 * alpha)
    assert torch.allclose(codec.bits_per_dim(log_prob, y), torch.full((4,), 8.0, dtype=torch.float64), atol=1e-6)
    unit = ImageCodec("unit", 0.0, SHAPE)
    assert unit.bits_per_dim(torch.zeros(2), torch.rand(2, 256)).tolist() == pytest.approx([8.0, 8.0])
    # a density twice as high everywhere is 1/D bits per dimension better
    assert unit.bits_per_dim(torch.full((1,), math.log(2)), torch.rand(1, 256)).item() == pytest.approx(8 - 1 / 256)
