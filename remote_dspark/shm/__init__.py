"""The shared region: one memfd the engine and its proxy map.

* :mod:`.layout`: its byte layout (header page, hand-off words, ring, staging, drafts);
* :mod:`.words`: its live words as one process reads and writes them;
* :mod:`.memfd`: the mapping itself (create, attach, close);
* :mod:`.ring`: rounds through it, the engine's end;
* :mod:`.streamsync`: the CUDA stream's side of the hand-off (or its CPU stand-in);
* :mod:`.cuda_driver`: the few CUDA driver calls that needs.
"""
