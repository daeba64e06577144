"""Phase 2: train a LoRA on the DiT from the phase-1 cache (see loop.py for the overview)."""
