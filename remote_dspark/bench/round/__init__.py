"""``remote-dspark bench round``: the command (:mod:`.run`), its options (:mod:`.options`),
batches (:mod:`.feeder`), floor row (:mod:`.floor`) and report (:mod:`.report`)."""
