"""The command line's argument parsing, shared by ``colobus`` and the demo's own parser."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

__all__ = ["USAGE_ERROR", "CliParser", "positive_int"]

USAGE_ERROR = 2


class CliParser(argparse.ArgumentParser):
    """argparse without abbreviations, whose errors are one line on stderr."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):  # name the options, never echo values (a secret?)
            words = message[len(prefix):].split()
            message = prefix + " ".join(w if w.startswith("-") else "..." for w in words)
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value
