"""Exceptions raised by the FoundationPose package.

::

    PoseError
    ├─ InputError(ValueError)   bad user input: .field .expected .got
    │  └─ InputTooLargeError    input over a size limit (faces, texture pixels, memory): HTTP 413
    ├─ UnknownObjectError(KeyError)
    ├─ UnknownSessionError(KeyError)
    ├─ WeightsError             missing checkpoint, key/shape mismatch
    ├─ RenderError              renderer backend unavailable or failed
    └─ NonFinitePoseError       a refined pose with NaN/inf entries (one request of a batch; the server: 500)
"""

from __future__ import annotations

__all__ = [
    "PoseError",
    "InputError",
    "InputTooLargeError",
    "UnknownObjectError",
    "UnknownSessionError",
    "WeightsError",
    "RenderError",
    "NonFinitePoseError",
]


class PoseError(Exception):
    """Base class of every error raised by foundationpose."""


class InputError(PoseError, ValueError):
    """User input failed validation.

    The message reads ``"<field>: expected <expected>; got <got>[. <hint>]"`` so that
    the server can return it verbatim as a 4xx detail.
    """

    def __init__(self, field: str, expected: str, got: str, hint: str | None = None) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        self.hint = hint
        message = f"{field}: expected {expected}; got {got}"
        if hint:
            message += f". {hint}"
        super().__init__(message)


class InputTooLargeError(InputError):
    """Input that is well formed but over a size limit (mesh faces, texture pixels, loaded-object memory).

    Same message shape as :class:`InputError`; the server answers it with 413 instead of 422.
    """


class UnknownObjectError(PoseError, KeyError):
    """No object (mesh) is registered under this id."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown object"


class UnknownSessionError(PoseError, KeyError):
    """No tracking session exists under this id (never created, expired or deleted)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown session"


class WeightsError(PoseError):
    """A checkpoint is missing or does not match the network architecture."""


class RenderError(PoseError):
    """A renderer backend is unavailable or failed."""


class NonFinitePoseError(PoseError):
    """The refined pose of one request has NaN or inf entries (a degenerate frame, K or previous pose); the
    other requests of its batch are unaffected. The input passed validation, so the server answers 500
    (``PoseDivergedError``, the message kept: it names no secret) rather than a 4xx the client could fix."""
