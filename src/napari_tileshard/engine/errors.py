"""Errors of the writing pipeline above storage."""

from __future__ import annotations

__all__ = ["PipelineStalledError"]


class PipelineStalledError(RuntimeError):
    """A stage of the writing pipeline made no progress within its deadline, or work was lost;
    the message names the stage and what it waited for."""
