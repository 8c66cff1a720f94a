"""The demo and its kit: a simulated engine (:mod:`.sim`), the engine and a loopback
worker process driven together (:mod:`.harness`), ``remote-dspark demo`` (:mod:`.demo`)
and ``remote-dspark chaos`` (:mod:`.chaos`)."""
