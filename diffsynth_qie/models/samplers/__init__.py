"""Samplers as pure functions of a velocity (``sampling.py``: flow matching with true CFG, the LBM bridge),
the bridge's math (``bridge.py``), what a schedule is asked for (``schedules.py``: ``ScheduleSpec``) and the
Lightning LoRAs' schedule (``lightning.py``). Each model family builds its schedule from a spec
(``FamilyOps.schedule``)."""
