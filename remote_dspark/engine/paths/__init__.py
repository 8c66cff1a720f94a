"""What carries a round to the worker and back, one interface whatever the mode.

base          Path: the interface ``RemoteDSpark`` holds; NothingOpen
sync          ASYNC=0: the engine thread's own network round
asynchronous  ASYNC=1: the hand-off and the proxy host serving it, as one path
handoff       the engine's half of the hand-off through the region
proxy_host    the proxy as a thread or a supervised process; which one serves
redraw        SAMPLED_REDRAW=1: a path whose sampled drafts the engine redraws
announcing    rounds of at most round_tokens: long contexts announced in chunks
"""
