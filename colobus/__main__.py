"""``python -m colobus`` is the ``colobus`` command."""

from ._tools.cli import main

raise SystemExit(main())
