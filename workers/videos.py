"""Episode videos: MP4 (H.264 through imageio's bundled ffmpeg) or GIF (Pillow), from uint8 frames.

Frames are [T, H, W, 3]; several cameras are put side by side before they get here (one row of a
grid). MP4 needs ``imageio-ffmpeg``; GIF needs only Pillow, so it is the fallback and the format
for the small videos a run folder keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

VIDEO_FORMATS = ("mp4", "gif")


def write_video(path: str | Path, frames: Sequence[np.ndarray], fps: float = 20.0) -> Path:
    """Write ``frames`` to ``path`` (its suffix picks MP4 or GIF); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = [np.ascontiguousarray(f, dtype=np.uint8) for f in frames]
    if not arr:
        raise ValueError(f"{path}: no frames to write")
    fmt = path.suffix.lstrip(".").lower()
    if fmt == "mp4":
        import imageio.v2 as iio

        # H.264 with yuv420p plays everywhere; it wants even sizes, so pad one row/column if odd.
        h, w = arr[0].shape[:2]
        pad = ((0, h % 2), (0, w % 2), (0, 0))
        with iio.get_writer(str(path), format="FFMPEG", mode="I", fps=fps, codec="libx264",
                            pixelformat="yuv420p", macro_block_size=1, ffmpeg_log_level="error") as w_:
            for f in arr:
                w_.append_data(np.pad(f, pad) if any(p[1] for p in pad) else f)
    elif fmt == "gif":
        from PIL import Image

        imgs = [Image.fromarray(f) for f in arr]
        imgs[0].save(path, save_all=True, append_images=imgs[1:], duration=max(1, int(1000 / fps)), loop=0)
    else:
        raise ValueError(f"{path}: video format must be one of {VIDEO_FORMATS}")
    return path
