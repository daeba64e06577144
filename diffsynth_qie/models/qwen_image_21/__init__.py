"""The Qwen-Image-2.1 family: its ops (``qwen21_ops.py``: ``Qwen21Ops``) and its pieces (``qwen21.py``:
encoding, per-sample DiT calls with the prefix KV cache, the schedule)."""
