"""TVM schedule templates per target, LOP3 decode functions, offline weight layout transforms (not built yet)."""
