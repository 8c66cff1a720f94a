"""The proxy: the torch-free process that serves the engine's rounds from the region.

* :mod:`.loop`: the loop (rounds from the region, to the worker and back);
* :mod:`.ring_end`: the proxy's end of the ring;
* :mod:`.tcp_round`: a whole round on a TCP connection as one native call;
* :mod:`.handover`: what the engine hands a proxy it spawns, both halves;
* :mod:`.spawn`: how a proxy process starts, and how it is ended.

The process's entry point is :mod:`remote_dspark.proxy_proc`.
"""
