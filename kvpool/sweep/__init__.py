"""``kvpool sweep``: a grid of ``kvpool simulate`` configurations, run on this machine's
cores or a Ray cluster, their reports collected into one table and a plot.

`kvpool.sweep.grid` turns a grid spec into checked runs, `kvpool.sweep.execute` runs
them, `kvpool.sweep.table` tabulates the reports, `kvpool.sweep.plot` draws them and
`kvpool.sweep.command` is the command line.
"""

from kvpool.sweep.execute import Outcome, run_configuration
from kvpool.sweep.grid import Axis, Grid, GridError, Run, build_grid

__all__ = ["Axis", "Grid", "GridError", "Outcome", "Run", "build_grid", "run_configuration"]
