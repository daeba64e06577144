"""diffsynth-qie: fine-tune and serve Qwen-Image-Edit on top of DiffSynth-Studio.

Importing this package is cheap: nothing here imports torch or diffsynth at module
top. Sub-packages:

- ``models``: presets (edit / 2509 / 2511 / tiny), the tiny model builder, LoRA I/O,
  the batched DiT forward.
- ``data``: dataset formats, image loading/validation, demo data, samplers.
- ``cache``: phase 1 (text encoder + VAE) writing safetensors shards + manifest.
- ``training``: phase 2 (DiT only): losses, loop, checkpoints.
- ``inference``: the ``Editor`` API (flow-matching and LBM samplers).
- ``ui``: the Gradio mask-edit app.
"""

__version__ = "0.1.0"
