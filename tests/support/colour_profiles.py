"""A Display P3 ICC profile built from its primaries (Pillow's ImageCms can only create sRGB, LAB and XYZ),
and the colour science to check a conversion against without any ICC machinery.

The profile is a minimal ICC v2 display profile: D50 white point, the three colorants adapted from D65 to D50
with the Bradford transform (as the ICC specification asks), and the sRGB transfer curve (Display P3 uses it)
sampled in 1024 steps. Pixel values converted through it match the direct D65 computation to within 0.5.
"""

from __future__ import annotations

import struct

import numpy as np

Chromaticity = tuple[float, float]

D65: Chromaticity = (0.3127, 0.3290)
DISPLAY_P3_PRIMARIES: tuple[Chromaticity, Chromaticity, Chromaticity] = ((0.680, 0.320), (0.265, 0.690), (0.150, 0.060))
SRGB_PRIMARIES: tuple[Chromaticity, Chromaticity, Chromaticity] = ((0.640, 0.330), (0.300, 0.600), (0.150, 0.060))
ICC_D50 = np.array([0.9642, 1.0, 0.8249])
BRADFORD = np.array([[0.8951, 0.2664, -0.1614], [-0.7502, 1.7135, 0.0367], [0.0389, -0.0685, 1.0296]])
CURVE_POINTS = 1024


def _xyz_of(chromaticity: Chromaticity) -> np.ndarray:
    x, y = chromaticity
    return np.array([x / y, 1.0, (1 - x - y) / y])


def rgb_to_xyz(primaries: tuple[Chromaticity, Chromaticity, Chromaticity], white: Chromaticity) -> np.ndarray:
    """The matrix from linear RGB to XYZ for these primaries, scaled so RGB (1, 1, 1) is the white point."""
    columns = np.stack([_xyz_of(primary) for primary in primaries], axis=1)
    return columns * np.linalg.solve(columns, _xyz_of(white))


def srgb_decode(encoded: np.ndarray) -> np.ndarray:
    return np.where(encoded <= 0.04045, encoded / 12.92, ((encoded + 0.055) / 1.055) ** 2.4)


def srgb_encode(linear: np.ndarray) -> np.ndarray:
    return np.where(linear <= 0.0031308, 12.92 * linear, 1.055 * np.power(np.maximum(linear, 0), 1 / 2.4) - 0.055)


def display_p3_as_srgb(pixel: tuple[int, int, int]) -> tuple[float, float, float]:
    """A Display P3 pixel as the sRGB pixel that shows the same colour (both D65, no clipping needed)."""
    xyz = rgb_to_xyz(DISPLAY_P3_PRIMARIES, D65) @ srgb_decode(np.array(pixel) / 255)
    red, green, blue = srgb_encode(np.linalg.solve(rgb_to_xyz(SRGB_PRIMARIES, D65), xyz)) * 255
    return float(red), float(green), float(blue)


def _s15_fixed16(value: float) -> bytes:
    return struct.pack(">i", round(value * 65536))


def _xyz_tag(values: np.ndarray) -> bytes:
    return b"XYZ " + bytes(4) + b"".join(_s15_fixed16(value) for value in values)


def _description_tag(text: bytes) -> bytes:
    # textDescriptionType: ASCII with its NUL, then empty Unicode and ScriptCode parts (67 bytes reserved).
    return b"desc" + bytes(4) + struct.pack(">I", len(text) + 1) + text + b"\0" + bytes(8) + bytes(3) + bytes(67)


def display_p3_profile() -> bytes:
    """The ICC profile bytes of Display P3."""
    to_pcs = BRADFORD @ ICC_D50 / (BRADFORD @ _xyz_of(D65))
    colorants = np.linalg.inv(BRADFORD) @ np.diag(to_pcs) @ BRADFORD @ rgb_to_xyz(DISPLAY_P3_PRIMARIES, D65)
    samples = srgb_decode(np.linspace(0, 1, CURVE_POINTS))
    curve = (
        b"curv"
        + bytes(4)
        + struct.pack(">I", CURVE_POINTS)
        + b"".join(struct.pack(">H", round(v * 65535)) for v in samples)
    )
    tags = [
        (b"desc", _description_tag(b"Display P3 (built by the tests)")),
        (b"cprt", b"text" + bytes(4) + b"public domain\0"),
        (b"wtpt", _xyz_tag(ICC_D50)),
        (b"rXYZ", _xyz_tag(colorants[:, 0])),
        (b"gXYZ", _xyz_tag(colorants[:, 1])),
        (b"bXYZ", _xyz_tag(colorants[:, 2])),
        (b"rTRC", curve),
        (b"gTRC", curve),
        (b"bTRC", curve),
    ]
    table = struct.pack(">I", len(tags))
    body = b""
    start = 128 + 4 + 12 * len(tags)
    for signature, data in tags:
        body += bytes(-len(body) % 4)  # every tag starts on a 4-byte boundary
        table += signature + struct.pack(">II", start + len(body), len(data))
        body += data
    size = 128 + len(table) + len(body)
    header = (
        struct.pack(">I", size)
        + bytes(4)
        + struct.pack(">I", 0x02100000)
        + b"mntr"
        + b"RGB "
        + b"XYZ "
        + bytes(12)
        + b"acsp"
        + bytes(28)
        + b"".join(_s15_fixed16(value) for value in ICC_D50)
        + bytes(48)
    )
    return header + table + body
