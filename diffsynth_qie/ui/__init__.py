"""Mask-edit web UI: ``config`` (flags), ``handlers`` (pure, tested logic), ``app`` (Gradio layout).

Import ``app`` only where gradio is wanted; ``handlers`` and ``config`` need neither
gradio nor torch at import time.
"""
