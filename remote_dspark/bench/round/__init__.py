"""``remote-dspark bench round``: the command (:mod:`.run`), its options (:mod:`.options`),
batches (:mod:`.feeder`), floor row (:mod:`.floor`), draft row (:mod:`.draft`), mac row
(:mod:`.mac`), the engines of a row (:mod:`.engines`), the worker's own time
(:mod:`.worker_time`), the ``--tp`` rows (:mod:`.tp`, and :mod:`.tp_loopback` on one GPU)
and report (:mod:`.report`)."""
