"""The runs on the fake GPU (``fakegpu/``): one training step and one edit at full width, and the preflights
``qie train`` and ``qie edit`` make before a real preset loads.

Training: ``train_step.py`` (one step of the resolved ``RunConfig``), ``train_batch.py`` (the fake batch),
``train_extras.py`` (EMA, validation, rollouts, ``--compile``), ``train_onthefly.py`` (the on-the-fly encode),
``train.py`` (``qie train``'s preflight and its verdict). Editing: ``edit_step.py`` (one edit as ``qie edit``
makes it), ``edit_standins.py`` (the editor's stand-ins), ``edit.py`` (``qie edit``'s preflight). It sits above
``training/`` and ``inference/``, whose code it runs.
"""
