"""The command-line flags ``kvpool simulate`` and ``kvpool serve`` share, and what they
build: `values` (argument types and bounds), `engine` (the engine flags and their
`EngineConfig`), `aic` (the ``--aic-*`` flags), `events` (the KV-event flags and their
ZMQ publishers).

They live below the command line (`kvpool.cli`) and `kvpool.serve`, so that serve's
handler reads them without importing the command line that dispatches to it.
"""
