"""``python -m kvpool``: the same as the ``kvpool`` console script."""

from kvpool.cli import main

raise SystemExit(main())
