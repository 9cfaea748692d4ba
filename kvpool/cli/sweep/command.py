"""``kvpool sweep``: run a grid of ``kvpool simulate`` configurations, on this machine's
cores or a Ray cluster, and collect their reports into one table and a plot.

Exit status: 0 when every run passed, 1 when one failed (the table says which and why;
the others still ran) or an output cannot be written, 2 for a bad flag or grid spec
(nothing is run), 130 interrupted, 143 terminated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvpool.cli.sweep.execute import (
    LOCAL_RAY,
    ClusterError,
    Outcome,
    default_jobs,
    require_ray,
    run_in_processes,
    run_inline,
    run_on_ray,
)
from kvpool.cli.sweep.grid import (
    Grid,
    GridError,
    build_grid,
    canonical_flag,
    parse_grid_flag,
    read_grid_file,
)
from kvpool.cli.sweep.table import METRICS, table_csv, table_json, table_text
from kvpool.flags.values import int_in

_DEFAULT_METRIC = "ttft_s.p99"
_MAX_JOBS = 4096

_DESCRIPTION = """\
Run kvpool simulate once per configuration of a grid and collect the reports into one
table (CSV, JSON) and a plot of chosen metrics against a swept parameter.

Each --grid KEY=V1,V2,... names a kvpool simulate flag without its dashes and the values
to try (true/false for a switch); one value fixes the flag for every run. The runs are
every combination, the last axis varying fastest. A TOML file (--config) can hold the
same axes in a [grid] table. Each run's report is the one kvpool simulate writes for the
same flags; a run that fails is reported in the table and the others go on.
"""

_EPILOG = """\
a TOML --config file:
  [grid]
  trace = ["a.jsonl", "b.jsonl"]
  num-gpu-blocks = [1024, 2048, 4096]
  dispatch = ["least-loaded", "round-robin"]
  workers = 2                      # one value: every run

exit status: 0 every run passed, 1 a run failed (see the table) or an output could not
be written, 2 bad flags or grid (nothing run), 130 interrupted, 143 terminated.

examples:
  kvpool sweep --grid num-gpu-blocks=1024,2048 --grid dispatch=least-loaded,round-robin \\
      --grid workers=2 --csv sweep.csv --plot ttft.png
  kvpool sweep --trace a.jsonl --trace b.jsonl --grid num-gpu-blocks=2048,4096 --jobs 4
  kvpool sweep --config sweep.toml --ray auto --json sweep.json
"""


def add_sweep_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kvpool sweep`` to ``kvpool``'s subcommands."""
    sweep = commands.add_parser(
        "sweep",
        help="run a grid of simulate configurations in parallel and tabulate the reports",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    grid = sweep.add_argument_group("grid")
    grid.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="a kvpool simulate flag (no dashes) and its values, or KEY=range(START,STOP"
        "[,STEP]) (integers, STOP excluded); repeat for more axes",
    )
    grid.add_argument(
        "--config", metavar="FILE.toml", help="axes from the [grid] table of a TOML file"
    )
    grid.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="a trace to run every configuration on; repeat for more (the first axis: "
        "the same as --grid trace=FILE,...)",
    )
    where = sweep.add_argument_group("where")
    where.add_argument(
        "--jobs",
        "-j",
        type=int_in(1, _MAX_JOBS),
        metavar="N",
        help="runs at once, each in its own process (default: one per core, here "
        f"{default_jobs()}); 1 runs them one after another in this process",
    )
    where.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run each configuration as a task on the Ray cluster at ADDRESS ('auto', "
        "HOST:PORT, ray://HOST:PORT), or 'local' for a Ray started here with --jobs CPUs "
        "(needs pip install 'kvpool[ray]'; every node must have kvpool and the traces "
        "at the same paths)",
    )
    out = sweep.add_argument_group("output")
    out.add_argument("--csv", metavar="FILE", help="write the table as CSV ('-' = stdout)")
    out.add_argument(
        "--json",
        metavar="FILE",
        help="write the table as JSON, each run's whole report included ('-' = stdout)",
    )
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the metrics against --plot-x, a line per combination of the other "
        "swept flags (needs matplotlib)",
    )
    out.add_argument(
        "--plot-x",
        metavar="KEY",
        help="the swept flag along the x axis (default: the first swept one with "
        "numeric values, else the first swept one)",
    )
    out.add_argument(
        "--plot-metric",
        action="append",
        default=[],
        metavar="METRIC",
        help=f"a table column to plot, a panel each (default: {_DEFAULT_METRIC}); "
        "e.g. ttft_s.p99, latency_s.mean, prefix_cache_hit_rate, preemptions, "
        "kv_usage.mean, output_tokens_per_s",
    )
    out.add_argument(
        "--no-progress", action="store_true", help="no line on stderr as each run ends"
    )
    # its own parser, not kvpool's: an error then reads "kvpool sweep: error: ..."
    sweep.set_defaults(handler=lambda args, _: run_sweep_command(args, sweep))


def _grid(args: argparse.Namespace) -> Grid:
    specs: list[tuple[str, list[str]]] = []
    if args.trace:
        specs.append(("trace", list(args.trace)))
    if args.config:
        specs.extend(read_grid_file(args.config))
    specs.extend(parse_grid_flag(text) for text in args.grid)
    grid = build_grid(specs)
    for axis in grid.axes:
        if axis.key == "trace":
            for trace in axis.values:
                if not os.path.isfile(trace) or not os.access(trace, os.R_OK):
                    raise GridError(f"trace {trace}: no such readable file")
    return grid


