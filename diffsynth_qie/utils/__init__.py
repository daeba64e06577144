"""Small shared helpers: logging setup, atomic file writes, dataclass <-> CLI flags."""
