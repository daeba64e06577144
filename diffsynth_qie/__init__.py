"""diffsynth-qie: fine-tune and serve Qwen-Image-Edit on top of DiffSynth-Studio.

Importing this package is cheap: nothing here imports torch or diffsynth at module
top. Sub-packages, lowest layer first (``tests/test_architecture.py`` keeps every import pointing down):

- ``utils``: logging, atomic writes, config dataclasses <-> CLI flags and their checks.
- ``models``: presets and families, pipeline loading, the batched DiT forward, encoding, samplers.
- ``tiny``: the tiny models for tests and CPU demos.
- ``lora``: LoRA state and file formats, merging, switching, extraction.
- ``memory``: FP8 base, block swapping, ZeRO-3 loading, ``qie plan``'s prediction.
- ``metrics``: PSNR, SSIM, LPIPS.
- ``fakegpu``: the fake CUDA device the real full-size graph runs on (checks, memory, verdict).
- ``data``: dataset formats, image loading/validation, demo data, samplers.
- ``cache``: phase 1 (text encoder + VAE) writing safetensors shards + manifest.
- ``training``: phase 2 (DiT only): losses, loop, checkpoints.
- ``inference``: the ``Editor`` API (flow-matching and LBM samplers).
- ``preflight``: the training step and the edit on the fake GPU, and the preflights of ``qie train`` / ``qie edit``.
- ``ui``: the Gradio mask-edit app.
- ``commands``: one module per ``qie`` subcommand (``cli.py`` dispatches).
"""

__version__ = "0.1.0"
