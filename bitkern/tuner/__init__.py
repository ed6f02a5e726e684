"""Hardware descriptions (tTile-device), hint-based tile search and the traffic cost model (not built yet)."""
