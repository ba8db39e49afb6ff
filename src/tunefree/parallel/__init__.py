"""How one private run spans processes: data parallel (``ddp.py``) and sharded (``fsdp.py``) training."""
