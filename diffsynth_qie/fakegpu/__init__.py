"""The fake GPU: a CUDA device with no memory and no arithmetic, on which the real full-size graph runs.

``device.py`` is the session (:class:`~.device.FakeCuda`); ``ops.py`` and ``checks.py`` refuse what a GPU run
would refuse (device and dtype mismatches, host reads, unsynchronised streams: ``streams.py``);
``accounting.py`` counts live device bytes and attributes them to our frames; ``backward.py`` walks the autograd
graph in the engine's order; ``standin21.py`` / ``standin_vl.py`` are the stand-ins of the parts of a family that
read the host; ``verdict.py`` judges a peak against a GPU. The runs on this device (a training step, an edit, the
preflights of ``qie train`` and ``qie edit``) are in ``preflight/``.
"""
