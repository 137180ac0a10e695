"""The ``colobus bench`` and ``colobus demo`` commands: programs built on the public API.

The runtime never imports this package; the command line does, lazily.
"""
