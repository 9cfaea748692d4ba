"""``kvpool sweep``: a grid of ``kvpool simulate`` configurations, run on this machine's
cores or a Ray cluster, their reports collected into one table and a plot.

`grid` turns a grid spec into checked runs (each parsed and checked by
`kvpool.cli.simulate`, as ``kvpool simulate`` checks its own), `execute` runs them,
`table` tabulates the reports, `plot` draws them and `command` is the command line.
"""

from kvpool.cli.sweep.execute import Outcome, run_configuration
from kvpool.cli.sweep.grid import Axis, Grid, GridError, Run, build_grid

__all__ = ["Axis", "Grid", "GridError", "Outcome", "Run", "build_grid", "run_configuration"]
