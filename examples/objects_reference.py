"""Two colocated objects, one passed to the other's method.

A colocated object lives on the hosts; the controller holds only a handle.
Passing that handle to a method of another colocated object hands each host its
*own live instance*, not a copy: below, the tokenizer on each host reads the
vocabulary that lives on that same host, including words added to it later.

    python examples/objects_reference.py [--hosts N]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import colobus as cb


@cb.colocated_python_class
class Vocabulary:
    """A word -> id table, one instance per host."""

    def __init__(self, words: list[str]) -> None:
        self.ids: dict[str, int] = {}
        self.add(words)

    def add(self, words: list[str]) -> np.ndarray:
        for w in words:
            self.ids.setdefault(w, len(self.ids))
        return np.int32(len(self.ids))

    def lookup(self, word: str) -> int:
        """Plain Python, called by other objects on the same host."""
        return self.ids.get(word, -1)


@cb.colocated_python_class
class Tokenizer:
    """Turns text into ids with whatever vocabulary it is given."""

    def __init__(self, lowercase: bool) -> None:
        self.lowercase = lowercase
        self.tokens = 0

    def encode(self, vocab: Vocabulary, text: str) -> np.ndarray:
        # ``vocab`` is this host's Vocabulary instance itself: same process, same object.
        words = text.lower().split() if self.lowercase else text.split()
        self.tokens += len(words)
        return np.array([vocab.lookup(w) for w in words], np.int32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=None,
                        help="hosts (default 2; under `colobus launch`, the launched ones)")
    args = parser.parse_args(argv)

    with cb.local_cluster(hosts=args.hosts):
        devices = cb.devices()  # one CPU device per host
        vocab = Vocabulary(["the", "cat", "sat"])  # nothing is built on any host yet
        tok = Tokenizer(lowercase=True)
        # Methods with no array argument are told where to run.
        vocab.add = vocab.add.specialize(devices=devices)
        tok.encode = tok.encode.specialize(devices=devices)

        text = "The cat sat on the mat"
        # Passing ``vocab`` builds it on every host first (it was never used yet).
        ids = tok.encode(vocab, text)
        print(f"before: {text!r} -> {np.asarray(ids).tolist()}")

        # Calls from one thread run on each host in the order issued, so the
        # encode below sees the words this add puts into each host's vocabulary.
        size = vocab.add(["on", "mat"])
        ids = tok.encode(vocab, text)
        print(f"vocabulary size on every host: {int(np.asarray(size))}")
        print(f"after:  {text!r} -> {np.asarray(ids).tolist()}")

        cb.close(tok)  # each host drops its Tokenizer; the Vocabulary lives on
        cb.close(vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
