"""``remote-dspark bench handoff``: the command (:mod:`.run`), its CUDA rows
(:mod:`.cuda`), its peers (:mod:`.peers`, and :mod:`.peer` run as a process) and its
options and figures (:mod:`.types`)."""