def _plot_x(args: argparse.Namespace, grid: Grid) -> str | None:
    if not args.plot:
        if args.plot_x or args.plot_metric:
            raise GridError("--plot-x and --plot-metric need --plot")
        return None
    for metric in args.plot_metric:
        if metric not in METRICS:
            raise GridError(f"--plot-metric {metric}: not a column; one of: {', '.join(METRICS)}")
    swept = [axis.key for axis in grid.swept]
    if not swept:
        raise GridError("--plot: no flag takes more than one value")
    if args.plot_x is None:
        numeric = [a.key for a in grid.swept if all(_is_number(v) for v in a.values)]
        return (numeric or swept)[0]
    key = canonical_flag(args.plot_x)
    named = {axis.key: axis for axis in grid.axes}
    if key not in named:
        raise GridError(f"--plot-x {args.plot_x}: not an axis of the grid ({', '.join(named)})")
    if key not in swept:
        raise GridError(f"--plot-x {key}: takes one value only")
    return key


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_outputs(args: argparse.Namespace) -> str | None:
    from kvpool.cli.simulate import unwritable

    if [args.csv, args.json].count("-") > 1:
        return "--csv and --json cannot both write to stdout ('-')"
    taken: dict[str, str] = {}
    for flag, target in (("--csv", args.csv), ("--json", args.json), ("--plot", args.plot)):
        if not target or target == "-":
            continue
        problem = unwritable(target)
        if problem is not None:
            return f"{flag}: {problem}"
        key = os.path.realpath(target)
        if key in taken:
            return f"{flag}: {target} is also the {taken[key]} file"
        taken[key] = flag
    if args.plot:
        from kvpool.engine.plot import check_plot_format, require_matplotlib

        try:
            require_matplotlib()
            check_plot_format(args.plot)
        except (ImportError, ValueError) as exc:
            return str(exc)
    if args.ray is not None:
        try:
            require_ray()
        except ImportError as exc:
            return str(exc)
    return None


def _fail(message: str) -> int:
    print(f"kvpool sweep: error: {message}", file=sys.stderr)
    return 1


def _say(args: argparse.Namespace, message: str) -> None:
    if not args.no_progress:
        print(f"kvpool sweep: {message}", file=sys.stderr, flush=True)


def run_sweep_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``kvpool sweep``: check everything, run the grid, write the table; the exit status."""
    try:
        grid = _grid(args)
        plot_x = _plot_x(args, grid)
    except GridError as exc:
        parser.error(str(exc))
    metrics = args.plot_metric or [_DEFAULT_METRIC]
    failure = _check_outputs(args)
    if failure is not None:
        return _fail(failure)
    jobs = args.jobs or default_jobs()
    start = time.perf_counter()
    try:
        outcomes = list(_report_progress(args, grid, _outcomes(args, grid, jobs)))
    except ClusterError as exc:
        return _fail(str(exc))
    failed = sum(not outcome.ok for outcome in outcomes)
    _say(
        args,
        f"{len(outcomes)} runs, {failed} failed, {time.perf_counter() - start:.1f} s wall",
    )
    failure = _write_outputs(args, grid, outcomes, plot_x, metrics)
    if failure is not None:
        return _fail(failure)
    return 1 if failed else 0


def _outcomes(args: argparse.Namespace, grid: Grid, jobs: int) -> Iterator[Outcome]:
    runs = list(grid.runs)
    if args.ray is not None:
        return run_on_ray(
            runs,
            args.ray,
            jobs if args.ray == LOCAL_RAY else None,
            lambda where: _say(args, f"{len(runs)} runs on {where}"),
        )
    jobs = min(jobs, len(runs))
    _say(args, f"{len(runs)} runs, {jobs} at a time")
    return run_inline(runs) if jobs == 1 else run_in_processes(runs, jobs)


def _report_progress(
    args: argparse.Namespace, grid: Grid, outcomes: Iterator[Outcome]
) -> Iterator[Outcome]:
    total = len(grid.runs)
    keys = [axis.key for axis in grid.swept] or None
    for done, outcome in enumerate(outcomes, 1):
        status = "ok" if outcome.ok else f"FAILED: {outcome.error}"
        _say(
            args,
            f"[{done}/{total}] run {outcome.run.index} ({outcome.run.label(keys)}) "
            f"{outcome.wall_s:.1f} s: {status}",
        )
        yield outcome


def _write_outputs(
    args: argparse.Namespace,
    grid: Grid,
    outcomes: Sequence[Outcome],
    plot_x: str | None,
    metrics: Sequence[str],
) -> str | None:
    text = table_text(grid, outcomes)
    summary = sys.stderr if "-" in (args.csv, args.json) else sys.stdout
    summary.write(text)
    summary.flush()
    for flag, target in (("--csv", args.csv), ("--json", args.json)):
        if not target:
            continue
        content = (
            table_csv(grid, outcomes).encode() if flag == "--csv" else table_json(grid, outcomes)
        )
        if target == "-":
            sys.stdout.buffer.write(content)
            sys.stdout.flush()
            continue
        try:
            Path(target).write_bytes(content)
        except OSError as exc:
            return f"{flag}: cannot write {target}: {exc.strerror or exc}"
    if args.plot and plot_x is not None:
        from kvpool.cli.sweep.plot import write_sweep_plot

        try:
            write_sweep_plot(grid, outcomes, plot_x, metrics, args.plot)
        except OSError as exc:
            return f"--plot: cannot write {args.plot}: {exc.strerror or exc}"
    return None
