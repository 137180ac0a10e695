"""The command line's argument parsing, shared by ``colobus`` and the demo's own parser.

Its errors name the mistake: an option that does not exist is named, with the
option it is close to (``--conect``: did you mean ``--connect``?; ``--key``: did
you mean ``--key-file``?, since options are never abbreviated); words of a
driver command given to ``colobus launch`` without the ``--`` before them say so.
Values are never echoed (one could be a secret), only option names.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["USAGE_ERROR", "CliParser", "positive_int"]

USAGE_ERROR = 2
_UNRECOGNIZED = "unrecognized arguments: "
_REQUIRED = "the following arguments are required: "


class CliParser(argparse.ArgumentParser):
    """argparse without abbreviations, whose errors are one line on stderr."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._words: list[str] = []  # what this parser was last given, for its errors

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        self._words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            # argparse reports a subcommand's leftovers from the top parser, which knows
            # neither the subcommand's options nor its name: let the subcommand say it.
            self._innermost(ns).error(_UNRECOGNIZED + " ".join(extras))
        return ns

    def _innermost(self, ns: argparse.Namespace) -> CliParser:
        """The (sub)command parser that ``ns`` went through last."""
        parser: CliParser = self
        while True:
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    chosen = action.choices.get(getattr(ns, action.dest, None) or "")
                    if isinstance(chosen, CliParser):
                        parser = chosen
                        break
            else:
                return parser

    def error(self, message: str) -> NoReturn:
        if message.startswith((_UNRECOGNIZED, _REQUIRED)):
            message = self._named(message)
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _named(self, message: str) -> str:
        """``message`` with each unknown option named and the close one suggested."""
        unknown = self._unknown_options()
        if message.startswith(_REQUIRED) and not unknown:
            return message
        hints = [f"{word}: did you mean {close}?" for word in unknown
                 if (close := self._close_option(word)) is not None]
        if message.startswith(_UNRECOGNIZED):
            words = message[len(_UNRECOGNIZED):].split()
            if " launch " in f" {self.prog} " and words and not words[0].startswith("-"):
                # `colobus launch local python train.py`: the driver command without `--`.
                return (f"{words[0]!r} is not an option of {self.prog}: the driver command "
                        f"goes after `--`, as in: {self.prog} [options] -- {words[0]} ...")
        else:  # a required option missing because it was misspelt: name the misspelling
            words = unknown
        shown = " ".join(w if w.startswith("-") else "..." for w in words)
        return _UNRECOGNIZED + shown + (f" ({'; '.join(hints)})" if hints else "")

    def _unknown_options(self) -> list[str]:
        """The option-like words this parser was given that it does not know (names only)."""
        known = self._option_string_actions
        out: list[str] = []
        for word in self._words:
            if word == "--":
                break
            name = word.split("=", 1)[0]
            if (word.startswith("-") and word != "-" and name not in known
                    and not self._negative_number_matcher.match(word) and name not in out):
                out.append(name)
        return out

    def _close_option(self, word: str) -> str | None:
        """The option ``word`` most likely meant: one it abbreviates, else a near spelling."""
        options = [o for o in self._option_string_actions if o.startswith("--")]
        longer = [o for o in options if o.startswith(word)]
        if len(longer) == 1:  # `--key` for `--key-file`: options are never abbreviated
            return longer[0]
        close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
        return close[0] if close else None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value
