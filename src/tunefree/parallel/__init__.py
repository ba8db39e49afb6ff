"""How one private run spans processes: the :class:`~.base.Parallelism` protocol and one process
(``base.py``), data parallel (``ddp.py``), sharded (``fsdp.py``) and pipeline stages (``stages.py``)."""
