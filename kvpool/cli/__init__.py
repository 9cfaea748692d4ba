"""``kvpool``: the command line. ``kvpool simulate`` runs a workload on mock engines;
``kvpool serve`` serves vLLM's OpenAI API over them (`kvpool.serve`, its own extra);
``kvpool profile`` writes aiconfigurator's step times as a Dynamo planner profile;
``kvpool sweep`` runs a grid of ``simulate`` configurations through `simulate_run`.
One module a command (`simulate`, `serve`, `profile`, the `sweep` package), `program`
the parser and `main`; the flags ``simulate`` and ``serve`` share live below the command
line, in `kvpool.flags`, so that `kvpool.serve` never imports this package.

Exit status: 0 on success, 2 for a bad flag, 1 for bad input (an unreadable or malformed
trace, an output file that cannot be written, a missing optional dependency, a socket
that cannot be bound) or a run that leaked KV blocks, 130 when interrupted (Ctrl-C,
SIGINT) and 143 when terminated (SIGTERM), at any point. Input and output paths are
checked before anything runs. ``kvpool serve`` is the exception once it is listening:
there SIGTERM or SIGINT stops it accepting, lets the requests in flight run for
``--shutdown-timeout`` seconds, aborts the rest and exits 0 (see `kvpool.serve.server`).
Ctrl-C works however the process was started (a SIGINT ignored by inheritance is
restored).
"""

from kvpool.cli.program import build_parser, main
from kvpool.cli.simulate import simulate_run

__all__ = ["build_parser", "main", "simulate_run"]
