"""The Qwen-Image-Edit family (edit, 2509, 2511): its ops (``edit_ops.py``: ``EditOps``), prompt and image
encoding (``encoding.py``), the batched DiT forward (``forward.py``) and per-sample attention
(``attention.py``)."""
