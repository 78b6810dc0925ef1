"""What every zarr.json of ours says besides the array itself: the Writer's own record (state,
rows written) and the JSON it is serialised as.  Format level: the writer publishes it, readers,
verify and the overwrite rules read it."""

from __future__ import annotations

import json

__all__ = [
    "COMPLETE",
    "FAILED",
    "METADATA_KEY",
    "RECORDING",
    "STATE_KEY",
    "check_attributes",
    "metadata_bytes",
]

#: the name of every node's metadata object
METADATA_KEY = "zarr.json"


#: attribute key of the Writer's own record in every array's zarr.json
STATE_KEY = "tileshard"


RECORDING, COMPLETE, FAILED = "recording", "complete", "failed"


def check_attributes(attributes) -> dict:
    """User attributes: a JSON object without NaN/Infinity and without the Writer's own keys."""
    if attributes is None:
        return {}
    if not isinstance(attributes, dict):
        raise TypeError(f"attributes must be a dict, got {type(attributes).__name__}")
    if STATE_KEY in attributes:
        raise ValueError(f"attributes may not contain {STATE_KEY!r}: the Writer records the recording's state there")
    try:
        json.dumps(attributes, allow_nan=False)
    except TypeError as exc:
        raise TypeError(f"attributes must be JSON-serialisable: {exc}") from exc
    except ValueError as exc:  # NaN/Infinity: json.dumps would write invalid JSON by default
        raise ValueError(f"attributes must be valid JSON, without NaN or Infinity: {exc}") from exc
    return dict(attributes)


def metadata_bytes(metadata: dict) -> bytes:
    return json.dumps(metadata, indent=2).encode()
