"""GPU benchmarks of the LoRA training step and edit inference against DiffSynth's stock paths.

Not part of the installed package: run from the repository root
(``python -m benchmarks.train_step``, ``python -m benchmarks.inference``); see README.md.
"""
