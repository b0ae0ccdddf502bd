"""Suite-wide settings: every process group the tests start talks over loopback only."""

import os

# gloo picks the interface of the host name's address; tests must only ever use loopback
# (child processes started by torchrun, Lightning and Accelerate inherit this).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
