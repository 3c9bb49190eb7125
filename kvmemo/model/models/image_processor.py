"""Image inputs: load (PIL image, path, bytes, data URL), preprocess as the checkpoint's
preprocessor_config.json says (CLIP style), and hash the processed pixels.

Invariant: one picture gives one content hash however it arrived (PNG bytes, a file, a PIL
object), because the hash covers the processed pixels plus the processor settings, never the
encoded bytes. Needs Pillow and numpy only (no torch, no torchvision).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

# Refuse pictures bigger than this before decoding them: PIL's own guard fires only at ~179 MP.
MAX_IMAGE_PIXELS = 64_000_000
MAX_IMAGE_BYTES = 32 * 2**20
# PIL resample filters by the integer HF writes into preprocessor_config.json.
_RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """CLIPImageProcessor settings: convert to RGB, resize the shortest edge, center crop,
    rescale, normalise. Every field joins the content hash."""

    shortest_edge: int = 224  # resize so the shorter side has this many pixels (aspect kept)
    crop_height: int = 224
    crop_width: int = 224
    resample: int = 3  # PIL filter id (3 = bicubic)
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD

    def __post_init__(self) -> None:
        if self.resample not in _RESAMPLE_NAMES:
            raise ValueError(
                f"resample must be one of {sorted(_RESAMPLE_NAMES)}, got {self.resample!r}"
            )
        for name in ("shortest_edge", "crop_height", "crop_width"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std must have 3 values (RGB)")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessorConfig:
        """From a preprocessor_config.json dict (HF CLIPImageProcessor keys)."""
        size = raw.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if "shortest_edge" not in size:
            raise ValueError(
                f"preprocessor_config.json size must give shortest_edge (CLIP style), got {size!r}"
            )
        crop = raw.get(
            "crop_size", {"height": size["shortest_edge"], "width": size["shortest_edge"]}
        )
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=int(size["shortest_edge"]),
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            resample=int(raw.get("resample", 3)),
            do_resize=bool(raw.get("do_resize", True)),
            do_center_crop=bool(raw.get("do_center_crop", True)),
            do_rescale=bool(raw.get("do_rescale", True)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            do_normalize=bool(raw.get("do_normalize", True)),
            # RGB triples: __post_init__ rejects any other length with a clear error.
            image_mean=cast(
                "tuple[float, float, float]",
                tuple(float(x) for x in raw.get("image_mean", _CLIP_MEAN)),
            ),
            image_std=cast(
                "tuple[float, float, float]",
                tuple(float(x) for x in raw.get("image_std", _CLIP_STD)),
            ),
        )

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> ImageProcessorConfig:
        path = Path(directory) / "preprocessor_config.json"
        if not path.is_file():
            return cls()  # LLaVA-1.5's CLIP-L/336 checkpoints always ship one; CLIP defaults
        return cls.from_dict(json.loads(path.read_text()))

    def fingerprint(self) -> bytes:
        """Canonical bytes of the settings (sorted JSON), mixed into every content hash."""
        return json.dumps(asdict(self), sort_keys=True).encode()


@dataclass(frozen=True)
class ImageInputSpec:
    """How a multimodal model takes images: the placeholder token, how many rows per image,
    and the preprocessing its checkpoint prescribes."""

    image_token: str  # placeholder text in prompts, e.g. "<image>"
    image_token_id: int
    num_image_tokens: int  # placeholder tokens (= feature rows) per image
    processor: ImageProcessorConfig


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:
        raise ValueError("image inputs need Pillow: pip install 'kvmemo[vision]'") from exc
    return Image


def load_image(source: Any) -> Any:
    """A PIL image from a PIL image, a file path, raw bytes or a data: URL.

    Raises ValueError (unreadable, too large, unsupported type, remote URL).
    """
    Image = _pil()
    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, str) and source.startswith("data:"):
            data = _decode_data_url(source)
        elif isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
        elif isinstance(source, (str, os.PathLike)):
            if str(source).startswith(("http://", "https://")):
                raise ValueError(
                    "image: remote URLs are not fetched; pass a data: URL, bytes or a file"
                )
            path = Path(source)
            if not path.is_file():
                raise ValueError(f"image: no such file {str(path)!r}")
            if path.stat().st_size > MAX_IMAGE_BYTES:
                raise ValueError(f"image: {path} is larger than {MAX_IMAGE_BYTES} bytes")
            data = path.read_bytes()
        else:
            raise ValueError(
                "image must be a PIL image, a file path, bytes or a data: URL, "
                f"got {type(source).__name__}"
            )
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(
                f"image: {len(data)} bytes is larger than the limit of {MAX_IMAGE_BYTES}"
            )
        try:
            image = Image.open(io.BytesIO(data))
        except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError...
            raise ValueError(f"image: cannot decode the image data ({exc})") from exc
    width, height = image.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"image: {width}x{height} pixels is outside the allowed 1..{MAX_IMAGE_PIXELS} pixels"
        )
    try:
        image.load()  # decode now, so a truncated file fails here and not inside the engine
    except Exception as exc:
        raise ValueError(f"image: cannot decode the image data ({exc})") from exc
    return image


def _decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("image_url: data URLs must look like data:image/png;base64,<data>")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"image_url: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"image_url: invalid base64 data ({exc})") from exc


def _to_rgb(image: Any) -> Any:
    """RGB, compositing transparency onto white (as transformers' convert_to_rgb does)."""
    Image = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Any, config: ImageProcessorConfig) -> np.ndarray:
    """PIL image -> float32 pixel values [3, crop_height, crop_width], as CLIPImageProcessor."""
    image = _to_rgb(image)
    if config.do_resize:
        width, height = image.size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = config.shortest_edge, int(config.shortest_edge * long / short)
        new_h, new_w = (new_long, new_short) if width <= height else (new_short, new_long)
        image = image.resize((new_w, new_h), resample=config.resample)
    pixels = np.asarray(image).transpose(2, 0, 1)  # [3, H, W] uint8
    if config.do_center_crop:
        pixels = _center_crop(pixels, config.crop_height, config.crop_width)
    out = pixels.astype(np.float32)
    if config.do_rescale:
        out = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
        out = ((out - mean) / std).astype(np.float32)
    return np.ascontiguousarray(out)


def _center_crop(pixels: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """[C, H, W] -> [C, crop_h, crop_w]; zero-pads first where the image is smaller."""
    _, height, width = pixels.shape
    if height < crop_h or width < crop_w:
        new_h, new_w = max(height, crop_h), max(width, crop_w)
        padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
        top, left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)  # ceil, as HF
        padded[:, top : top + height, left : left + width] = pixels
        pixels, height, width = padded, new_h, new_w
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    return pixels[:, top : top + crop_h, left : left + crop_w]


def content_hash(pixels: np.ndarray, config: ImageProcessorConfig) -> bytes:
    """sha256 over (settings, shape, dtype, processed pixel bytes): the image's identity."""
    digest = hashlib.sha256(b"kvmemo-image\0")
    digest.update(config.fingerprint())
    digest.update(f"{pixels.shape}:{pixels.dtype.str}".encode())
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.digest()
