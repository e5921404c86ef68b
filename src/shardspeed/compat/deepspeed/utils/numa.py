"""DeepSpeed's ``deepspeed.utils.numa``: the core-list parser of the launcher's ``--bind_core_list``.

Its numactl helpers are not offered: shardspeed binds cores with ``sched_setaffinity`` instead.
"""

from shardspeed.launcher.cores import parse_range_list

__all__ = ["parse_range_list"]
