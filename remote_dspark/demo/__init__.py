"""The demo and its kit: a simulated engine (:mod:`.sim`), the engine and a loopback
worker process driven together (:mod:`.harness`), ``remote-dspark demo`` (:mod:`.demo`)
and ``remote-dspark chaos`` (:mod:`.chaos`); a fleet of workers on 127.0.0.x and the
chaos run's checks with one (:mod:`.fleet`), drafters that sign their drafts
(:mod:`.tagged`)."""
