"""``python -m colobus`` is the ``colobus`` command."""

from ._cli import main

raise SystemExit(main())
