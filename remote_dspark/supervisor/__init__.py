"""The supervisor (:mod:`.restarts`): spawns the proxy, sees it die or stall, and
respawns it under a budget; its lifecycle as one typed value (:mod:`.states`); the warm
standby (:mod:`.standby`) it promotes on a loss."""
