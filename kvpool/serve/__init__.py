"""``kvpool serve``: a drop-in vLLM stand-in over the mock engine (``kvpool[serve]``).

Small modules, one job each: `tokenizer` (text <-> ids), `detokenizer` (an output's
text as its tokens arrive, vLLM's stop rules), `protocol` (request bodies and errors as
vLLM 0.33 takes them), `intake` (body limits and size checks before tokenizing),
`disconnect` (work that stops when its client leaves), `choices` (one choice's text,
stops and logprobs), `logprobs` (deterministic logprobs), `failures` (failure
injection), `driver` (the task owning one rank's engine), `metrics` (vLLM's Prometheus
names), `state` (a server's ranks and their life cycle), `app` (the Starlette routes),
`server` (uvicorn on uvloop, signals, bounded shutdown, exit status), `command` (the
CLI's handler).

Importing this package imports Starlette, uvicorn and prometheus_client.
"""

from kvpool.serve.app import build_app
from kvpool.serve.driver import EngineDriver, Output
from kvpool.serve.intake import RequestLimits
from kvpool.serve.server import running_server, serve
from kvpool.serve.state import DEFAULT_MODEL_NAME, ServeState
from kvpool.serve.tokenizer import BuiltinTokenizer, HfTokenizer, Tokenizer

__all__ = [
    "DEFAULT_MODEL_NAME",
    "BuiltinTokenizer",
    "EngineDriver",
    "HfTokenizer",
    "Output",
    "RequestLimits",
    "ServeState",
    "Tokenizer",
    "build_app",
    "running_server",
    "serve",
]
