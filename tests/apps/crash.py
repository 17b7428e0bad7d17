"""A replica that never becomes ready: says why on stderr, then exits with code 3.

The reason is printed, not part of the command line, so a test can tell the replica's own log
(which has it) from the launch log (which only echoes the command).
"""

import os
import sys

print(
    f"replica {os.environ.get('CORRAL_REPLICA_ID', '?')}: cannot start: simulated config error",
    file=sys.stderr,
    flush=True,
)
sys.exit(3)
