"""remote_dspark: run a speculative-decoding drafter on another machine without ever
stalling the engine.

Importing this package (or ``remote_dspark.proxy_proc``) must not import torch, numpy or
prometheus_client: the proxy process is torch-free and starts in tens of milliseconds.
Engine-side modules that need torch import it themselves, lazily.
"""

__version__ = "0.1.0"
