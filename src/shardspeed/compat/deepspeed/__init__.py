"""DeepSpeed's module layout where shardspeed's rooms have no module of that name.

Under the deepspeed alias, `deepspeed.a.b` is shardspeed's own module when one exists (see
`shardspeed.compat.ALIASES`), else this package's `a/b.py`. Everything here is a thin re-export or
adapter over the rooms: no algorithm lives in this package. A package here whose room exists
(`ops/`, `utils/`, ...) only holds the missing modules, plus in `__all__` the names that DeepSpeed's
package has and the room's lacks, which the alias adds to the room's module when it is imported.
"""

from .git_version_info import git_branch as __git_branch__
from .git_version_info import git_hash as __git_hash__
from .runtime.config import DeepSpeedConfig

__all__ = ["DeepSpeedConfig", "__git_branch__", "__git_hash__"]
