"""The demo application (``python -m foundationpose.demo``) and what only applications use: the
recorded-sequence reader (:mod:`.dataset`), overlay drawing (:mod:`.overlay`) and ADD/ADD-S
(:mod:`.metrics`)."""

from foundationpose.demo.cli import main

__all__ = ["main"]
