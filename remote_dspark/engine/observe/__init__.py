"""What observes the engine's rounds.

stats      EngineCounts (the engine thread's counting) and Stats (the one record)
statsfile  a JSON document written atomically to a path others may share
report     the periodic log line and the stats file
metrics    the engine's Prometheus collector and its scrape server
"""
