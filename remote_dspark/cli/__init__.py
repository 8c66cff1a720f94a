"""The command line, ``remote-dspark``: the parser and error mapping (:mod:`.main`) and
the subcommands that own no other part (:mod:`.worker`, :mod:`.check_config` with its
worker :mod:`.probe`, :mod:`.markov`, :mod:`.dashboard`). The demo, chaos and benchmark
subcommands live with their parts."""
