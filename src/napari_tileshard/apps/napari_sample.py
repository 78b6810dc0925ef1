"""napari sample data: a few hundred frames from the synthetic camera."""

from .camera import SyntheticCamera

__all__ = ["synthetic_microscope"]


def synthetic_microscope(frames: int = 200, shape=(512, 512)):
    stack = SyntheticCamera(shape, "uint16", seed=0).stack(frames)
    return [
        (
            stack,
            {"name": "synthetic microscope", "axis_labels": ["t", "y", "x"], "contrast_limits": (90, 1200)},
            "image",
        )
    ]
