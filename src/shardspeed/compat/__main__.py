"""``python -m shardspeed.compat script.py [args]``: run a DeepSpeed script on shardspeed."""

import sys

from shardspeed.compat import main

sys.exit(main())
