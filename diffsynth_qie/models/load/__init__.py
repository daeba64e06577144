"""Loading: DiffSynth pipelines from a preset (``loading.py``), where the files are (``hub.py``), the DiT's weight
files (``dit_files.py``), host weights as mapped views (``host_weights.py``), which devices a command may use
(``devices.py``) and ``--compile`` (``compile.py``)."""
