"""CPU code generation: weight layouts and schedule templates compiled by TVM through LLVM."""
