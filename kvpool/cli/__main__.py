"""``python -m kvpool.cli``: the same as ``python -m kvpool`` and the ``kvpool`` script."""

from kvpool.cli import main

raise SystemExit(main())
