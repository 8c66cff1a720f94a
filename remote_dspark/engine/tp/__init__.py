"""Tensor parallelism: ``RemoteDSpark`` on every rank of a ``tp_group``.

ranks    who does what: rank 0 opens the path, the others take its broadcast answers
records  the fixed-size records rank 0 broadcasts at start() and round()
launch   launch() across the ranks: one device record in stream order
"""
