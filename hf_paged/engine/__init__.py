"""The continuous-batching engine: requests scheduled on a shared BlockPool (see engine/ modules)."""
