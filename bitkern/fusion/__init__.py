"""Graph-level fusion pass: epilogue, horizontal and prologue stitching (not built yet)."""
