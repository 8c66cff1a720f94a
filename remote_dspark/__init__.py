"""remote_dspark: run a speculative-decoding drafter on another machine without ever
stalling the engine.

Importing this package (or ``remote_dspark.proxy_proc``) must not import torch, numpy or
prometheus_client: the proxy process is torch-free and starts in tens of milliseconds.
Engine-side modules that need torch import it themselves, lazily.

The parts, lowest first (``docs/design.md``'s ``parts`` block says which may import which):

    outcome       what happened to a round, from the C library to the dashboard
    histogram     the fixed-bucket record both sides count into
    trust         the one rule for a file code is loaded from, and one for a secret
    progress      the progress line of long commands
    sampled       a sampled draft's distribution: its sizes and its one check
    wire/         the contract's frames
    native/       the C library, its binding and its trusted build
    transport/    TCP and ofl transports, the link, the breaker
    config/       the environment contract: RemoteConfig, Mode
    shm/          the shared region: its layout, words, mapping and ring
    proxy/        the torch-free proxy: its loop, its round, how it is spawned
    proxy_proc    the proxy process's entry point
    supervisor/   spawns the proxy, watches it, respawns it under a budget
    metrics/      Prometheus exposition: metric tables and the scrape server
    drafter/      drafters as the worker calls them: Markov and model drafters
    engine/       RemoteDSpark and its parts
    worker/       the reference remote drafter
    integrations/ transformers' generate() and vLLM's proposer
    demo/         the demo, chaos and the harness that drives them
    harness       the harness's public path
    sim           the simulated engine's public path
    bench/        the benchmarks (``remote-dspark bench ...``)
    cli/          the command line
"""

__version__ = "0.1.0"
