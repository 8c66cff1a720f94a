"""The command line, ``remote-dspark``: the parser and error mapping (:mod:`.main`) and
the subcommands that own no other part (``worker``, ``check-config``, ``markov``,
``dashboard``). The demo, chaos and benchmark subcommands live with their parts."""
